"""One entry of ``ddp-tutorial explain``'s catalogue (harness/messages.py): a message, its
cause, its fix, the lesson that shows it, and what decides it from the whole log."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """A message, what causes it, what fixes it, and where the course shows it; ``when(log)``
    rules it out where its line would mislead, ``detail(line, log)`` adds what the log says."""

    key: str
    pattern: str
    cause: str
    fix: str
    lesson: str
    when: Callable[[str], bool] | None = None
    detail: Callable[[str, str], str | None] | None = None

    def search(self, line: str) -> re.Match[str] | None:
        return re.search(self.pattern, line)

    def applies(self, text: str) -> bool:
        return self.when is None or self.when(text)
