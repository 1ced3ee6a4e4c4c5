"""Lesson 09's exercise: hangs left in the script, and fixes that trade the hang for a wrong
result, each named (edits of the solution)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "09_find_the_hang"
SHARD_FIX = (
    "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]"
    "  # filter first, then split:\n"
    "    shard = [labelled[j] for j in DistributedSampler(labelled, shuffle=False)]"
    "  # equal lengths\n"
)  # fmt: skip
EVAL_FIX = "            net = model.module  # the plain model: its forward is no collective\n"
CASES = register([
    # helper 169: pads right for this run's 25 labelled samples on 2 ranks only
    Case(EX, "last-rank-pads", "padding that names a rank or a length",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    shard = labelled[rank::world_size]\n"
                            "    if rank == world_size - 1 and len(labelled) % world_size:\n"
                            "        shard.append(labelled[0])\n"),)),
    Case(EX, "share-rounded-up-as-minus-one-plus-one", None,  # helper 172: right, and flagged
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    per_rank = (len(labelled) - 1) // world_size + 1  # rounded up\n"
                            "    shard = labelled[rank::world_size]\n"
                            "    shard += labelled[: per_rank - len(shard)]\n"),)),
    Case(EX, "share-as-floor-plus-one", "len // world_size + 1 is the share rounded up only",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    per_rank = len(labelled) // world_size + 1  # rounded up\n"
                            "    shard = labelled[rank::world_size]\n"
                            "    shard += shard[: per_rank - len(shard)]\n"),)),
    Case(EX, "rank0-evaluates-the-ddp-model", "net(x)",
         edits=((EVAL_FIX, ""),)),
    # helper 139: the hang gone by turning the buffer sync off, outside the blocks
    Case(EX, "buffer-sync-turned-off", "broadcast_buffers=False stops the hang",
         edits=(("    model = DDP(model)\n", "    model = DDP(model, broadcast_buffers=False)\n"),
                ("            net = model.module  # the plain model: its forward is no collective\n",  # noqa: E501
                 ""))),
    Case(EX, "uneven-batches-left", "dist.barrier()", edits=((SHARD_FIX, ""),)),
    Case(EX, "split-then-filter", "dist.barrier()",
         edits=((SHARD_FIX, "    shard = [i for i in DistributedSampler(train_set, shuffle=False)"
                            " if labels[i] >= 0]\n"),)),
    Case(EX, "shards-cut-to-the-shortest", "was never trained on",
         edits=((SHARD_FIX, "    n = torch.tensor(len(shard))\n"
                            "    dist.all_reduce(n, op=dist.ReduceOp.MIN)\n"
                            "    shard = shard[: int(n)]\n"),)),
    Case(EX, "evaluated-in-train-mode", "in eval mode", edits=(("            net.eval()\n", ""),)),
    Case(EX, "split-without-filter", "without a label",
         edits=((SHARD_FIX, "    shard = list(DistributedSampler(train_set, shuffle=False))\n"),)),
    # helper 105: the sampler's positions in the labelled list taken for sample numbers
    Case(EX, "sampler-positions-taken-for-samples", "not sample numbers: map them back",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    shard = list(DistributedSampler(labelled, shuffle=False))\n"),)),
    Case(EX, "padded-to-the-longest-shard", "repeats - pad as DistributedSampler does",
         edits=((SHARD_FIX, "    longest = torch.tensor(len(shard))\n"
                            "    dist.all_reduce(longest, op=dist.ReduceOp.MAX)\n"
                            "    shard = (shard * 2)[: int(longest)]\n"),)),
    # from a learner review: 13 and 12 samples, as many batches by luck (a hang at 21 labelled)
    Case(EX, "filtered-then-split-unpadded", "as many batches of 5 here by luck",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    shard = labelled[rank::world_size]\n"),)),
    Case(EX, "sampler-seeded-per-rank", "the ranks' shards overlap",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    shard = [labelled[j] for j in DistributedSampler(labelled, "
                            "seed=rank)]\n"),)),
    Case(EX, "uneven-shards-under-join", None,  # right: lesson 09's other fix
         edits=((SHARD_FIX, ""),
                ("from torch import nn\n", "from torch import nn\n"
                 "from torch.distributed.algorithms import Join\n"),
                ("        for x, y, index in loader:\n", "        with Join([model]):\n"
                 "          for x, y, index in loader:\n"))),
    # helper 152: told "the same seed on every rank"
    Case(EX, "labelled-kept-not-split", "the ranks' work is not split",
         edits=((SHARD_FIX,
                 "    shard = [i for i in range(len(train_set)) if labels[i] >= 0]\n"),)),
    # helper 160: the buffer sync turned off in other spellings passed
    Case(EX, "buffer-sync-turned-off-with-0", "broadcast_buffers=False stops the hang",
         edits=(("    model = DDP(model)\n", "    model = DDP(model, broadcast_buffers=0)\n"),
                (EVAL_FIX, ""))),
    Case(EX, "padded-to-whole-batches", "repeats - pad as DistributedSampler does",  # h. 160
         edits=((SHARD_FIX,
                 "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                 "    labelled += labelled[: -len(labelled) % (world_size * args.batch_size)]\n"
                 "    shard = labelled[rank::world_size]\n"),)),
    Case(EX, "rank-0-prints-the-shards", None,  # helper 166: an `if rank == 0` that pads nothing
         edits=((SHARD_FIX, SHARD_FIX + "    if rank == 0:\n        print(f\"{len(labelled)} "
                 "labelled samples, {len(shard)} per rank\", flush=True)\n"),)),
    # a pad written for this run's numbers: right here, wrong with 24 labelled or 3 ranks
    Case(EX, "padded-on-a-fixed-rank", "padding that names a rank or a length",
         edits=((SHARD_FIX, "    labelled = [i for i in range(len(train_set)) if labels[i] >= 0]\n"
                            "    shard = labelled[rank::world_size]\n"
                            "    if rank == 1:\n"
                            "        shard.append(labelled[0])\n"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_hangs_and_wrong_fixes_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
