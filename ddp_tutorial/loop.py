"""The template's loop parts that are not DDP, for the lessons and tests.

The optimizer, the LR schedule and the log line are helpers of the template's
sidecar (``scripts/ddp_kit.py``), re-exported here; the flags stand at the top of
``scripts/train.py`` itself (add yours there), and :func:`parse_template_args`
parses them with the template's own parser:

* :func:`build_optimizer` — AdamW (or SGD) with weight decay on weight matrices and
  convolution kernels only (biases and normalisation weights set scales and
  offsets: shrinking them towards 0 only hurts); fused;
* :func:`lr_at` / :func:`set_lr` — linear warm-up, cosine decay, as a multiple of each
  parameter group's own base LR;
* :func:`counted_targets` — how many targets a mean loss averages over (padding left
  out): a step's share of each micro-batch;
* :class:`TrainLog` — rank 0's line every ``--log-every`` steps (the window's mean loss
  over every rank, LR, gradient norm, training samples/s, GPU memory), TensorBoard.
"""

from __future__ import annotations

import argparse
import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
build_optimizer = kit.build_optimizer
counted_targets = kit.counted_targets
lr_at = kit.lr_at
set_lr = kit.set_lr
TrainLog = kit.TrainLog

TEMPLATE = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


@cache
def template() -> ModuleType:
    """``scripts/train.py`` as a module (its functions, without running ``main``)."""
    spec = importlib.util.spec_from_file_location("template_train", TEMPLATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_template_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The template's flags, parsed by ``scripts/train.py``'s own ``parse_args``."""
    return template().parse_args(argv)
