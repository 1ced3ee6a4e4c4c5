"""Small models for fast lessons, and torchvision's resnet18 for the template.

Lessons need models that train in seconds on a 2-core CPU; the template needs
a real architecture with BatchNorm (for SyncBatchNorm) that users recognise.
All are built with random weights: nothing is downloaded.
"""

from __future__ import annotations

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
MODEL_NAMES = kit.MODEL_NAMES
MLP = kit.MLP
SmallCNN = kit.SmallCNN
resnet18 = kit.resnet18
build_model = kit.build_model
unwrap_model = kit.unwrap_model

MODEL_NAMES = ("mlp", "cnn", "resnet18")
