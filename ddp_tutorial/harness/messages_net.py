"""``ddp-tutorial explain``'s entries for what NCCL, gloo and the group's start-up say about
the machines and the processes: too many or too few processes at init, NCCL's own memory and
sockets, an address only this host can reach, a GPU another process holds, a launcher
signalled (harness/messages.py holds the rest of the catalogue)."""

from __future__ import annotations

import re

from ddp_tutorial.harness.known import Known

# c10d's store-based barrier at init: "(world_size=4, worker_count=8, timeout=0:30:00)"
COUNTS = re.compile(r"store.based barrier[^\n]*\(world_size=(\d+), worker_count=(\d+)")


def _counts(text: str) -> tuple[int, int] | None:
    hit = COUNTS.search(text)
    return (int(hit.group(1)), int(hit.group(2))) if hit else None


def _too_many(text: str) -> bool:
    return (counts := _counts(text)) is not None and counts[1] > counts[0]


def _too_few(text: str) -> bool:
    return (counts := _counts(text)) is not None and counts[1] < counts[0]


def counts_differ(text: str) -> bool:
    """The init barrier counted more or fewer processes than world_size (entries below)."""
    return _too_many(text) or _too_few(text)


NET: tuple[Known, ...] = (
    Known(
        "too-many-processes",
        COUNTS.pattern,
        "more processes joined the group than world_size: the job was started twice into one "
        "rendezvous (srun -n N around a script that spawns N more, torchrun inside mp.spawn), "
        "or two jobs share one MASTER_PORT or init file",
        "one launcher per node (torchrun, or srun with one task per GPU and no spawn in the "
        "script); a port of its own for each job",
        "10",
        when=_too_many,
    ),
    Known(
        "processes-missing-at-init",
        COUNTS.pattern,
        "fewer processes reached init_process_group than world_size: the others crashed or "
        "hang before it (their own output says why), or were never started (--nnodes, "
        "--nproc-per-node, srun's task count)",
        "read the missing ranks' first error; count the processes each node starts",
        "10",
        when=_too_few,
    ),
    Known(
        "nccl-out-of-memory",
        r"NCCL WARN (?:Cuda failure '?out of memory|Failed to CUDA calloc)",
        "NCCL could not allocate its buffers on the GPU: the model, its activations or another "
        "process left no room (NCCL allocates at the first collective of each communicator)",
        "leave headroom: a smaller batch, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
        "nvidia-smi for other processes on the GPU",
        "03",
    ),
    Known(
        "nccl-mismatched-collective",
        r"NCCL WARN Mismatched collective detected",
        "the ranks called different collectives, or the same ones in another order: a "
        "collective in a rank-dependent branch, or a loop that runs more times on one rank",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL names the first mismatch with its ranks' stacks; every "
        "rank calls the same collectives in the same order",
        "09",
    ),
    Known(
        "nccl-socket",
        r"Socket recv failed while polling|socketProgress: Connection closed by remote peer|"
        r"Call to connect returned Connection refused",
        "NCCL's connection to another node failed: that node's process died (its log says "
        "why), or NCCL chose a network interface the nodes cannot reach each other on (a "
        "docker bridge, a second NIC), or a firewall blocks its ports",
        "read the other nodes' first error; NCCL_SOCKET_IFNAME=<the interface the nodes share "
        "(ip addr)>; NCCL_DEBUG=INFO prints the one it chose",
        "10",
    ),
    Known(
        "gloo-loopback",
        r"connect \[127\.\d+\.\d+\.\d+\]:\d+: Connection refused",
        "gloo tried to reach a process at a loopback address: this host's name resolves to "
        "127.0.1.1 (/etc/hosts), so each node advertises an address only it can reach",
        "GLOO_SOCKET_IFNAME=<the interface the nodes share> (NCCL_SOCKET_IFNAME for nccl), or "
        "a hostname that resolves to that interface's address",
        "10",
    ),
    Known(
        "device-side-assert",
        r"device-side assert triggered",
        "a CUDA kernel's own check failed - most often an index out of range (the assert "
        "above it says 'index out of bounds': a label >= num_classes, an id >= an "
        "embedding's size); CUDA reports it at the next call, often a collective or the "
        "watchdog's, so the line shown misleads",
        "rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the kernel; check the data's ranges on "
        "the CPU (y.max() < num_classes)",
        "09",
    ),
    Known(
        "module-device",
        r"module must have its parameters and buffers on device \S+ \(device_ids\[0\]\)",
        "the model is on another GPU than device_ids[0] names (moved with one index, wrapped "
        "with another)",
        "torch.cuda.set_device(LOCAL_RANK); model.to(f'cuda:{LOCAL_RANK}'); "
        "DDP(model, device_ids=[LOCAL_RANK]): one index for all three",
        "04",
    ),
    Known(
        "cuda-device-busy",
        r"CUDA-capable device\S* (?:is/are|are) busy or unavailable",
        "CUDA refused this process a context on a GPU: the GPU is in compute mode "
        "EXCLUSIVE_PROCESS (one process per GPU, common on shared clusters) and another process "
        "holds it - often another rank of this job that touched cuda:0 (a tensor or a "
        "torch.load before set_device, the same device on every rank) - or another job does",
        "torch.cuda.set_device(LOCAL_RANK) before any CUDA call, every tensor on that device "
        "(map_location on loads); nvidia-smi shows the compute mode ('E. Process') and which "
        "processes hold each GPU",
        "03",
    ),
    Known(
        "launcher-signalled",
        r"Received \d+ death signal, shutting down workers",
        "torchrun itself got a signal and stopped its ranks (the next lines name it: SIGHUP "
        "when the terminal or ssh session that started it closed, SIGTERM from a scheduler or "
        "kill): not a failure of the code",
        "start long jobs so that a closed session cannot stop them: tmux or screen, setsid, "
        "or a scheduler (sbatch); to keep the work of a SIGTERM: lesson 08",
        "08",
        when=lambda text: "SignalException" not in text,  # torch's own line: job-signalled
    ),
)
