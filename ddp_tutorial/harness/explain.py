"""``ddp-tutorial explain LOG``: what the DDP, torchrun, gloo and NCCL messages in a log mean.

For each known message in a log (a file, or stdin): its cause, the fix and the lesson that
shows it. Read together, the ranks' lines also say where each rank failed (its last line of
your code) and, from the NCCL watchdog's, which rank never reached the collective.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ddp_tutorial.harness.rank_lines import lagging_ranks, rank_of, where_ranks_failed


@dataclass(frozen=True)
class Known:
    """A message, what causes it, what fixes it, and where the course shows it."""

    key: str
    pattern: str
    cause: str
    fix: str
    lesson: str

    def search(self, line: str) -> re.Match[str] | None:
        return re.search(self.pattern, line)


KNOWN: tuple[Known, ...] = (
    Known(
        "nccl-watchdog",
        r"Watchdog caught collective operation timeout",
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
        "compare where each rank waited (below): different lines are a desync; the same "
        "collective with one rank late is slow work (move it before init, or a longer "
        "timeout)",
        "09",
    ),
    Known(
        "monitored-barrier",
        r"Rank (?P<rank>\d+) failed to pass monitoredBarrier",
        "dist.monitored_barrier named the rank that never arrived",
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
        r"Detected mismatch between collectives on ranks",
        "ranks called different collectives, or the same one with different shapes or "
        "dtypes (TORCH_DISTRIBUTED_DEBUG=DETAIL compared them)",
        "a collective outside rank-dependent branches; shapes that do not depend on the "
        "data (bincount(..., minlength=K))",
        "09",
    ),
    Known(
        "duplicate-gpu",
        r"Duplicate GPU detected",
        "two ranks of one nccl group use the same GPU: torch.cuda.set_device was not called "
        "with LOCAL_RANK, or more ranks than GPUs",
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init; "
        "--nproc-per-node at most the number of GPUs",
        "03",
    ),
    Known(
        "barrier-device",
        r"using GPU \d+ to perform barrier|using GPU \d+ as device used by this process",
        "the process group does not know this rank's GPU, so barrier() guessed one",
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
        r"EADDRINUSE|[Aa]ddress already in use",
        "the rendezvous port (--master-port, default 29500) is taken: another job on this "
        "machine, or a leftover of an earlier one",
        "torchrun --standalone on one machine (a free port); across machines a port you "
        "know is free; find leftovers with ps",
        "09",
    ),
    Known(
        "address-family",
        r"Address family not supported by protocol|errno: 97|\(errno 97\)",
        "the rendezvous resolved to an IPv6 address that this host (or container) cannot use",
        "set MASTER_ADDR to the IPv4 address of the rank-0 node (not its name); check what "
        "the name resolves to with getent hosts NAME",
        "10",
    ),
    Known(
        "name-resolution",
        r"Name or service not known|nodename nor servname provided|"
        r"Temporary failure in name resolution|"
        r"[Ff]ailed to resolve (the )?(address|hostname)|getaddrinfo failed",
        "MASTER_ADDR (or the rank-0 agent's hostname, which torchrun hands to the others) "
        "does not resolve on this node",
        "use an address every node can reach (--rdzv-endpoint IP:PORT), or "
        "--local-addr on the rank-0 node so it advertises an address, not its name",
        "10",
    ),
    Known(
        "main-attribute",
        r"Can't get attribute '\w+' on <module '__main__'",
        "a spawned process (mp.spawn, DataLoader workers with spawn/forkserver) could not "
        "find a class or function defined in __main__ of a notebook or an interactive session",
        "define it in a .py file and import it; or start the processes with torchrun on a script",
        "01",
    ),
    Known(
        "cuda-fork",
        r"Cannot re-initialize CUDA in forked subprocess",
        "CUDA was used in the parent before it forked (a DataLoader worker, "
        "multiprocessing with fork): a child cannot use a parent's CUDA",
        "do not touch CUDA before forking (no torch.cuda.* in the parent); or the spawn "
        "start method",
        "01",
    ),
    Known(
        "dataloader-killed",
        r"DataLoader worker \(pid\(?s?\)? [^)]*\) is killed by signal|"
        r"DataLoader worker \(pid \d+\) is killed",
        "a DataLoader worker died: killed by the OOM killer (host RAM: ranks x workers x "
        "dataset), by a Bus error (/dev/shm too small), or by the scheduler's signal",
        "fewer workers or a smaller dataset in RAM (tensors, not Python lists); in a "
        "container --shm-size or --ipc=host; on preemption let the rank save first",
        "08",
    ),
    Known(
        "bus-error",
        r"\bBus error\b|insufficient shared memory \(shm\)|unable to write to file </torch_",
        "shared memory (/dev/shm) ran out: DataLoader workers pass batches through it",
        "a larger /dev/shm (docker --shm-size=8g or --ipc=host), fewer workers, smaller batches",
        "08",
    ),
    Known(
        "no-destroy",
        r"destroy_process_group\(\) was not called",
        "the process exited with its process group still open",
        "dist.destroy_process_group() at the end of main(), in a finally:",
        "09",
    ),
    Known(
        "terminate-at-exit",
        r"terminate called without an active exception",
        "a rank died at exit, after training: the process group's threads outlived the "
        "interpreter (torch.distributed.nn imported after init)",
        "import torch.distributed.nn before init_process_group, and call "
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
        r"Connection closed by peer|Connection reset by peer",
        "a peer process is gone: it crashed or was killed, and this rank noticed in a collective",
        "find the first rank that failed (torchrun's Root Cause), not this one",
        "09",
    ),
    Known(
        "wrapper-keys",
        r'Missing key\(s\) in state_dict|Unexpected key\(s\) in state_dict: "module\.',
        "weights saved from the DDP wrapper carry a 'module.' prefix the plain model lacks "
        "(or the other way round)",
        "save model.module.state_dict(); strip the prefix of old files with "
        "consume_prefix_in_state_dict_if_present (not k[7:])",
        "05",
    ),
    Known(
        "torn-file",
        r"storage has wrong size|PytorchStreamReader failed reading zip archive",
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
)


@dataclass
class Hit:
    """One known message: the first line that shows it, and how many lines do."""

    known: Known
    line_no: int
    line: str
    count: int = 1
    ranks: set[int] = field(default_factory=set)


def find_known(lines: list[str]) -> list[Hit]:
    """Every known message in ``lines``, once each, in the order they first appear."""
    hits: dict[str, Hit] = {}
    for number, line in enumerate(lines, 1):
        for known in KNOWN:
            if known.search(line):
                hit = hits.get(known.key)
                if hit is None:
                    hits[known.key] = hit = Hit(known, number, line.strip())
                else:
                    hit.count += 1
                if (rank := rank_of(line)) is not None:
                    hit.ranks.add(rank)
    return list(hits.values())


def root_cause(text: str) -> str | None:
    """torchrun's "Root Cause" in words: the rank that failed first and its last error line."""
    from ddp_tutorial.harness.failures import parse_failures

    failures = parse_failures(text, Path("/nonexistent"))  # a log alone: no run folder
    if not failures:
        return None
    first = failures[0]
    last = next((ln for ln in reversed(first.traceback.splitlines()) if ln.strip()), "")
    return f"{first.describe()}: {last.strip()[:160]}" if last else first.describe()


def explain_log(text: str) -> str:
    """The report for one log: each known message with cause, fix and lesson; then where
    the ranks were. An empty string when nothing in the log is known."""
    if not (hits := find_known(lines := text.splitlines())):
        return ""
    out = []
    for hit in hits:
        k = hit.known
        more = f" (and {hit.count - 1} more like it)" if hit.count > 1 else ""
        who = ", ".join(map(str, sorted(hit.ranks)))
        ranks = f", from rank{'s' * (len(hit.ranks) > 1)} {who}" if hit.ranks else ""
        out += [
            f"line {hit.line_no}{ranks}{more}: {hit.line[:200]}",
            f"  cause: {k.cause}",
            f"  fix:   {k.fix}",
            f"  see:   lesson {k.lesson} ({k.key})",
        ]
    if "child-failed" in [h.known.key for h in hits] and (first := root_cause(text)):
        out.append(f"torchrun's first failure: {first}")
    if lag := lagging_ranks(lines):
        out.append(f"the watchdog: {lag}")
    frames = where_ranks_failed(lines)
    if len(frames) > 1:
        places = "; ".join(f"rank {r} at {where}" for r, where in sorted(frames.items()))
        same = len(set(frames.values())) == 1
        verdict = "the same line" if same else "different lines: the ranks took different paths"
        out.append(f"where each rank failed: {places} ({verdict})")
    return "\n".join(out)


def keys(text: str) -> list[str]:
    """The keys of the known messages in ``text`` (tests and lessons assert on them)."""
    return [hit.known.key for hit in find_known(text.splitlines())]


def main(paths: Iterable[str], out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Explain each log ('-' or none: stdin). 0: something explained; 1: nothing known."""
    out, err = out or sys.stdout, err or sys.stderr
    paths = list(paths) or ["-"]
    known = False
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(errors="replace")
        except OSError as exc:
            print(f"ddp-tutorial explain: cannot read {path}: {exc.strerror}", file=err)
            return 2
        report = explain_log(text)
        if len(paths) > 1:
            print(f"== {path}", file=out)
        print(
            report or "no message this course knows; the first error line is the place to start",
            file=out,
        )
        known = known or bool(report)
    return 0 if known else 1
