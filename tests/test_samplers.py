"""ddp_tutorial.samplers.ResumableSampler: DistributedSampler's shards, resumable anywhere.

The template resumes on another number of ranks with it; lesson 10 asserts that on a
real restart (2 ranks, then 1). Here: the arithmetic, for many sizes, in one process.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_tutorial.samplers import ResumableSampler


@pytest.mark.parametrize("length", [10, 11, 64])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_from_the_start_it_is_distributed_sampler(length, world):
    for epoch in (0, 1):
        for rank in range(world):
            reference = DistributedSampler(range(length), world, rank, shuffle=True, seed=5)
            reference.set_epoch(epoch)
            ours = ResumableSampler(range(length), world, rank, seed=5)
            ours.set_epoch(epoch)
            assert list(ours) == list(reference) and len(ours) == len(reference)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (4, 2), (2, 3)])
def test_a_restart_on_another_world_sees_every_sample_once(before, after):
    batch, steps = 4, 3
    length = 4 * 3 * 4 * 3  # divisible by every world x batch here: no padding, no tail
    seen: list[int] = []
    for rank in range(before):  # `steps` steps of `batch` on `before` ranks, then a crash
        sampler = ResumableSampler(range(length), before, rank, seed=1)
        sampler.set_epoch(7)
        seen += list(sampler)[: steps * batch]
    consumed = steps * batch * before  # what the snapshot records
    for rank in range(after):  # the rest of epoch 7 on `after` ranks
        sampler = ResumableSampler(range(length), after, rank, seed=1)
        sampler.set_epoch(7, consumed, since=consumed)  # another world takes over here
        assert len(sampler) == len(list(sampler)) == (length - consumed) // after
        seen += list(sampler)
    assert Counter(seen) == Counter(range(length)), "the whole epoch, each sample once"


@pytest.mark.parametrize("length,before,after", [(50, 2, 3), (49, 3, 2), (49, 3, 4), (49, 4, 3)])
def test_a_restart_whose_rest_does_not_divide_pads_it(length, before, after):
    """The rest of the epoch after the crash is padded to a multiple of the new world size.

    Every rank still takes the same number of steps (DDP needs that); the padding
    repeats the start of the rest, as DistributedSampler repeats the start of its order.
    """
    batch, steps = 4, 2
    order = list(ResumableSampler(range(length), 1, 0, seed=2))  # the epoch's one permutation
    consumed = steps * batch * before
    shards = []
    for rank in range(after):
        sampler = ResumableSampler(range(length), after, rank, seed=2)
        sampler.set_epoch(0, consumed, since=consumed)
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    rest = order[consumed:]
    padding = -len(rest) % after
    assert padding, "this case pads"
    assert [len(s) for s in shards] == [(len(rest) + padding) // after] * after, "equal steps"
    dealt = Counter(i for shard in shards for i in shard)
    assert set(dealt) == set(rest), "every remaining sample, nothing consumed before the crash"
    assert sorted(i for i, n in dealt.items() if n == 2) == sorted(rest[:padding])
    assert sum(dealt.values()) == len(rest) + padding


@pytest.mark.parametrize("length", [11, 12])
def test_without_shuffle_it_is_distributed_samplers_fixed_order(length):
    for rank in (0, 1):
        reference = list(DistributedSampler(range(length), 2, rank, shuffle=False))
        sampler = ResumableSampler(range(length), 2, rank, shuffle=False)
        for epoch in (0, 3):  # the same order every epoch
            sampler.set_epoch(epoch)
            assert list(sampler) == reference
        sampler.set_epoch(3, consumed=4)  # 2 steps of 1 sample on 2 ranks
        assert list(sampler)[:3] == reference[2:5]  # (11: the rest pads with its own start)


def test_a_snapshot_at_the_epochs_end_leaves_nothing_on_any_world():
    for world in (1, 2, 3):
        for rank in range(world):
            sampler = ResumableSampler(range(12), world, rank, seed=0)
            sampler.set_epoch(1, consumed=12)
            assert len(sampler) == 0 and list(sampler) == []


def test_a_resume_on_the_same_world_continues_each_shard():
    full = ResumableSampler(range(50), 2, 1, seed=3)
    full.set_epoch(2)
    resumed = ResumableSampler(range(50), 2, 1, seed=3)
    resumed.set_epoch(2, consumed=2 * 8)  # 8 samples per rank were consumed
    assert list(resumed) == list(full)[8:]


@pytest.mark.parametrize("length,world", [(255, 2), (49, 3), (50, 4)])
def test_a_resume_on_the_same_world_deals_the_epochs_own_padding(length, world):
    """Helper 107: the epoch's padding (its order's start) came from the resume point's rest
    instead, so a resumed epoch whose size did not divide ended on other samples than the
    uninterrupted one (1023 images on 2 ranks, batch 32: the last batch is full of them)."""
    full = []
    for rank in range(world):
        sampler = ResumableSampler(range(length), world, rank, seed=6)
        sampler.set_epoch(1)
        full.append(list(sampler))
    for steps in (1, len(full[0]) - 1):  # a resume early, and one before the padded last step
        for rank in range(world):
            resumed = ResumableSampler(range(length), world, rank, seed=6)
            resumed.set_epoch(1, consumed=steps * world)
            assert list(resumed) == full[rank][steps:] and len(resumed) == len(full[rank]) - steps


def test_after_another_world_took_over_a_resume_on_it_continues_its_own_padding():
    """2 ranks stop, 3 take over at `since` (their rest padded with its own start: lesson 10's
    exercise); a second stop on those 3 ranks resumes exactly where they were."""
    length, since = 49, 8
    took_over = []
    for rank in range(3):
        sampler = ResumableSampler(range(length), 3, rank, seed=2)
        sampler.set_epoch(0, consumed=since, since=since)
        took_over.append(list(sampler))
    for rank in range(3):
        again = ResumableSampler(range(length), 3, rank, seed=2)
        again.set_epoch(0, consumed=since + 3 * 5, since=since)  # 5 more steps of 1 on 3 ranks
        assert list(again) == took_over[rank][5:] and len(again) == len(took_over[rank]) - 5
    with pytest.raises(ValueError, match="since"):
        ResumableSampler(range(10), 2, 0).set_epoch(0, consumed=2, since=4)
    # helper 108: a position from another world size, given without its since, dealt the
    # ranks unequal shares (len() said 1 and 1, the lists held 1 and 0: a StopIteration)
    with pytest.raises(ValueError, match="not a multiple of its 2 ranks"):
        ResumableSampler(range(1), 2, 1).set_epoch(0, consumed=1)


def test_bad_positions_are_refused():
    with pytest.raises(ValueError, match="consumed must be >= 0"):
        ResumableSampler(range(10), 2, 0).set_epoch(0, consumed=-1)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ResumableSampler(range(10), 2, 2)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_snapshot_of_a_padded_last_step_leaves_nothing_of_the_epoch(after):
    """9 samples, 2 ranks, batch 5: one step deals out 10 (index 0 twice), consumed=10.

    A resume from a snapshot of that step (a crash while evaluating) failed on every
    restart with "consumed must be in [0, 9], got 10"; the epoch is simply done.
    """
    handed = [i for r in range(2) for i in ResumableSampler(range(9), 2, r, seed=4)]
    assert len(handed) == 10 and set(handed) == set(range(9)), "one step, padded"
    for rank in range(after):
        sampler = ResumableSampler(range(9), after, rank, seed=4)
        sampler.set_epoch(0, consumed=10, since=0 if after == 2 else 10)
        assert len(sampler) == 0 and list(sampler) == []


def test_rank_seeds_are_distinct_and_stable():
    from ddp_tutorial.seeding import loader_generator, rank_seed

    seeds = {rank_seed(s, r) for s in range(4) for r in range(4)}
    assert len(seeds) == 16, "seed + rank would collide (0, 1) with (1, 0)"
    assert 0 <= rank_seed(9, 9) < 2**63
    # stable: a function of its arguments only, not of the global generators a run has drawn
    # from (a restart in a new process must get the same seeds)
    first = [rank_seed(s, r) for s in range(4) for r in range(4)]
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    torch.rand(5), np.random.rand(5), random.random()
    assert [rank_seed(s, r) for s in range(4) for r in range(4)] == first
    a, b = loader_generator(0, 0, epoch=1), loader_generator(0, 1, epoch=1)
    assert a.initial_seed() != b.initial_seed() == loader_generator(0, 1, 1).initial_seed()


@pytest.mark.torchrun  # a new interpreter
def test_rank_seeds_are_the_same_in_a_new_process():
    """A restarted job is a new process: it must derive the seeds the first run derived."""
    from ddp_tutorial.seeding import rank_seed

    code = (
        "from ddp_tutorial.seeding import rank_seed as f; import json; "
        "print(json.dumps([f(s, r, e) for s in range(3) for r in range(3) for e in range(2)]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    here = [rank_seed(s, r, e) for s in range(3) for r in range(3) for e in range(2)]
    assert json.loads(done.stdout.splitlines()[-1]) == here
