"""Lesson 10's exercise: the rest of an interrupted epoch, dealt out to a new number of ranks.

``10_resume_new_world``: on 3 ranks, each calls the learner's ``rest_of_epoch`` with its own
rank and world size, for epochs stopped by a job of 2 ranks and of 4 ranks (``consumed`` =
steps x batch x old ranks), and for an epoch not started at all (which must be exactly what
``DistributedSampler`` gives). The judge lays the ranks' lists side by side: every remaining
position dealt out once, nothing consumed dealt again, the same count on every rank, strided;
then the same for the lists rank 0 gets calling it as each rank of 2 and of 4 would.
"""

from __future__ import annotations

from collections import Counter
from types import ModuleType

import torch
from torch.utils.data.distributed import DistributedSampler

from ddp_tutorial.exercises.core import Context, Exercise, Record

# (what happened, num_samples, seed, epoch, consumed)
SCENARIOS = (
    ("epoch 1 stopped by 2 ranks after 2 steps of batch 5", 50, 0, 1, 20),
    ("epoch 0 stopped by 4 ranks after 3 steps of batch 3", 40, 7, 0, 36),
    ("epoch 2, not started", 50, 0, 2, 0),
    # one sample left for 3 ranks: padding it takes that sample twice more, not once
    ("epoch 0 stopped by 4 ranks after 1 step of batch 3", 13, 5, 0, 12),
    # nothing left: a snapshot at the epoch's last step (helper 178: a padding computed with
    # divmod(padding, len(rest)) passed, and divides by zero here)
    ("epoch 1 ended by 2 ranks, its last step's snapshot", 20, 0, 1, 20),
)


# the worlds rank 0 also calls rest_of_epoch for (rank r of each): a world size written in as
# this run's 3, under any name (`new_world = 3` passed the regex), deals them wrongly
OTHER_WORLDS = (2, 4)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def padded(rest: list[int], world: int) -> list[int]:
    """``rest`` up to a multiple of ``world``, repeating its start as often as that takes
    (DistributedSampler's padding: fewer samples may be left than the padding needs)."""
    padding = -len(rest) % world
    return rest + (rest * padding)[:padding]


def _expected(n: int, seed: int, epoch: int, consumed: int, world: int) -> list[list[int]]:
    rest = padded(epoch_order(n, seed, epoch)[consumed:], world)
    return [rest[r::world] for r in range(world)]


def run_rest(module: ModuleType, ctx: Context) -> Record:
    got = []
    for _, n, seed, epoch, consumed in SCENARIOS:
        mine = module.rest_of_epoch(n, seed, epoch, consumed, ctx.rank, ctx.world_size)
        got.append([int(i) for i in mine])
    sampler = DistributedSampler(range(SCENARIOS[2][1]), num_replicas=ctx.world_size,
                                 rank=ctx.rank, seed=SCENARIOS[2][2])  # fmt: skip
    sampler.set_epoch(SCENARIOS[2][3])
    others = {}  # a pure function: rank 0 also calls it as every rank of other worlds would
    for world in OTHER_WORLDS if ctx.rank == 0 else ():
        others[world] = [
            [[int(i) for i in module.rest_of_epoch(*scenario[1:], r, world)]
             for scenario in SCENARIOS]
            for r in range(world)
        ]  # fmt: skip
    return {"rank": ctx.rank, "got": got, "torch": list(sampler), "others": others}


def _dealt(rest: list[int], world: int) -> list[list[int]]:
    """``rest`` padded with its own start to a multiple of ``world``, dealt out rank by rank."""
    padding = -len(rest) % world
    rest = rest + (rest * (padding + 1))[:padding]
    return [rest[r::world] for r in range(world)]


def _dealt_again(where: str, lists: list[list[int]], order: list[int], consumed: int,
                 again: list[int]) -> str:  # fmt: skip
    """Trained samples came back: which of the usual ways of skipping went wrong."""
    world, rest = len(lists), order[consumed:]
    skipped = [order[r::world][consumed // world :] for r in range(world)]
    padding = -len(rest) % world
    from_order = rest + (order * (padding + 1))[:padding]
    if padding and lists == [from_order[r::world] for r in range(world)]:
        return (f"{where}: the padding repeated the start of the epoch's order: pad the list "
                "this world deals out, as DistributedSampler pads its own - the rest: rest + "
                "rest[:padding], repeated as often as needed (the template's sampler too, so "
                "that a later resume on this world size deals the same samples)")  # fmt: skip
    positions = list(range(len(rest)))  # a sampler over `rest` yields indices into it
    if lists == [
        (positions + (positions * (padding + 1))[:padding])[r::world] for r in range(world)
    ]:
        return (f"{where}: the ranks got positions 0..{len(rest) - 1} of the rest, not sample "
                "numbers: a DistributedSampler over `rest` yields indices into it - map them "
                "back, [rest[i] for i in sampler]")  # fmt: skip
    whole = (order + order[: -len(order) % world])[consumed:]  # padded before the skip
    if whole != rest and lists in ([whole[r::world] for r in range(world)], _dealt(whole, world)):
        return (f"{where}: the padding was taken from the whole epoch's order, before the "
                "skip, so it repeats samples the job had trained: skip `consumed` positions "
                "first, then pad what is left (rest + rest[:padding], repeated as often as "
                "needed)")  # fmt: skip
    if 0 < padding <= consumed and lists == _dealt(
        rest + order[consumed - padding : consumed], world
    ):
        return (f"{where}: the padding was taken from just before `consumed`, samples the job "
                "had trained: pad with the rest's own start, rest + rest[:padding]")  # fmt: skip
    if consumed and lists == _dealt(order[consumed - 1 :], world):
        return (f"{where}: the rest started at order[consumed - 1], one position the job had "
                "trained: the rest starts at order[consumed] - an off-by-one?")  # fmt: skip
    padded = order + (order * world)[: -len(order) % world]  # a fresh DistributedSampler's
    shards = [padded[r::world][consumed // world :] for r in range(world)]
    if consumed and lists in (skipped, shards):
        return (f"{where}: each rank skipped consumed // world_size of its own shard; "
                "the stopped job's shards were those of its own world size, not this "
                "one's: skip the first `consumed` positions of the whole order, then deal "
                f"out the rest ({len(again)} trained samples came back)")  # fmt: skip
    return (f"{where}: {len(again)} sample(s) the job had trained before it stopped were "
            f"dealt out again (e.g. sample {again[0]}): skip the first `consumed` "
            "positions of the epoch's order")  # fmt: skip


def _never_dealt(where: str, rest: list[int], never: list[int]) -> str:
    """Positions of the rest that no rank got: its start (off by one), its end (dropped)."""
    k = len(never)
    if never == rest[:1]:
        return (f"{where}: the first position after `consumed` went to no rank (sample "
                f"{never[0]}): the rest starts at order[consumed] - an off-by-one?")  # fmt: skip
    if never == rest[:k]:
        return (f"{where}: the first {k} positions after `consumed` went to no rank (sample "
                f"{never[0]} on): the rest starts at order[consumed] - skip exactly "
                "`consumed` positions (it counts the positions of the whole order that every "
                "rank trained, already multiplied out: nothing to add or scale)")  # fmt: skip
    if never == rest[-k:]:
        return (f"{where}: the last {k} sample(s) of the rest went to no rank (as drop_last "
                "would): every position after `consumed` goes to some rank - pad the rest to a "
                "multiple of world_size with its start instead of dropping its end")  # fmt: skip
    return (f"{where}: sample {never[0]} was never dealt out ({k} in all): every position "
            "after `consumed` goes to some rank")  # fmt: skip


def _padding(where: str, lists: list[list[int]], rest: list[int], dealt: list[int],
             world: int) -> str | None:  # fmt: skip
    """Every position dealt out, in equal shares: the padding's samples and their place."""
    full = padded(rest, world)
    padding = len(full) - len(rest)
    if padding and len(dealt) == len(full) and sorted(dealt) == sorted(rest + rest[-padding:]):
        return (f"{where}: the padding repeated the END of the rest: DistributedSampler "
                "pads with its start (rest + rest[:padding]), and a resume must deal out "
                "what it would have")  # fmt: skip
    if sorted(dealt) != sorted(full):
        extras = sorted((Counter(dealt) - Counter(rest)).elements())
        if len(extras) == padding:  # as many as needed, but not the rest's first ones
            return (f"{where}: the padding was sample(s) {extras}, not the rest's first "
                    f"{padding} ({sorted(full[len(rest):])}): pad with rest[:padding], "
                    "the next samples in order, repeating the rest as often as that "
                    "takes")  # fmt: skip
        extra = [i for i in set(dealt) if dealt.count(i) > full.count(i)]
        return (f"{where}: sample {extra[0] if extra else '?'} was dealt out more often than "
                "the padding needs: pad with the rest's start, only up to a multiple of "
                "world_size")  # fmt: skip
    front = (full[len(rest) :] + rest) if padding else rest
    if padding and lists == [front[r::world] for r in range(world)]:
        return (f"{where}: the padding went before the rest: DistributedSampler appends "
                "it (rest + rest[:padding]), then deals out positions r, r + world_size, "
                "...")  # fmt: skip
    return None


def _order(where: str, lists: list[list[int]], full: list[int], world: int) -> str | None:
    """Every sample dealt out once and equally, but not in the epoch's order: shuffled again
    (the whole rest, or each rank's share), rather than dealt out in blocks."""
    if [x for mine in lists for x in mine] == full:
        return None  # blocks of the rest, in order: "not strided"
    shares = [full[r::world] for r in range(world)]
    if lists != shares and sorted(lists) == sorted(shares):  # helper 160: rotated, swapped
        return (f"{where}: the ranks got each other's shares: rank r takes positions r, "
                "r + world_size, ... of the rest - start at the rank")  # fmt: skip
    if [sorted(mine) for mine in lists] == [sorted(full[r::world]) for r in range(world)]:
        return (f"{where}: each rank got the right samples, but in another order: keep the "
                "epoch's order (a rank's k-th step trains positions consumed + k x batch x "
                "world_size onward, which is what the next snapshot's `consumed` counts) - "
                "no shuffling after dealing out")  # fmt: skip
    return (f"{where}: every sample is there, but not in the epoch's order (shuffled again?): "
            "the rest is order[consumed:] as it stands, the one seeded order every rank and "
            "the next resume agree on - pad it and deal it out, rank r taking positions r, "
            "r + world_size, ...")  # fmt: skip


def judge_rest(records: list[Record]) -> str | None:
    if mistake := _judge_world(records):
        return mistake
    for r in records:
        if r["got"][2] != r["torch"]:
            return (
                f"rank {r['rank']}: an epoch not started gives other samples than "
                "DistributedSampler with set_epoch(epoch): use the same order (seed + epoch)"
            )
    for world, lists in records[0].get("others", {}).items():
        called = [{"rank": r, "got": got} for r, got in enumerate(lists)]
        if mistake := _judge_world(called):
            return (f"rest_of_epoch(..., r, {world}) for each rank r of {world}: {mistake} - "
                    "use the rank and world_size the function is given (not dist.get_rank() "
                    f"or dist.get_world_size(), nor this run's {len(records)})")  # fmt: skip
    return None


def _judge_world(records: list[Record]) -> str | None:
    """Each scenario's lists, one per rank of this world, against the dealing expected."""
    world = len(records)
    for i, (what, n, seed, epoch, consumed) in enumerate(SCENARIOS):
        lists = [r["got"][i] for r in records]
        want = _expected(n, seed, epoch, consumed, world)
        order = epoch_order(n, seed, epoch)
        done, rest = set(order[:consumed]), order[consumed:]
        if lists == want:
            continue
        where = f"{what}, resumed on {world} ranks"
        if epoch and lists == _expected(n, seed, 0, consumed, world):  # helper 164
            return (f"{where}: the rest of epoch 0's order, not of epoch {epoch}'s: the order "
                    "is drawn with seed + epoch - a sampler of your own needs its set_epoch("
                    "epoch) called before it is iterated, as DistributedSampler does")  # fmt: skip
        if not any(lists):
            return (f"{where}: every rank got no samples, though {len(rest)} are left - return "
                    "this rank's share of the rest (skip exactly `consumed` positions: it counts "
                    "every rank's samples already, not one rank's)")  # fmt: skip
        again = sorted({i for mine in lists for i in mine} & done)
        if again:
            return _dealt_again(where, lists, order, consumed, again)
        lengths = [len(mine) for mine in lists]
        if len(set(lengths)) > 1:
            return (
                f"{where}: the ranks got {lengths} samples: with unequal counts they take "
                "different numbers of steps, and the one with more waits in an all_reduce "
                "for ever - pad the rest to a multiple of world_size, repeating its start as "
                "often as needed (fewer samples may be left than the padding)"
            )
        dealt = [i for mine in lists for i in mine]
        never = [i for i in rest if i not in dealt]
        if never:
            return _never_dealt(where, rest, never)
        if mistake := _padding(where, lists, rest, dealt, world):
            return mistake
        if mistake := _order(where, lists, padded(rest, world), world):
            return mistake
        return (f"{where}: every sample is there, but not strided: after one step of batch 2 "
                f"the job must have used the next {2 * world} positions of the order, so that a "
                "snapshot can count them as consumed - rank r takes positions r, r + "
                "world_size, ... (as DistributedSampler does)")  # fmt: skip
    return None


EXERCISES = [
    Exercise(
        name="10_resume_new_world", lesson="10", run=run_rest, judge=judge_rest, nproc=3,
        title="the rest of an interrupted epoch, dealt out to a new number of ranks",
        teaches='lesson 10, "Resuming on another number of ranks"',
        errors=(("ZeroDivisionError", "nothing was left of the epoch (a snapshot at its last "
                 "step: every sample consumed), and the padding divided by the rest's length, "
                 "0 - an empty rest needs no padding and gives every rank an empty share"),),
        proves=(
            "in every scenario the rest of the epoch went to 3 ranks once, strided, padded to "
            "equal shares (and to 2 and to 4, called as their ranks); an epoch not started is "
            "the DistributedSampler's"
        ),
    ),
]  # fmt: skip
