"""Lesson 10's exercise: wrong ways to deal out the rest of an epoch, each named."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "10_resume_new_world"
BLOCK = (
    "    rest = order[consumed:]\n    padding = -len(rest) % world_size\n"
    "    rest += (rest * padding)[:padding]\n    mine = rest[rank::world_size]\n"
)
CASES = register([
    # helper 178: nothing left of the epoch (a snapshot at its last step) divides by zero
    Case(EX, "padding-by-divmod", "nothing was left of the epoch",
         edits=(("    rest += (rest * padding)[:padding]\n",
                 "    whole, part = divmod(padding, len(rest))  # the rest may be shorter\n"
                 "    rest = rest + rest * whole + rest[:part]\n"),)),
    # helper 164: the check's 3 ranks written in passed
    Case(EX, "three-ranks-written-in", "rest_of_epoch(..., r, 2) for each rank r of 2",
         edits=(("    padding = -len(rest) % world_size\n", "    padding = -len(rest) % 3\n"),
                ("    mine = rest[rank::world_size]\n", "    mine = rest[rank::3]\n"))),
    # helper 168: the same under another name passed the regex; rank 0 now also calls the
    # function for 2 and 4 ranks
    Case(EX, "three-ranks-by-another-name", "rest_of_epoch(..., r, 2) for each rank r of 2",
         edits=(("    padding = -len(rest) % world_size\n",
                 "    new_world = 3  # the world we resume on\n"
                 "    padding = -len(rest) % new_world\n"),
                ("    mine = rest[rank::world_size]\n", "    mine = rest[rank::new_world]\n"))),
    Case(EX, "rank-from-the-process-group", "not dist.get_rank() or dist.get_world_size()",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    mine = rest[torch.distributed.get_rank() :: world_size]\n"),)),
    # helper 164: a sampler of the learner's own, never given its epoch (told "skip consumed")
    Case(EX, "order-of-epoch-0", "the rest of epoch 0's order, not of epoch 1's",
         edits=(("    rest = order[consumed:]\n",
                 "    g = torch.Generator().manual_seed(seed)  # the epoch forgotten\n"
                 "    rest = torch.randperm(num_samples, generator=g).tolist()[consumed:]\n"),)),
    Case(EX, "starts-over", "dealt out again",
         edits=(("    rest = order[consumed:]\n", "    rest = order\n"),)),
    Case(EX, "skips-own-shard", "skipped consumed // world_size of its own shard",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    mine = order[rank::world_size][consumed // world_size :]\n"),)),
    Case(EX, "no-padding", "pad the rest to a multiple of world_size",
         edits=(("    rest += (rest * padding)[:padding]\n", ""),)),
    Case(EX, "pads-once-with-the-start", "as often as needed",  # 1 sample left, 3 ranks
         edits=(("    rest += (rest * padding)[:padding]\n", "    rest += rest[:padding]\n"),)),
    Case(EX, "blocks-not-strided", "not strided",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    share = len(rest) // world_size\n"
                 "    mine = rest[rank * share : (rank + 1) * share]\n"),)),
    Case(EX, "padded-from-the-epochs-order", "repeated the start of the epoch's order",
         edits=(("rest += (rest * padding)[:padding]", "rest += (order * padding)[:padding]"),)),
    Case(EX, "consumed-counted-per-rank", "it counts every rank's samples already",
         edits=(("rest = order[consumed:]", "rest = order[consumed * world_size :]"),)),
    Case(EX, "off-by-one", "an off-by-one",
         edits=(("rest = order[consumed:]", "rest = order[consumed + 1 :]"),)),
    # from a twenty-fifth-session review: 27 positions skipped too many were "an off-by-one?"
    Case(EX, "skips-a-step-too-many", "skip exactly `consumed` positions",
         edits=(("rest = order[consumed:]", "rest = order[consumed + 2 * world_size :]"),)),
    Case(EX, "drops-the-tail", "instead of dropping its end",
         edits=(("    padding = -len(rest) % world_size\n    rest += (rest * padding)[:padding]\n",
                 "    rest = rest[: len(rest) // world_size * world_size]  # like drop_last\n"),)),
    # from a learner review
    Case(EX, "padded-with-the-end", "repeated the END of the rest",
         edits=(("    rest += (rest * padding)[:padding]",
                 "    rest += rest[-padding:] if padding else []"),)),
    Case(EX, "a-whole-row-of-padding", "more often than the padding needs",
         edits=(("    padding = -len(rest) % world_size",
                 "    padding = world_size - len(rest) % world_size"),)),
    # from a second learner review: padding in the wrong place, or with the wrong samples
    Case(EX, "padding-put-first", "the padding went before the rest",
         edits=(("    rest += (rest * padding)[:padding]\n",
                 "    rest = (rest * padding)[:padding] + rest\n"),)),
    Case(EX, "each-rank-pads-with-the-first-sample", "not the rest's first",
         edits=(("    rest += (rest * padding)[:padding]\n    mine = rest[rank::world_size]\n",
                 "    per_rank = -(-len(rest) // world_size)\n"
                 "    mine = rest[rank::world_size]\n"
                 "    while len(mine) < per_rank:\n        mine.append(rest[0])\n"),)),
    # noticed by the sixteenth session: a rest shuffled again was told "not strided"
    Case(EX, "rest-shuffled-again", "not in the epoch's order",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    g = torch.Generator().manual_seed(seed)\n"
                 "    rest = [rest[i] for i in torch.randperm(len(rest), generator=g)]\n"
                 "    mine = rest[rank::world_size]\n"),)),
    Case(EX, "own-share-shuffled", "each rank got the right samples, but in another order",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    mine = sorted(rest[rank::world_size])\n"),)),
    # helper 129: a sampler's indices into the rest taken for samples, named "dealt out again"
    Case(EX, "sampler-positions-taken-for-samples", "not sample numbers",
         edits=(("    padding = -len(rest) % world_size\n    rest += (rest * padding)[:padding]\n"
                 "    mine = rest[rank::world_size]\n",
                 "    from torch.utils.data.distributed import DistributedSampler\n\n"
                 "    mine = list(DistributedSampler(rest, num_replicas=world_size, rank=rank,\n"
                 "                                   shuffle=False))\n"),)),
    # helper 152: each got "dealt out again ... skip the first `consumed` positions"
    Case(EX, "padded-before-the-skip", "taken from the whole epoch's order, before the skip",
         edits=((BLOCK,
                 "    padding = -len(order) % world_size\n"
                 "    rest = (order + order[:padding])[consumed:]\n"
                 "    mine = rest[rank::world_size]\n"),)),
    Case(EX, "own-shard-of-a-fresh-sampler", "skipped consumed // world_size of its own shard",
         edits=((BLOCK,
                 "    from torch.utils.data.distributed import DistributedSampler\n\n"
                 "    sampler = DistributedSampler(range(num_samples), num_replicas=world_size,\n"
                 "                                 rank=rank, seed=seed)\n"
                 "    sampler.set_epoch(epoch)\n"
                 "    mine = list(sampler)[consumed // world_size :]\n"),)),
    # helper 160: named as shuffled, or the generic "dealt out again"
    Case(EX, "dealt-by-position-in-the-whole-order", "the ranks got each other's shares",
         edits=(("    mine = rest[rank::world_size]\n",
                 "    mine = [x for p, x in enumerate(rest, start=consumed)"
                 " if p % world_size == rank]\n"),)),
    Case(EX, "skip-of-the-padded-order-then-padded", "before the skip",
         edits=(("    rest = order[consumed:]\n",
                 "    full = order + (order * world_size)[: -len(order) % world_size]\n"
                 "    rest = full[consumed:]\n"),)),
    Case(EX, "padded-from-just-before-consumed", "from just before `consumed`",
         edits=(("    rest += (rest * padding)[:padding]\n",
                 "    rest += (order[consumed - padding : consumed] if consumed >= padding\n"
                 "             else (rest * padding)[:padding])\n"),)),
    Case(EX, "rest-from-consumed-minus-one", "order[consumed - 1]",
         edits=(("rest = order[consumed:]", "rest = order[consumed - 1 :]"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
