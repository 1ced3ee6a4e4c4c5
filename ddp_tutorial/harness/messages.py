"""The catalogue of ``ddp-tutorial explain``: each message it knows, its cause, fix and lesson.

A line alone can mislead: "Missing key(s) in state_dict" is a 'module.' prefix only when the
other list holds the same names with it. So an entry may read the whole log: ``when`` decides
whether it applies, ``detail`` adds what this log says (other ranks' memory on a full GPU).
"""

from __future__ import annotations

from ddp_tutorial.harness.known import Known
from ddp_tutorial.harness.log_details import (
    cuda_failure,
    dtensor_file,
    killed_rank,
    other_processes,
    prefix_explains,
    reset_at_init,
    said_if,
)
from ddp_tutorial.harness.messages_code import CODE
from ddp_tutorial.harness.messages_launch import LAUNCH
from ddp_tutorial.harness.messages_net import NET

# a line from an HTTP client (a download, a logger's upload) is no rendezvous or collective
NOT_HTTP = r"^(?!.*(?:urlopen|HTTPS?Connection|Max retries exceeded|requests\.|urllib3))"

KNOWN: tuple[Known, ...] = (
    Known(
        "nccl-watchdog",
        r"Watchdog caught collective operation timeout|"
        r"ProcessGroupNCCL::WorkNCCL::checkTimeout|ncclCommWatchdog",  # its C++ frames alone
        "a collective ran past the process group's timeout on the GPU: some rank never "
        "called it (a desync: a collective in a rank-dependent branch, a rank with more "
        "batches) or called it much later (rank 0 working alone)",
        "find the rank that fell behind (below); TORCH_DISTRIBUTED_DEBUG=DETAIL names "
        "mismatched collectives; a short timeout while debugging",
        "09",
    ),
    Known(
        "gloo-timeout",
        r"Timed out waiting \d+ms for (send|recv) operation|Application timeout caused pair",
        "a rank waited in a collective longer than the timeout: its partner was elsewhere "
        "(a different collective, rank-0-only work, one batch more)",
        "compare where each rank waited (below, when the ranks' tracebacks are in the log): "
        "different lines are a desync; the same "
        "collective with one rank late is slow work (move it before init, or a longer "
        "timeout); a rank with more batches: DistributedSampler (equal counts) or Join",
        "09",
    ),
    Known(
        "monitored-barrier",
        r"Rank (?P<rank>\d+) failed to pass monitoredBarrier|"
        r"successfully reached monitoredBarrier, but received errors",
        "dist.monitored_barrier named the rank that never arrived (rank 0 names the one it "
        "waited for)",
        "read that rank's path: what made it skip the collective the others are in",
        "09",
    ),
    Known(
        "unused-parameters",
        r"Expected to have finished reduction in the prior iteration",
        "DDP waited for gradients of parameters that forward() did not use",
        "remove or freeze them; find_unused_parameters=True if the set changes each step; "
        "static_graph=True if it never does",
        "09",
        detail=said_if(
            r"not compatible with static_graph set to True",
            "static_graph=True is "
            "set and this step used another set of parameters than the first: "
            "drop it (find_unused_parameters=True if the set changes)",
        ),  # fmt: skip
    ),
    Known(
        "static-graph-changed",
        r"Your training graph has changed in this iteration",
        "static_graph=True promised the same parameters in every step; this one used others",
        "drop static_graph=True (find_unused_parameters=True if the set changes)",
        "04",
    ),
    Known(
        "model-mismatch",
        r"DDP expects same model across all ranks|"
        r"appears not to match (?:sizes|strides) of the same param in process",
        "the ranks built different models: a rank-dependent branch or config, weights loaded "
        "on some ranks only into a model whose shape they change",
        "build the model the same way on every rank before DDP; load weights on every rank, "
        "or before wrapping",
        "04",
    ),
    Known(
        "ddp-before-to",
        r"device_ids and output_device arguments only work with",
        "DDP(model, device_ids=[...]) wrapped a model still on the CPU (or on several devices)",
        "model.to(device) first, then DDP(model, device_ids=[local_rank]); a model on the "
        "CPU takes no device_ids: DDP(model)",
        "04",
    ),
    Known(
        "nccl-remote-error",
        r"ncclRemoteError",  # not "Some NCCL operations have failed": every timeout says it
        "NCCL on this rank saw a peer fail: its process exited (a crash, the OOM killer) or "
        "the network between the nodes dropped; this rank is rarely the cause",
        "find the rank that failed first (its own traceback; dmesg for a kill); between "
        "nodes, NCCL_DEBUG=INFO names the transport and the peer",
        "09",
    ),
    Known(
        "unused-search",
        r"find_unused_parameters=True was specified in DDP constructor, but did not find",
        "a warning: DDP(find_unused_parameters=True) walks the autograd graph after every "
        "forward to find unused parameters, and this step had none",
        "drop the flag if no step leaves parameters unused (a model whose branches change "
        "per step keeps it); static_graph=True if the set never changes",
        "04",
    ),
    Known(
        "ready-twice",
        r"marked (as )?ready twice|mark a variable ready only once",
        "one parameter's gradient arrived twice in one backward: reentrant activation "
        "checkpointing, or a module shared across forward passes, under DDP",
        "checkpoint(..., use_reentrant=False), or DDP(static_graph=True)",
        "04",
    ),
    Known(
        "mismatched-collectives",
        r"Detected mismatch between collectives on ranks|"
        r"Received data size doesn't match expected size|"  # gloo's, before it aborts
        r"op\.preamble\.length <= op\.nbytes",  # gloo's, a recv shorter than the send
        "ranks called different collectives, or the same one with different shapes or "
        "dtypes (TORCH_DISTRIBUTED_DEBUG=DETAIL compares them - not beside DDP on a machine "
        "without a GPU, where it crashes DDP's constructor; gloo aborts the rank)",
        "a collective outside rank-dependent branches; shapes that do not depend on the "
        "data (bincount(..., minlength=K)); gradient buckets of different sizes: the forward "
        "took another path on some ranks (a text-only batch skipping a vision tower) - run "
        "every parameter on every rank (a dummy pass), or find_unused_parameters=True",
        "09",
    ),
    Known(
        "duplicate-gpu",
        r"Duplicate GPU detected|Multiple Ranks are using the same GPU",  # NCCL < 2.2x, 2.30
        "two ranks of one nccl group use the same GPU: torch.cuda.set_device was not called "
        "with LOCAL_RANK, or more ranks than GPUs",
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init; "
        "--nproc-per-node at most the number of GPUs",
        "03",
    ),
    Known(
        "barrier-device",
        r"using GPU \d+ to perform barrier|using GPU \d+ as device used by this process|"
        r"barrier\(\): using the device under current context|Guessing device ID based on",
        "the process group does not know this rank's GPU, so barrier() guessed one (the "
        "current device, or one from the global rank)",
        "init_process_group(..., device_id=torch.device('cuda', local_rank))",
        "03",
    ),
    Known(
        "weights-only",
        r"Weights only load failed|WeightsUnpickler error",
        "torch.load(weights_only=True), the default since torch 2.6, refused an object "
        "that would run code when unpickled (a class, a function, an argparse Namespace)",
        "save plain state (tensors, numbers, strings, dicts); or allow a type you trust "
        "with torch.serialization.add_safe_globals; never weights_only=False on a file "
        "you did not write",
        "05",
        detail=dtensor_file,
    ),
    Known(
        "libuv",
        r"use_libuv was requested but PyTorch was buil[dt] without libuv",
        "this torch (Windows, some macOS builds) has no libuv for TCPStore, which torchrun "
        "asks for by default",
        "USE_LIBUV=0 in the environment of the launch",
        "01",
    ),
    Known(
        "address-in-use",
        r"EADDRINUSE|errno: 98 - Address already in use|"
        r"^(?:\[rank\d+\]:)?\s*RuntimeError: Address already in use",
        "the rendezvous port is taken (a --master-port given, or an older torchrun, whose "
        "default is 29500 - torch 2.14's picks a free port on one node; MASTER_PORT is read by "
        "launches without torchrun, or the script sets it itself): another job on "
        "this machine, or a leftover of an earlier one; under --standalone, whose port is "
        "free, two processes that both act as rank 0 (a hard-coded --local_rank 0 or rank) "
        "or a second init_process_group in the script",
        "on one machine leave the port out (torchrun --standalone); across machines a port "
        "you know is free; find leftovers with ps; a change of MASTER_PORT that changes "
        "nothing: the script sets the port (or init_method='tcp://...') itself - search it "
        "for 29500",
        "09",
    ),
    Known(
        "address-family",
        r"Address family not supported by protocol|errno: 97|\(errno 97\)",
        "c10d tried an IPv6 address this host (or container) cannot use. Alone, as a warning "
        "([W socket.cpp]), it is harmless: the connection goes on over IPv4",
        "only if the rendezvous then fails: set MASTER_ADDR to the IPv4 address of the rank-0 "
        "node (not its name); check what the name resolves to with getent hosts NAME",
        "10",
    ),
    Known(
        "name-resolution",
        NOT_HTTP + r".*(?:Name or service not known|nodename nor servname provided|"
        r"Temporary failure in name resolution|"
        r"[Ff]ailed to resolve (the )?(address|hostname)|getaddrinfo failed)",
        "MASTER_ADDR (or the rank-0 agent's hostname, which torchrun hands to the others) "
        "does not resolve on this node",
        "use an address every node can reach (--rdzv-endpoint IP:PORT), or "
        "--local-addr on the rank-0 node so it advertises an address, not its name",
        "10",
    ),
    Known(
        "main-attribute",
        r"Can't get attribute '\w+' on <module '__main__' "
        r"(?:\(built-in\)|\(<class '_frozen_importlib.BuiltinImporter'>\)|from '<stdin>'|"
        r"from '[^']*ipykernel)",  # (built-in) until Python 3.11; not a script's: a pickle
        "a spawned process (mp.spawn, DataLoader workers with spawn/forkserver) could not "
        "find a class or function defined in __main__ of a notebook or an interactive session",
        "define it in a .py file and import it; or start the processes with torchrun on a script",
        "01",
    ),
    Known(
        "cuda-fork",
        r"Cannot re-initialize CUDA in forked subprocess",
        "the parent started CUDA before it forked (a DataLoader worker, multiprocessing or "
        "a notebook launcher with fork): a child cannot use it. Asking is enough - "
        "torch.cuda.is_available(), and what calls it for you on the CPU too: an optimizer "
        "step (Adam, AdamW, RMSprop...; torch 2.14), DataLoader(pin_memory=True), "
        "nn.DataParallel(...), torchrun's LaunchConfig(...) - though on a machine without a "
        "GPU torch.cuda.is_initialized() still says False (with one, most go on to initialise)",
        "nothing of that in the parent before forking (train, build loaders in the child); "
        "PYTORCH_NVML_BASED_CUDA_CHECK=1 makes is_available() ask NVML instead; or the spawn "
        "start method (or torchrun). In DataLoader workers (the parent of a DDP rank always "
        "uses CUDA): no CUDA in the Dataset or collate_fn - CPU tensors, moved to the GPU in "
        "the training loop - or DataLoader(multiprocessing_context='spawn')",
        "01",
    ),
    Known(
        "dataloader-killed",
        r"DataLoader worker \(pid\(?s?\)? [^)]*\) is killed by signal|"
        r"DataLoader worker \(pid \d+\) is killed|"
        r"DataLoader worker \(pids?\(?s?\)? [\d, ]+\) exited unexpectedly",
        "a DataLoader worker died: killed by the OOM killer (host RAM: ranks x workers x "
        "dataset), by a Bus error (/dev/shm too small), by the scheduler's signal, or by its "
        "own code (an exception: exit code 1; a crash in a C extension: Segmentation fault)",
        "fewer workers or a smaller dataset in RAM (tensors, not Python lists); in a "
        "container --shm-size or --ipc=host; on preemption let the rank save first; "
        "num_workers=0 shows the worker's own error",
        "12",
    ),
    Known(
        "bus-error",
        r"\bBus error\b|insufficient shared memory \(shm\)|unable to write to file </torch_",
        "shared memory (/dev/shm) ran out: DataLoader workers pass batches through it",
        "a larger /dev/shm (docker --shm-size=8g or --ipc=host), fewer workers, smaller batches",
        "12",
    ),
    Known(
        "no-destroy",
        r"destroy_process_group\(\) was not called|"
        r"NCCL communicator hasn't been destroyed",  # torch 2.14's own words
        "the process exited with its process group still open",
        "dist.destroy_process_group() at the end of main(), in a finally:",
        "09",
    ),
    Known(
        "terminate-at-exit",
        r"terminate called without an active exception",
        "a C++ thread still ran when the process ended (a generic abort). At exit, after "
        "training, the usual one is the process group's threads outliving the interpreter "
        "(torch.distributed.nn imported after init); mid-training, read the lines before it",
        "at exit: import torch.distributed.nn before init_process_group, and call "
        "destroy_process_group() before exiting",
        "09",
    ),
    Known(
        "local-rank-argument",
        r"unrecognized arguments: --local[-_]rank",
        "torch.distributed.launch passes --local-rank=N (a dash since torch 2.0) to a "
        "script whose parser does not declare it",
        "start with torchrun and read int(os.environ['LOCAL_RANK']); while migrating "
        "declare both spellings",
        "09",
    ),
    Known(
        "child-failed",
        r"ChildFailedError",
        "torchrun's summary that a rank failed; the cause is not in this traceback",
        "read 'Root Cause (first observed failure)' below it: that rank's error_file or its "
        "own lines ([rankN]: ...) above hold the real traceback",
        "09",
        detail=killed_rank,
    ),
    Known(
        "full-mesh",
        r"connectFullMesh failed|Gloo connectFullMesh",
        "gloo could not connect to a peer: after a restart, the address of a process of "
        "the last attempt (stale keys in the store); on several nodes, an interface the "
        "others cannot reach",
        "a restarted job joins through keys of its own attempt; on several nodes set "
        "GLOO_SOCKET_IFNAME to the interface they share",
        "08",
    ),
    Known(
        "nccl-system-error",
        r"unhandled system error",
        "NCCL failed in the system below it: /dev/shm, the network (InfiniBand, sockets), "
        "or GPUs it cannot reach",
        "rerun with NCCL_DEBUG=INFO and read the first WARN line; in containers "
        "--ipc=host; NCCL_SOCKET_IFNAME for the right interface",
        "10",
    ),
    Known(
        "peer-closed",
        NOT_HTTP + r".*Connection (?:closed|reset) by peer(?!')",  # not an HTTP client's repr
        "a peer process is gone: it crashed or was killed, and this rank noticed in a "
        "collective - or it exited before a transfer of its own ended (an isend never "
        "waited on, no barrier before it returned)",
        "find the first rank that failed (torchrun's Root Cause), not this one; when none "
        "failed: .wait() every isend/irecv request (or a barrier) before a rank returns",
        "09",
        detail=reset_at_init,
    ),
    Known(
        "wrapper-keys",
        r"(Missing|Unexpected) key\(s\) in state_dict",
        "weights saved from a wrapper carry its prefix the plain model lacks, DDP's 'module.' "
        "or torch.compile's '_orig_mod.' (or the other way round)",
        "save model.module.state_dict() (compiled: the model before compiling); strip old "
        "files' prefixes with consume_prefix_in_state_dict_if_present (not k[7:])",
        "05",
        when=prefix_explains,
    ),
    Known(
        "torn-file",
        r"storage has wrong size|PytorchStreamReader failed reading (zip archive|file .*"
        r"invalid header or archive is corrupted)",
        "a checkpoint file written by several processes at once, or cut off mid-write",
        "one writer (global rank 0), writing to a temporary file then renaming it",
        "05",
    ),
    Known(
        "invalid-ordinal",
        r"invalid device ordinal",
        "a rank asked for a GPU that does not exist here: the global rank used as a GPU "
        "index, or more ranks than GPUs",
        "cuda:LOCAL_RANK; --nproc-per-node at most the GPUs this node has",
        "03",
    ),
    Known(
        "no-group",
        r"Default process group has not been initialized",
        "a torch.distributed call ran before init_process_group (or after destroy)",
        "init_process_group first; guard single-process code with dist.is_initialized()",
        "01",
    ),
    Known(
        "state-dict-keys",
        r"(Missing|Unexpected) key\(s\) in state_dict",
        "the file's names are not the model's, and not by a wrapper's prefix: layers renamed, "
        "added or removed, or another architecture",
        "compare the two lists; strict=False only for layers you mean to skip, then check "
        "the missing and unexpected keys that load_state_dict returns",
        "05",
        when=lambda text: not prefix_explains(text),
    ),
    Known(
        "nccl-unique-id",
        r"re(?:trie|trei)ving ncclUniqueId[^\n]*(?:Socket Timeout|[Tt]imed? ?out|error)",
        "rank 0 did not reach the first NCCL collective in time: busy alone (building or "
        "downloading the dataset before it), crashed, or unreachable",
        "rank-0-only preparation before init, or within the timeout (lesson 02: rank 0 "
        "first); read rank 0's own log; across nodes NCCL_SOCKET_IFNAME",
        "02",
    ),
    Known(
        "cuda-oom",
        r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory",
        "a GPU is full. Other processes listed on this GPU ('Process N has X MiB memory in "
        "use') are other ranks' CUDA contexts: set_device(LOCAL_RANK) missing, or torch.load "
        "without map_location; none listed: this rank's batch or model is too large",
        "torch.cuda.set_device(LOCAL_RANK) before any CUDA call; torch.load(..., "
        "map_location=f'cuda:{local_rank}'); else a smaller batch per rank (lesson 12)",
        "03",
        detail=other_processes,
    ),
    *NET,  # NCCL, gloo and the group's start-up on the machines: messages_net.py
    *LAUNCH,  # how jobs start and end: harness/messages_launch.py
    *CODE,  # what the code handed to torch, and what C++ or the GPU said: messages_code.py
    Known(
        "no-nccl",
        r"Distributed package doesn't have NCCL built in|"
        r"ProcessGroupNCCL is only supported with GPUs",
        "nccl asked for where there is none: this torch has no NCCL (Windows, macOS, a CPU "
        "build), or this machine no GPU",
        "backend='gloo' here",
        "01",
    ),
    Known(
        "no-backend-for-device",
        r"No backend type associated with device type|Tensors must be CUDA and dense",
        "a CPU tensor in a collective of an nccl-only group",
        "move the tensor to the group's device, or init_process_group(backend="
        "'cpu:gloo,cuda:nccl')",
        "01",
    ),
    Known(
        "nccl-heartbeat",
        r"Heartbeat monitor timed out|watchdog got stuck for \d+ seconds",
        "the NCCL watchdog thread itself was blocked: behind a hung collective or CUDA call, "
        "often at exit or teardown",
        "find the stuck rank and collective (the watchdog's lines, a stack dump); raise "
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC only once you know why",
        "09",
    ),
    Known(
        "inplace-modified",
        r"by an inplace operation",  # "modified" can be wrapped onto the line before
        "a tensor that autograd saved was changed in place before backward: a parameter "
        "edited between forward and backward (clipping weights, an EMA, mul_ under "
        "no_grad), an optimizer.step() between two backwards through one graph (a GAN), an "
        "in-place op on a saved activation; under DDP with BatchNorm and two forwards before "
        "one backward, also DDP's buffer copy (torch 2.6 until pytorch#175851; 2.14 has the "
        "fix)",
        "torch.autograd.set_detect_anomaly(True) names the op; edit in place after backward, "
        "or on a clone; BatchNorm under DDP: a torch with the fix, broadcast_buffers=False, "
        "or one forward over both halves (another model: lesson 04 shows why)",
        "04",
    ),
    Known(
        "nccl-unhandled-cuda",
        r"unhandled cuda error|ncclUnhandledCudaError",
        "a CUDA call inside NCCL failed, often after an earlier CUDA error on that rank",
        "read its 'Cuda failure' line; rerun with NCCL_DEBUG=INFO and CUDA_LAUNCH_BLOCKING=1",
        "09",
        detail=cuda_failure,
    ),
)
