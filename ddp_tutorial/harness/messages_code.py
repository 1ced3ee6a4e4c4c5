"""``ddp-tutorial explain``'s catalogue, continued (harness/messages.py): what the training
code handed to torch - a model DDP cannot take, tensors on two devices, a function a worker
cannot receive - and what a rank's C++ side or its GPU then said. Each message was pasted by a
new user of the course (helper 103) and got "no message this course knows"."""

from __future__ import annotations

from ddp_tutorial.harness.known import Known

CODE: tuple[Known, ...] = (
    Known(
        "unpicklable-function",
        r"Can't pickle <function <lambda>|Can't pickle local object|Can't get local object",
        "a process started with spawn or forkserver (DataLoader workers there - the template's "
        "forkserver, macOS's and Windows' default - or mp.spawn) receives what it runs by "
        "pickle, and a lambda or a function defined inside another cannot be pickled",
        "define the function (a transform, a collate_fn, a worker_init_fn) at module level; "
        "functools.partial of one is fine",
        "01",
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
        "later, at whatever call comes next (often a collective), so the line shown misleads",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the kernel itself; check the data's "
        "ranges on the CPU (y.max() < num_classes)",
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
        "killed-sigabrt",
        r"exitcode\s*:\s*-6\b|Signal 6 \(SIGABRT\)",
        "a rank aborted in C++: an uncaught C++ exception or a failed check (gloo's enforce, "
        "NCCL, an assert); its 'terminate called' and 'what():' lines say which",
        "read the rank's 'what():' line above torchrun's summary: a collective of another size "
        "or kind on another rank is the usual cause under gloo",
        "09",
    ),
)
