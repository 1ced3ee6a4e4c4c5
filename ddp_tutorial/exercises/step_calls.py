"""Lesson 06's exercise: the order of the calls one step made (``lesson06``'s records).

On a CPU in float32 the scaler changes no number: an answer that steps past it, or advances
the schedule before the step, would pass on the weights alone. The calls, in the order the step made
them (the scaler's, the optimizer's, the scheduler's, clip_grad_norm_), show it.
"""

from __future__ import annotations


def call_order(calls: list[str], step: int) -> str | None:
    """The mistakes no number shows on a CPU in float32: the step past the scaler, the
    schedule advanced before the step it sets the rate for."""
    if "optimizer.step" in calls and not any(c.startswith("scaler.") for c in calls):
        return (f"in step {step + 1} the scaler train_step is given was never called: "
                "backward() ran on the loss itself, or through a scaler of your own (made in "
                "the step, its scale starts over every time and never learns from an overflow) "
                "- scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update() with "
                "the one you are given; with float16, small gradients round to 0 without the "
                "scale (on this CPU in float32 no number shows it) "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if "scaler.scale" not in calls:
        return (f"in step {step + 1} backward() ran on the loss itself: "
                "scaler.scale(loss).backward() - with float16, small gradients round to 0 "
                "without the scale (on this CPU in float32 no number shows it) "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    if "scaler.step" not in calls:
        return (f"in step {step + 1} the optimizer stepped past the scaler: "
                "scaler.step(optimizer), not optimizer.step() - it skips a step whose "
                "gradients hold an inf or nan (an fp16 overflow) "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    last_backward = len(calls) - 1 - calls[::-1].index("scaler.scale")
    if "zero_grad" in calls[calls.index("scaler.scale") : last_backward]:
        return (f"in step {step + 1} the gradients were zeroed between micro-batches: "
                "zero_grad() throws away what the earlier micro-batches accumulated - once a "
                "step, before the first micro-batch or after the optimizer's step "
                '(lesson 04, "`no_sync()`: gradient accumulation without wasted '
                'all_reduces")')  # fmt: skip
    if "clip" in calls and calls.index("scaler.scale") < calls.index("clip") < last_backward:
        return (f"in step {step + 1} clip_grad_norm_ ran before the last micro-batch's "
                "backward: the gradients were neither all there nor averaged over the ranks "
                "yet - clip once, after the last backward (and scaler.unscale_ once, before it) "
                "(lesson 06, \"Three things every real loop needs\")")  # fmt: skip
    if "clip" in calls and calls.index("clip") < calls.index("scaler.scale"):
        return (f"in step {step + 1} clip_grad_norm_ ran before backward(): the gradients it "
                "clipped were not this step's yet - backward, scaler.unscale_(optimizer), then "
                "clip (lesson 06, \"Three things every real loop needs\")")  # fmt: skip
    if "scaler.update" not in calls:
        return (
            f"step {step + 1} never called scaler.update(): after scaler.step(optimizer), "
            "every step - it halves the scale after an overflow and grows it back "
            '(lesson 06, "Three things every real loop needs")'
        )
    ran = [c for c in calls if c in ("optimizer.step", "scheduler.step")]
    if ran and ran[0] == "scheduler.step":
        return (f"in step {step + 1} scheduler.step() ran before the optimizer's step, so the "
                "step used the schedule's next rate: call scheduler.step() after "
                "scaler.step(optimizer) "
                '(lesson 06, "Three things every real loop needs")')  # fmt: skip
    return None
