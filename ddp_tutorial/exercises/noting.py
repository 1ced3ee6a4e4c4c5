"""Lessons 06 and 11's checks, rank side: the scaler, the schedule and zero_grad noting each
call, in order (on a CPU in float32 the scaler changes no number: the order is what shows a
step past it, a schedule advanced early, a norm measured before unscale_). Not a lesson*
module: those hold exercises."""

from __future__ import annotations

from typing import Any

import torch


class NotingScaler(torch.amp.GradScaler):
    """A GradScaler that notes which of its methods ran, in order, in ``calls``."""

    def __init__(self, calls: list[str], init_scale: float) -> None:
        super().__init__("cpu", init_scale=init_scale)
        self.calls = calls

    def scale(self, outputs: Any) -> Any:
        self.calls.append("scaler.scale")
        return super().scale(outputs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("scaler.step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        self.calls.append("scaler.update")
        super().update(new_scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append("scaler.unscale_")  # also from inside step(), after "scaler.step"
        super().unscale_(optimizer)


class NotingSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The warm-up schedule, noting each ``step()`` in ``calls`` once that is set (not the
    step the constructor takes)."""

    calls: list[str] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.calls is not None:
            self.calls.append("scheduler.step")
        super().step(*args, **kwargs)


def noted(zero_grad: Any, calls: list[str]) -> Any:
    def noted(*args: Any, **kwargs: Any) -> Any:
        calls.append("zero_grad")
        return zero_grad(*args, **kwargs)

    return noted


def noted_forward(calls: list[str]) -> Any:
    """A forward pre-hook noting "forward", then "autocast" if the forward runs under it."""
    return lambda *_: calls.extend(["forward", *["autocast"] * torch.is_autocast_enabled("cpu")])


def without(calls: list[str], theirs: list[str]) -> list[str]:
    """``calls`` less one of each of ``theirs`` (DDP's all_reduces, through its comm hook)."""
    left = list(calls)
    for name in theirs:
        if name in left:
            left.remove(name)
    return left
