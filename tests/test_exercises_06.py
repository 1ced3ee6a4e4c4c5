"""Lesson 06's exercise: wrong training steps, each named (edits of the solution)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "06_clip_and_schedule"
CLIP = "clip_grad_norm_(model.parameters(), max_norm)"
WITH = (
    "        with nullcontext() if i == k - 1 else model.no_sync():  # one all_reduce: the last\n"
)
BACKWARD = "            scaler.scale(loss).backward()\n"
AFTER = ("    scaler.unscale_(optimizer)\n"
         "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
         "    scaler.step(optimizer)\n    scaler.update()\n    scheduler.step()\n")  # fmt: skip
CASES = register([
    # helper 142: named by what they did, not by the advice the learner had followed
    Case(EX, "norm-measured-after-clipping", "measured after clipping",
         edits=(("    norm = torch.nn.utils." + CLIP,
                 "    torch.nn.utils." + CLIP + "\n"
                 "    norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))"
                 ),)),
    Case(EX, "scaled-loss-thrown-away", "not on scaler.scale(loss)",
         edits=(("            scaler.scale(loss).backward()",
                 "            scaler.scale(loss)\n            loss.backward()"),)),
    # from a twenty-fifth-session learner review (helper 127)
    Case(EX, "loss-divided-by-k-twice", "divided by k twice",
         edits=(("scaler.scale(loss).backward()", "scaler.scale(loss / k).backward()"),)),
    Case(EX, "clips-some-parameters", "of every parameter",
         edits=((CLIP, "clip_grad_norm_(list(model.parameters())[:2], max_norm)"),)),
    Case(EX, "clip-grad-value", "clip_grad_value_ clips each element alone",
         edits=(("    norm = torch.nn.utils." + CLIP,
                 "    norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))\n"
                 "    torch.nn.utils.clip_grad_value_(model.parameters(), max_norm)"),)),
    Case(EX, "no-unscale", "scaler.unscale_(optimizer) before clipping",
         edits=(("    scaler.unscale_(optimizer)\n", ""),)),
    Case(EX, "unscale-after-clip", "scaler.unscale_(optimizer) before clipping",
         edits=(("    scaler.unscale_(optimizer)\n", ""),
                ("    scaler.step(optimizer)\n",
                 "    scaler.unscale_(optimizer)\n    scaler.step(optimizer)\n"))),
    Case(EX, "scheduler-on-rank-0", "on every rank",
         edits=(("    scheduler.step()\n",
                 "    if dist.get_rank() == 0:  # one process is enough?\n"
                 "        scheduler.step()\n"),)),
    Case(EX, "not-clipped", "were not clipped",
         edits=(("clip_grad_norm_(model.parameters(), max_norm)",
                 'clip_grad_norm_(model.parameters(), float("inf"))'),)),
    Case(EX, "no-scaler-at-all", "backward() ran on the loss itself, or through a scaler",
         edits=(("    scaler.scale(loss).backward()\n", "    loss.backward()\n"),
                ("    scaler.unscale_(optimizer)\n", ""),
                ("    scaler.step(optimizer)\n", "    optimizer.step()\n"),
                ("    scaler.update()\n", ""))),
    # helper 174: was told "backward() ran on the loss itself"
    Case(EX, "a-scaler-of-its-own-each-step", "or through a scaler of your own",
         edits=(("    k = len(micro_batches)\n",
                 "    k = len(micro_batches)\n"
                 '    scaler = torch.amp.GradScaler("cpu")  # a scaler, made here\n'),)),
    Case(EX, "step-past-the-scaler", "stepped past the scaler",
         edits=(("    scaler.step(optimizer)\n", "    optimizer.step()\n"),)),
    # the eleventh session's leftover: the scaled gradients clipped at max_norm x scale are the
    # same clip (refused before, as "not train_step's max_norm"); the norm to log is the true one
    Case(EX, "scaled-clip-at-the-scaled-limit", None,
         edits=(("    scaler.unscale_(optimizer)\n", ""),
                (CLIP, "clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())"),
                ("    scaler.step(optimizer)\n",
                 "    norm = norm / scaler.get_scale()\n    scaler.step(optimizer)\n"))),
    Case(EX, "scaled-clip-scaled-norm-returned", "the norm to log is the true one",
         edits=(("    scaler.unscale_(optimizer)\n", ""),
                (CLIP, "clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())"))),
    # helper 164: told "the weights differ", "the norm was summed", "call scheduler.step()"
    Case(EX, "clip-before-unscale-norm-divided", "clip_grad_norm_ ran before scaler.unscale_",
         edits=(("    scaler.unscale_(optimizer)\n", ""),
                ("    scaler.step(optimizer)\n", "    scaler.unscale_(optimizer)\n"
                 "    norm = norm / scaler.get_scale()\n    scaler.step(optimizer)\n"))),
    Case(EX, "loss-times-the-world-size", "with no collective of yours",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y) * "
                 "dist.get_world_size() / k"),)),
    Case(EX, "lr-times-the-world-size-after-the-schedule", "set param_groups' lr nowhere else",
         edits=(("    scheduler.step()\n", "    scheduler.step()\n"
                 "    for group in optimizer.param_groups:\n"
                 "        group[\"lr\"] *= dist.get_world_size()\n"),)),
    Case(EX, "scheduler-before-the-step", "scheduler.step() ran before the optimizer's step",
         edits=(("    scheduler.step()\n", ""),
                ("    scaler.step(optimizer)\n",
                 "    scheduler.step()\n    scaler.step(optimizer)\n"))),
    # from a learner review: each named for what it is
    Case(EX, "update-before-step", "scaler.step(optimizer), then scaler.update()",
         edits=(("    scaler.step(optimizer)\n    scaler.update()\n",
                 "    scaler.update()\n    scaler.step(optimizer)\n"),)),
    Case(EX, "update-on-rank-0", "on every rank, scaler.step(optimizer), then scaler.update()",
         edits=(("    scaler.update()\n",
                 "    if dist.get_rank() == 0:  # one scale for the job?\n"
                 "        scaler.update()\n"),)),
    Case(EX, "clip-before-backward", "clip_grad_norm_ ran before backward()",
         edits=(("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n", ""),
                ("            scaler.scale(loss).backward()\n",
                 "            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
                 "            scaler.scale(loss).backward()\n"))),
    Case(EX, "loss-divided-by-the-world-size", "DDP averages the gradients over the ranks",
         edits=(("scaler.scale(loss).backward()",
                 "scaler.scale(loss / dist.get_world_size()).backward()"),)),
    Case(EX, "clip-imported-by-name-before-backward", "clip_grad_norm_ ran before backward()",
         edits=(("from torch import nn\n",
                 "from torch import nn\nfrom torch.nn.utils import clip_grad_norm_\n"),
                ("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n", ""),
                ("            scaler.scale(loss).backward()\n",
                 "            norm = clip_grad_norm_(model.parameters(), max_norm)\n"
                 "            scaler.scale(loss).backward()\n"))),
    # from a learner review: the clip's arguments, and a norm summed over the ranks
    Case(EX, "the-lessons-limit-hard-coded", "not train_step's max_norm argument",
         edits=((CLIP, "clip_grad_norm_(model.parameters(), max_norm=1.0)"),)),
    Case(EX, "infinity-norm", "norm_type=inf",
         edits=((CLIP, 'clip_grad_norm_(model.parameters(), max_norm, norm_type=float("inf"))'),)),
    Case(EX, "each-rank-clips-a-share", "was given max_norm / 2",
         edits=((CLIP, "clip_grad_norm_(model.parameters(), max_norm / dist.get_world_size())"),)),
    Case(EX, "norm-summed-over-the-ranks", "the norm was summed over the ranks",
         edits=(("    scaler.step(optimizer)\n",
                 "    dist.all_reduce(norm)\n    scaler.step(optimizer)\n"),)),
    # helper 68: averaged, the norm is the same number, and the check said right
    Case(EX, "norm-averaged-over-the-ranks", "clipping needs none",
         edits=(("    scaler.step(optimizer)\n", "    dist.all_reduce(norm)\n"
                 "    norm /= dist.get_world_size()\n    scaler.step(optimizer)\n"),)),
    # the exercise since the twelfth session: the step over K micro-batches (--grad-accum)
    Case(EX, "no-no-sync", "4 all_reduces in step 1 for 4 micro-batches",
         edits=((WITH, "        with nullcontext():\n"),)),
    Case(EX, "no-sync-on-every-micro-batch", "made no all_reduce",
         edits=((WITH, "        with model.no_sync():\n"),)),
    Case(EX, "loss-not-divided-by-k", "divide each micro-batch's loss by k",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y)"),)),
    Case(EX, "the-whole-step-per-micro-batch", "scaler.step ran 4 times in step 1",
         edits=((AFTER, ""), (BACKWARD, BACKWARD + "".join(
             "        " + line + "\n" for line in AFTER.splitlines())))),
    Case(EX, "unscale-per-micro-batch", "unscale",
         edits=(("    scaler.unscale_(optimizer)\n", ""),
                (BACKWARD, BACKWARD + "            scaler.unscale_(optimizer)\n"))),
    Case(EX, "clip-per-micro-batch", "ran before the last micro-batch's backward",
         edits=(("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n", ""),
                ("    scaler.unscale_(optimizer)\n", ""),
                (BACKWARD, BACKWARD + "            norm = torch.nn.utils.clip_grad_norm_("
                                      "model.parameters(), max_norm * scaler.get_scale())\n"),
                ("    scaler.step(optimizer)\n",
                 "    norm = norm / scaler.get_scale()\n    scaler.step(optimizer)\n"))),
    # from a learner's try of the new exercise (helper 56): one batch of all the micro-batches
    # passed (the numbers are the same; the memory is what accumulation saves)
    Case(EX, "the-micro-batches-put-together", "ran 1 backward(s) for its 4 micro-batches",
         edits=(("    for i, (x, y) in enumerate(micro_batches):\n" + WITH
                 + "            loss = nn.functional.cross_entropy(model(x), y) / k\n" + BACKWARD,
                 "    x = torch.cat([x for x, _ in micro_batches])\n"
                 "    y = torch.cat([y for _, y in micro_batches])\n"
                 "    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()\n"),)),
    Case(EX, "forward-outside-no-sync", "the forward too",
         edits=((WITH + "            loss = nn.functional.cross_entropy(model(x), y) / k\n",
                 "        loss = nn.functional.cross_entropy(model(x), y) / k\n" + WITH),)),
    Case(EX, "loss-divided-by-k-and-the-world", "by k only",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y) / (k * 2)"),)),
    # helper 99: the check's own count of micro-batches written in passed its run
    Case(EX, "micro-batch-count-written-as-4", "divide by k = len(micro_batches)",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y) / 4"),)),
    # helper 99: named for what they are, not "return what clip_grad_norm_ returns"
    Case(EX, "zero-grad-between-micro-batches", "zeroed between micro-batches",
         edits=(("            loss = nn.functional.cross_entropy(model(x), y) / k\n",
                 "            optimizer.zero_grad()\n"
                 "            loss = nn.functional.cross_entropy(model(x), y) / k\n"),)),
    Case(EX, "clipped-tensor-by-tensor", "not one per tensor",
         edits=(("    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n",
                 "    for p in model.parameters():\n"
                 "        norm = torch.nn.utils.clip_grad_norm_(p, max_norm)\n"),)),
    Case(EX, "synced-on-the-first-micro-batch", "not the last's",
         edits=(("nullcontext() if i == k - 1 else", "nullcontext() if i == 0 else"),)),
    # helper 117: a count written in as a product passed; a manual all_reduce and a
    # zero_grad before the step were told another mistake
    Case(EX, "loss-times-a-quarter", "right in this check's run only",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y) * 0.25"),)),
    Case(EX, "own-all-reduce-under-no-sync", "collective(s) of your own",
         edits=(("        with nullcontext() if i == k - 1 else model.no_sync():",
                 "        with model.no_sync():"),
                ("    scaler.unscale_(optimizer)\n",
                 "    for p in model.parameters():\n"
                 "        torch.distributed.all_reduce(p.grad)\n"
                 "        p.grad /= torch.distributed.get_world_size()\n"
                 "    scaler.unscale_(optimizer)\n"))),
    Case(EX, "zero-grad-before-the-step", "zeroed after the last backward",
         edits=(("    scaler.step(optimizer)\n",
                 "    optimizer.zero_grad()\n    scaler.step(optimizer)\n"),)),
    # helper 133: a norm taken before unscale_, the clip after it, was named a clip of the
    # scaled gradients
    Case(EX, "norm-returned-from-before-unscale", "measured before unscale_",
         edits=(("    scaler.unscale_(optimizer)\n",
                 "    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])\n"
                 "    scaler.unscale_(optimizer)\n"),
                ("    norm = torch.nn.utils.clip_grad_norm_(",
                 "    torch.nn.utils.clip_grad_norm_("))),
    # helper 153: right by accident while the micro-batches held K samples each
    Case(EX, "loss-divided-by-the-micro-batch-size", "divided by its size",
         edits=(("cross_entropy(model(x), y) / k", "cross_entropy(model(x), y) / len(x)"),)),
    # helper 153: named, not "return what clip_grad_norm_ returns" or "weights differ"
    Case(EX, "optimizer-stepped-beside-the-scaler", "stepped 2 times",
         edits=(("    scaler.step(optimizer)\n",
                 "    scaler.step(optimizer)\n    optimizer.step()\n"),)),
    Case(EX, "losses-added-one-backward", "one batch of all of them",
         edits=((WITH + "            loss = nn.functional.cross_entropy(model(x), y) / k\n"
                 + BACKWARD,
                 "        loss = nn.functional.cross_entropy(model(x), y) / k\n"
                 "        total = loss if i == 0 else total + loss\n"
                 "    scaler.scale(total).backward()\n"),)),
    Case(EX, "autocast-from-the-template", "ran under autocast",
         edits=(("            loss = nn.functional.cross_entropy(model(x), y) / k\n",
                 '            with torch.autocast("cpu", dtype=torch.bfloat16):\n'
                 "                loss = nn.functional.cross_entropy(model(x), y) / k\n"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_answers_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
