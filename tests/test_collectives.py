"""Lesson 01's helpers: the expected value of every collective, and the check of the records.

The real launches (collectives and the environment contract, mp.spawn,
the legacy launcher, seed 000's ``--local_rank`` default) are asserted by
notebooks/01_process_groups.ipynb itself.
"""

from __future__ import annotations

import pytest

from conftest import DEMOS, gpu_count
from ddp_tutorial.harness.launch import torchrun
from ddp_tutorial.lessons.collectives import (
    OPS,
    PICTURED,
    check_records,
    collectives_figure,
    expected,
    rank_loss,
    rank_value,
    store_listener,
)

GLOO = {"DDP_TUTORIAL_BACKEND": "gloo"}


def test_expected_values_follow_the_definitions():
    assert expected("all_reduce_sum", 1, 2) == [3.0, 30.0]
    assert expected("all_reduce_avg", 0, 4) == [2.5, 25.0]
    assert expected("broadcast", 3, 4) == [1.0, 10.0]
    assert expected("all_gather", 0, 3) == [[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]
    assert expected("reduce", 0, 2) == [3.0, 30.0] and expected("reduce", 1, 2) is None
    assert expected("reduce_loss", 0, 3) == [7 / 3] and expected("reduce_loss", 2, 3) is None
    with pytest.raises(ValueError, match="unknown collective"):
        expected("scatter", 0, 2)


def test_check_records_reports_a_wrong_value():
    good = [
        {"rank": r, "collectives": {op: {"after": expected(op, r, 2)} for op in OPS}}
        for r in range(2)
    ]
    for rec in good:
        rec["collectives"]["all_reduce_avg"]["error"] = None
    assert check_records(good) == []
    good[1]["collectives"]["broadcast"]["after"] = [2.0, 20.0]
    assert check_records(good) == ["rank 1 broadcast: got [2.0, 20.0], expected [1.0, 10.0]"]


@pytest.mark.gpu
def test_collectives_on_nccl_one_rank_per_gpu(tmp_path):
    n = gpu_count()
    result = torchrun(
        DEMOS / "collectives.py", nproc=n, env={"DDP_TUTORIAL_BACKEND": "nccl"},
        run_dir=tmp_path, timeout=180, echo=False,
    )  # fmt: skip
    records = result.records
    assert len(records) == n and check_records(records) == []
    assert all(r["backend"] == "nccl" for r in records)
    assert [r["device"] for r in records] == [f"cuda:{i}" for i in range(n)]


def _one_rounding_step_off(values):
    """``values`` in float32, each moved by one unit in the last place (nccl's ring may)."""
    import torch

    t = torch.tensor(values, dtype=torch.float32)
    return torch.nextafter(t, t + 1).tolist()


@pytest.mark.parametrize("world", [3, 5, 6, 7])
def test_check_records_tolerates_float32_rounding_on_any_gpu_count(world):
    records = [
        {
            "rank": r,
            "collectives": {
                op: {"after": _nudge(expected(op, r, world)), "error": None} for op in OPS
            },
        }
        for r in range(world)
    ]
    assert check_records(records) == []
    records[1]["collectives"]["all_reduce_sum"]["after"][0] += 1e-3  # beyond rounding
    assert len(check_records(records)) == 1


def _nudge(want):
    if want is None:
        return None
    if isinstance(want[0], list):  # all_gather: a list per rank
        return [_one_rounding_step_off(w) for w in want]
    return _one_rounding_step_off(want)


@pytest.mark.parametrize("world", range(2, 17))
def test_no_rank_holds_the_mean_loss_by_coincidence(world):
    """Lesson 01 asserts that reduce leaves the mean on rank 0 only: at any world size."""
    mean = expected("reduce_loss", 0, world)[0]
    assert all(rank_loss(r) != mean for r in range(world))
    # nor any partial sum a non-destination rank may be left with (sums of powers of two are
    # whole numbers; the mean (2**N - 1) / N is not, for N > 1)
    assert mean != int(mean)


def test_store_listener_sees_who_listens():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        seen = store_listener(port)
        assert seen["self"] and not seen["parent"] and seen["port"] == port
    assert not store_listener(port)["self"], "closed: nobody listens"


@pytest.mark.parametrize("world", [2, 3, 8])
def test_collectives_figure_draws_every_number_of_every_rank(world):
    pytest.importorskip("matplotlib")
    from matplotlib.patches import FancyArrow, Rectangle

    records = [
        {
            "rank": r,
            "collectives": {
                op: {"before": rank_value(r), "after": expected(op, r, world) or rank_value(r)}
                for op in OPS
            },
        }
        for r in range(world)
    ]
    fig = collectives_figure(records)
    assert len(fig.axes) == len(PICTURED)
    boxes = [sum(isinstance(p, Rectangle) for p in ax.patches) for ax in fig.axes]
    # before: 2 numbers per rank; after: 2, except all_gather (2 per rank, on every rank)
    assert boxes == [4 * world, 4 * world, 2 * world + 2 * world * world, 4 * world]
    assert all(sum(isinstance(p, FancyArrow) for p in ax.patches) == world for ax in fig.axes)


# -- "From inside a notebook": notebook_launch ------------------------------------------------

REFUSED = "Cannot re-initialize CUDA in forked subprocess"


def test_stderr_to_catches_descriptor_2_and_puts_it_back(tmp_path):
    """What a spawned child writes to its stderr lands in the file; afterwards fd 2 is as before."""
    import os

    from ddp_tutorial.lessons.notebook_launch import stderr_to

    before = os.fstat(2)
    with stderr_to(tmp_path / "children.stderr") as path:
        os.write(2, b"written to descriptor 2\n")
    assert path.read_text() == "written to descriptor 2\n"
    with pytest.raises(RuntimeError), stderr_to(tmp_path / "again.stderr"):
        raise RuntimeError("a failing spawn")
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), "fd 2 restored"


@pytest.mark.torchrun
def test_the_module_worker_all_reduces_in_forked_ranks(tmp_path):
    """The function lesson 01 defines in a cell, from its module, as two forked ranks.

    (The notebook runs it with ``mp.spawn`` too. Not here: a spawn starts
    multiprocessing's resource tracker, which lives as long as this process.)
    """
    import os
    import sys

    import torch.multiprocessing as mp

    from ddp_tutorial.distributed import free_port
    from ddp_tutorial.lessons.notebook_launch import all_reduce_worker
    from ddp_tutorial.records import read_rank_records

    args = (2, free_port(), str(tmp_path))
    mp.start_processes(all_reduce_worker, args=args, nprocs=2, start_method="fork")
    records = read_rank_records(tmp_path)
    assert [r["sum"] for r in records] == [3.0, 3.0]
    assert all(r["parent"] == os.getpid() for r in records)
    assert all(r["kernel"] == ("ipykernel" in sys.modules) for r in records), "copies of this one"


@pytest.mark.torchrun
def test_fork_after_cuda_tells_a_poisoned_fork_from_a_missing_gpu():
    """No GPU here: every forked worker fails, but only a poisoned fork is *refused*.

    With a CUDA build of torch (as here) ``is_available()`` asks the CUDA runtime
    even without a GPU, and torch marks later forks, while ``is_initialized()``
    stays False: the trap lesson 01's GPU branch shows. A CPU-only build asks nothing.
    """
    if gpu_count():
        pytest.skip("GPUs here: test_fork_after_cuda_on_gpus checks the real thing")
    import torch

    from ddp_tutorial.lessons.notebook_launch import fork_after_cuda

    cases = (("nothing", False), ("is_available", False))
    nothing, available = fork_after_cuda(1, 120, demos=str(DEMOS), cases=cases)
    assert (nothing["touch"], available["touch"]) == ("nothing", "is_available")
    assert not nothing["initialized"] and not available["initialized"]
    assert not nothing["bad_fork"] and not available["bad_fork"], "the parent is never a bad fork"
    assert nothing["error"] and REFUSED not in nothing["error"], "no GPU, but not refused"
    assert available["error"]
    if torch.version.cuda:  # a CUDA build asked the CUDA runtime: the fork is poisoned
        assert REFUSED in available["error"], available["error"]
    else:
        assert REFUSED not in available["error"]


@pytest.mark.gpu
def test_fork_after_cuda_on_gpus():
    """Lesson 01's GPU branch: which ways of touching CUDA in the parent break a fork launcher."""
    from ddp_tutorial.lessons.notebook_launch import CUDA_CASES, fork_after_cuda

    reports = fork_after_cuda(gpu_count(), 180, demos=str(DEMOS))
    case = {(c["touch"], c["nvml_check"]): c for c in reports}
    assert list(case) == list(CUDA_CASES)
    assert case["nothing", False]["error"] is None and not case["nothing", False]["initialized"]
    assert case["tensor", False]["initialized"] and REFUSED in case["tensor", False]["error"]
    assert not case["is_available", False]["initialized"]
    assert REFUSED in case["is_available", False]["error"]
    assert case["is_available", True]["error"] is None
    assert case["device_count", False]["error"] is None
    # memory_allocated reads the allocator's (empty) stats; mem_get_info asks the driver
    assert not case["memory_allocated", False]["initialized"]
    assert case["memory_allocated", False]["error"] is None
    assert case["mem_get_info", False]["initialized"]
    assert REFUSED in case["mem_get_info", False]["error"]
    # Lightning's check since 2.6.1 asks whether *this* process is a bad fork: never the parent
    assert not any(c["bad_fork"] for c in reports)
