"""Backend choice and process-group setup."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import DEMOS
from ddp_tutorial.distributed import BackendError, choose_backend

ONE_EACH = "(nccl needs one GPU per rank)"


@pytest.mark.parametrize(
    ("requested", "local_ranks", "gpus", "nccl_built", "expected", "why"),
    [
        ("auto", 2, 0, True, "gloo", "no CUDA GPU visible: gloo on CPU"),
        # a 1-GPU laptop still runs 2-rank lessons, on CPU
        ("auto", 2, 1, True, "gloo", f"1 GPU(s) for 2 local ranks: gloo on CPU {ONE_EACH}"),
        ("auto", 2, 2, True, "nccl", "2 GPU(s) for 2 local rank(s): nccl"),
        ("auto", 1, 8, True, "nccl", "8 GPU(s) for 1 local rank(s): nccl"),
        ("auto", 2, 2, False, "gloo", "this PyTorch build has no NCCL: gloo"),
        ("nccl", 2, 2, True, "nccl", "nccl requested"),
        ("gloo", 2, 8, True, "gloo", "gloo requested"),
        ("GLOO", 1, 0, True, "gloo", "gloo requested"),
    ],
)
def test_choose_backend(requested, local_ranks, gpus, nccl_built, expected, why, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl_built)
    assert choose_backend(requested, local_ranks, gpus=gpus) == (expected, why)


def test_auto_says_why_it_fell_back_to_gloo():
    _, reason = choose_backend("auto", 2, gpus=1)
    assert "1 GPU(s) for 2 local ranks" in reason


def test_explicit_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(BackendError, match="Use backend='gloo'"):
        choose_backend("nccl", 2, gpus=0)


def test_explicit_nccl_with_too_few_gpus_says_how_many(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with pytest.raises(BackendError, match="--nproc-per-node 1"):
        choose_backend("nccl", 2, gpus=1)


def test_unknown_backend():
    with pytest.raises(BackendError, match="'auto', 'gloo' or 'nccl'"):
        choose_backend("mpi4", 1, gpus=0)


@pytest.mark.torchrun
def test_hello_without_torchrun_is_a_world_of_one(tmp_path):
    """Plain `python script.py` works (world size 1): the script can be debugged."""
    proc = subprocess.run(
        [sys.executable, str(DEMOS / "hello.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 0/1" in proc.stdout and "all_reduce(sum of ranks) = 0" in proc.stdout


# -- GPU node and multi-node decisions, proven without a GPU ----------------------------


def test_a_gpu_rank_is_bound_by_device_id_with_a_generous_join_timeout():
    import torch

    from ddp_tutorial.distributed import init_options

    gpu = init_options("nccl", torch.device("cuda", 3), 600.0)
    assert gpu["device_id"] == torch.device("cuda", 3) and gpu["backend"] == "nccl"
    assert gpu["timeout"].total_seconds() == 600.0
    assert "device_id" not in init_options("gloo", torch.device("cpu"), 600.0)


def test_nodes_that_disagree_all_fall_back_to_gloo():
    from ddp_tutorial.distributed import agree_backends

    assert agree_backends(["nccl"] * 4)[0] == "nccl"
    backend, why = agree_backends(["nccl", "nccl", "gloo", "gloo"])
    assert backend == "gloo" and "ranks [2, 3] cannot use nccl" in why


def test_every_rank_reads_every_choice_through_the_store():
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from ddp_tutorial.distributed import exchange

    wait = timedelta(seconds=20)
    # port 0: the OS picks a free one as it binds (a port chosen first could be taken meanwhile)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=wait, wait_for_workers=False)
    port = master.port
    seen = {}

    def rank(r: int, choice: str) -> None:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        seen[r] = exchange(store, r, 2, choice)

    threads = [threading.Thread(target=rank, args=(r, c)) for r, c in ((0, "nccl"), (1, "gloo"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    del master
    assert seen == {0: ["nccl", "gloo"], 1: ["nccl", "gloo"]}


def test_auto_on_a_gpu_node_with_too_many_ranks_warns(monkeypatch):
    import torch

    from ddp_tutorial.distributed import fallback_warning

    assert fallback_warning("auto", "gloo", "no GPU") is None  # this machine: none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    warning = fallback_warning("auto", "gloo", "2 GPU(s) for 4 local ranks")
    assert warning.startswith("WARNING: this node has 2 GPU(s)") and "--nproc-per-node 2" in warning
    assert fallback_warning("gloo", "gloo", "gloo requested") is None  # asked for: no warning


SLOW_JOIN = """
import os, sys, time
import torch, torch.distributed as dist
from ddp_tutorial.distributed import process_group
from ddp_tutorial.records import write_rank_record

rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(3)  # a slow start (import on a busy shared filesystem): must not fail the join
record = {}
with process_group(backend="gloo", timeout_s=1.5) as info:
    if rank == 1:
        time.sleep(3)  # a rank late for a collective: must fail within the 1.5 s timeout
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        record["error"] = None
    except Exception as exc:
        record["error"] = type(exc).__name__
    record["waited_s"] = time.monotonic() - t0
    write_rank_record(sys.argv[-1], record)
    os._exit(0)  # the group is broken on purpose: leave without the closing barrier
"""


@pytest.mark.torchrun
def test_joining_may_take_long_but_a_collective_times_out_fast(tmp_path, write_script):
    from ddp_tutorial.harness.launch import torchrun

    script = write_script("slow_join.py", SLOW_JOIN)
    result = torchrun(script, nproc=2, run_dir=tmp_path / "run", echo=False, timeout=120,
                      env={"DDP_TUTORIAL_INIT_TIMEOUT": "60"})  # fmt: skip
    r0 = result.records[0]
    assert r0["error"] is not None, "rank 0 waited past the 1.5 s collective timeout"
    # it failed while rank 1 was still asleep (3 s): had the 1.5 s timeout not applied, the
    # all_reduce would have waited for rank 1 and succeeded. A lower bound: host speed cannot
    # break it (a busy host only makes the wait longer).
    assert r0["waited_s"] >= 1.4, r0  # 1.5 s, less the clock readings around the call


def test_a_free_port_is_one_the_kernel_never_hands_out_for_port_0(monkeypatch):
    """Helper 111: the port is bound seconds later (by torchrun); one from the kernel's
    ephemeral range could be taken by then by any bind(0) or outgoing connection (every gloo
    group and TCPStore of the suite binds port 0). Below that range only a number lands."""
    import socket
    from pathlib import Path

    from ddp_tutorial.distributed import free_port

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ephemeral.is_file():
        pytest.skip("no Linux ephemeral port range here")
    low = int(ephemeral.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free, as promised
    real = socket.socket.bind

    def bind(self, address):  # every port below the range taken: the kernel's pick
        if 0 < address[1] < low:
            raise OSError(98, "Address already in use")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    assert free_port() >= low
