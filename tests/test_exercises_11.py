"""Lesson 11's exercises: wrong mixed-precision steps and bf16 hooks, each named (edits of the
solutions)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "11_bf16_hook"
AMP = "11_amp_step"
CASES = register([
    Case(AMP, "all-reduce-every-micro-batch", "model.no_sync()",
         edits=(("sync = nullcontext() if last else model.no_sync()", "sync = nullcontext()"),)),
    Case(AMP, "no-autocast", "torch.autocast",
         edits=(("cast = torch.autocast(x.device.type, dtype=dtype)", "cast = nullcontext()"),)),
    Case(AMP, "backward-on-the-unscaled-loss", "scaler.scale(loss)",
         edits=(("to_backward = scaler.scale(loss)", "to_backward = loss"),)),
    Case(AMP, "optimizer-step-past-the-scaler", "not optimizer.step()",
         edits=(("    scaler.step(optimizer)", "    optimizer.step()"),)),
    Case(AMP, "optimizer-step-no-scaler", "step through the scaler",
         edits=(("    scaler.step(optimizer)", "    optimizer.step()"),
                ("    scaler.update()  # after a skip: the scale halves\n", ""))),
    Case(AMP, "step-every-micro-batch", "one scaler.step, after the last micro-batch",
         edits=(("        total += loss.item()\n",
                 "        total += loss.item()\n        scaler.step(optimizer)\n"
                 "        scaler.update()\n"),
                ("    scaler.step(optimizer)  # unscales", "    # unscales"),
                ("    scaler.update()  # after a skip: the scale halves\n", ""))),
    Case(AMP, "no-update", "call scaler.update() after every scaler.step",
         edits=(("    scaler.update()  # after a skip: the scale halves\n", ""),)),
    Case(AMP, "loss-not-divided", "divide each micro-batch's loss",
         edits=(("loss = nn.functional.cross_entropy(model(x), y) / accum",
                 "loss = nn.functional.cross_entropy(model(x), y)"),)),
    Case(AMP, "no-sync-on-the-last-micro-batch", "not the last: model.no_sync()",
         edits=(("sync = nullcontext() if last else model.no_sync()",
                 "sync = model.no_sync() if last else nullcontext()"),)),
    Case(AMP, "update-before-step", "found no scaler.step(optimizer) before it",
         edits=(("    scaler.step(optimizer)  # unscales; skips the step on every rank if a "
                 "gradient is inf/nan\n", ""),
                ("    scaler.update()  # after a skip: the scale halves\n",
                 "    scaler.update()\n    scaler.step(optimizer)\n"))),
    Case(AMP, "loss-times-the-scale", "did not run on scaler.scale(loss)",
         edits=(("to_backward = scaler.scale(loss)", "to_backward = loss * scaler.get_scale()"),)),
    Case(EX, "future-not-chained", "whose value is a list [tensor]",
         edits=(("    future = work.get_future().then(decompress)",
                 "    future = work.get_future()"),)),
    Case(EX, "sum-not-mean", "divide by the world size",
         edits=((".div_(world_size)", ""),)),
    Case(EX, "sends-float32", "cast the bucket to torch.bfloat16",
         edits=(("buffer.to(torch.bfloat16)", "buffer.clone()"),)),
    Case(EX, "sum-never-returned", "copy the all-reduced sum back into the bucket",
         edits=(("    future = work.get_future().then(decompress)\n",
                 "    work.wait()\n"),)),
    Case(EX, "string-annotations", "DDP refused the hook's signature",
         edits=(("DDP reads the hook's annotations at run time.\n",
                 "DDP reads the hook's annotations at run time.\n"
                 "from __future__ import annotations\n\n"),)),
    Case(EX, "sends-float16", "sent float16",
         edits=(("buffer.to(torch.bfloat16)", "buffer.to(torch.float16)"),)),
])  # fmt: skip


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES, ids=str)
def test_wrong_hooks_are_named(case, exercise_verdicts):
    assert_verdict(case, exercise_verdicts)
