"""Lesson 11's exercise: wrong bf16 compression hooks, each named (edits of the solution)."""

from __future__ import annotations

import pytest
from exercise_cases import Case, assert_verdict, register

EX = "11_bf16_hook"
CASES = register([
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
