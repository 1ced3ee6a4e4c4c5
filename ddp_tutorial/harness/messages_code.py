"""``ddp-tutorial explain``'s catalogue, continued (harness/messages.py): what the training
code handed to torch - a model DDP cannot take, tensors on two devices, a function a worker
cannot receive - and what a rank's C++ side or its GPU then said. Each message was pasted by a
new user of the course (helper 103) and got "no message this course knows"."""

from __future__ import annotations

from ddp_tutorial.harness.known import Known
from ddp_tutorial.harness.log_details import after_spawn_marker, said_if

CODE: tuple[Known, ...] = (
    Known(
        "unpicklable-function",
        r"Can't pickle <function <lambda>|Can't pickle local object|Can't get local object",
        "something sent by pickle held a lambda or a function defined inside another, which "
        "cannot be pickled: what a process started with spawn or forkserver runs (DataLoader "
        "workers there - the template's forkserver, macOS's and Windows' default - or "
        "mp.spawn), or the object of a *_object collective (all_gather_object, "
        "broadcast_object_list)",
        "define the function (a transform, a collate_fn, a worker_init_fn) at module level; "
        "functools.partial of one is fine; through a *_object collective send plain data "
        "(numbers, strings, tensors, dicts of them)",
        "01",
        detail=said_if(
            r"in (?:all_gather_object|broadcast_object_list|gather_object|scatter_object_list"
            r"|send_object_list|recv_object_list)\b",
            "the traceback goes through a *_object collective: it pickles its argument, so "
            "that object (or one it holds) is the lambda - no process was started",
        ),
    ),
    Known(
        "devices-differ",
        r"Expected all tensors to be on the same device",
        "one operation got tensors on two devices: under DDP each rank's model is on "
        "cuda:LOCAL_RANK, and the batch, the targets, a tensor made in forward or the loss's "
        "weights stayed on the CPU or went to another rank's GPU (cuda:0, cuda:RANK)",
        "batch.to(device) with device = torch.device('cuda', LOCAL_RANK); tensors made in "
        "forward with device=x.device; module state as registered buffers, which move with it",
        "03",
    ),
    Known(
        "no-trainable-parameters",
        r"DistributedDataParallel is not needed when a module doesn't have any parameter",
        "DDP was given a module whose parameters are all frozen (requires_grad=False): an "
        "evaluation or teacher model, or one frozen before the wrap - there is nothing to "
        "average",
        "wrap only the modules you train; run a frozen one as it is on each rank",
        "04",
    ),
    Known(
        "lazy-parameters",
        r"Modules with uninitialized parameters can't be used with",
        "the model has lazy layers (nn.LazyLinear, LazyConv...): their shapes exist only after "
        "a forward, and DDP needs them at construction to broadcast and bucket them",
        "run one forward on a dummy batch of the right shape, then DDP(model)",
        "04",
    ),
    Known(
        "illegal-memory-access",
        r"an illegal memory access was encountered",
        "a CUDA kernel read or wrote outside its memory - most often an index out of range (a "
        "label >= num_classes in cross_entropy, an id >= an embedding's size); CUDA reports it "
        "later, at whatever call comes next (often a collective), so the line shown misleads; "
        "in NCCL itself (its watchdog's or 'NCCL WARN Cuda failure 700' line, no kernel of "
        "yours) a P2P, driver or NCCL version fault",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the kernel itself; check the data's "
        "ranges on the CPU (y.max() < num_classes); inside NCCL: nccl-tests, "
        "NCCL_P2P_DISABLE=1, a newer NCCL and driver",
        "09",
    ),
    Known(
        "gpu-count-changed",
        r"device >= 0 && device < num_gpus",
        "torch counted more GPUs than CUDA lets this process use: a GPU in MIG mode (NVML "
        "counts the physical GPUs, a CUDA process sees one MIG instance at most), or - before "
        "torch 2.4 - CUDA_VISIBLE_DEVICES changed inside the script after the GPUs were counted",
        "set CUDA_VISIBLE_DEVICES before Python starts (the shell, the job script), never in "
        "the script; under MIG, one instance per process (CUDA_VISIBLE_DEVICES=MIG-<uuid> "
        "from nvidia-smi -L), so one node cannot run several DDP ranks on one GPU's instances",
        "03",
    ),
    Known(
        "gloo-interface-missing",
        r"Unable to find address for",
        "GLOO_SOCKET_IFNAME names an interface this node does not have, or one without an "
        "address (interface names differ between machines: eth0, ens5, ib0)",
        "set it to an interface every node has (`ip -br addr`), or unset it; "
        "`ddp-tutorial doctor` checks it",
        "10",
    ),
    Known(
        "nccl-communicator-aborted",
        r"NCCL communicator was aborted",
        "this rank's NCCL communicator was aborted because of an error or a timeout - on this "
        "rank or another: the message is a consequence, not the cause",
        "find the first failure: the earliest error in the log, the watchdog's timeout line, "
        "torchrun's Root Cause",
        "09",
    ),
    Known(
        "killed-sigbus",
        r"exitcode\s*:\s*-7\b|Signal 7 \(SIGBUS\)",
        "a rank died of SIGBUS: almost always shared memory (/dev/shm) running out, which "
        "DataLoader workers pass their batches through (a container's is 64 MB by default)",
        "a larger /dev/shm (docker --shm-size=8g or --ipc=host; Kubernetes: an emptyDir with "
        "medium Memory at /dev/shm), fewer workers or smaller batches",
        "12",
    ),
    Known(
        "collective-sizes",
        r"invalid tensor size at index \d+ \(expected|invalid output tensor list at index|"
        r"outputShape\[0\] \* worldSize == inputShape\[0\]",
        "a collective's buffers do not have the sizes the call needs: all_gather_into_tensor's "
        "output holds world_size x the input's elements, reduce_scatter_tensor's input "
        "world_size x the output's, all_gather's list one tensor per rank, each of the input's "
        "shape (gloo refuses; a failed check aborts the rank)",
        "size them from the input and the world size: torch.empty(world_size * x.numel(), "
        "dtype=x.dtype, device=x.device), [torch.empty_like(x) for _ in range(world_size)]; "
        "data whose length differs by rank: gather the lengths, pad to the longest, trim",
        "01",
    ),
    Known(
        "send-to-self",
        r"Invalid (?:destination|source) rank: (?:destination|source) rank should not be",
        "a send or a receive named this rank itself as its peer",
        "dst=(rank + 1) % world_size, src=(rank - 1) % world_size (a ring); in a world of "
        "one there is no peer: skip the exchange",
        "01",
    ),
    Known(
        "sampler-rank",
        r"Invalid rank \d+, rank should be in the interval \[0, \d+\]",
        "DistributedSampler was given num_replicas (or rank) by hand, and it does not fit "
        "this job: a rank at or past num_replicas (where it does not raise, such a number "
        "splits the data wrong without a word)",
        "DistributedSampler(dataset) alone: it reads the world size and the rank from the "
        "process group",
        "02",
    ),
    Known(
        "syncbn-cpu",
        r"SyncBatchNorm layers only work with GPU modules|"
        r"SyncBatchNorm expected input tensor to be on GPU",
        "SyncBatchNorm has GPU kernels only: on a CPU (gloo) run it refuses",
        "convert_sync_batchnorm only where the device is a GPU (device.type == 'cuda'); on "
        "the CPU keep BatchNorm, and average its buffers over the ranks before evaluating "
        "and saving",
        "04",
    ),
    Known(
        "ddp-attribute",
        r"'DistributedDataParallel' object has no attribute",
        "DDP wraps the model: the model's own methods and attributes are on model.module",
        "model.module.<name>; a method other than forward (generate, encode) through "
        "model.module skips DDP's gradient sync: for evaluation or inference, not for a "
        "training step",
        "04",
    ),
    Known(
        "worker-raised",
        r"Caught \w+ in DataLoader worker process \d+",
        "a DataLoader worker raised while loading a sample, and the rank raised it again: the "
        "error is the dataset's, a transform's or collate_fn's, not DDP's",
        "read the 'Original Traceback' below this line, in the worker; num_workers=0 loads in "
        "the rank itself (pdb then stops there)",
        "06",
    ),
    Known(
        "too-many-open-files",
        r"Too many open files|received 0 items of ancdata",
        "DataLoader workers hand their tensors over through shared memory, one open file "
        "descriptor each (the file_descriptor strategy, Linux's default), beyond the "
        "process's limit (ulimit -n); a worker or the rank then fails, or the rank waits "
        "for a batch that never comes",
        "torch.multiprocessing.set_sharing_strategy('file_system') at the top of the "
        "script, or a higher limit (ulimit -n, the job's nofile); fewer, larger tensors per "
        "sample (stack them in collate_fn); fewer workers or a lower prefetch_factor",
        "06",
    ),
    Known(
        "spawn-raised",
        r"-- Process \d+ terminated with the following error:",
        "a process started by torch.multiprocessing.spawn raised: spawn raises it again in "
        "the parent, with the process's traceback after this line",
        "read the traceback after that line (its last line is the error); torchrun instead "
        "of mp.spawn gives each rank's lines its prefix",
        "01",
        detail=after_spawn_marker,
    ),
    Known(
        "killed-sigabrt",
        r"exitcode\s*:\s*-6\b|Signal 6 \(SIGABRT\)",
        "a rank aborted in C++: an uncaught C++ exception or a failed check (gloo's enforce, "
        "NCCL, an assert); its 'terminate called' and 'what():' lines say which",
        "read the rank's 'what():' line above torchrun's summary: a collective of another size "
        "or kind on another rank is the usual cause under gloo",
        "09",
    ),
)
