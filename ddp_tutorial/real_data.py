"""The template's datasets: synthetic by default, an image folder or CIFAR-10 for real.

Synthetic stripes (:class:`ddp_tutorial.data.SyntheticImages`) reach 100 %
validation accuracy in an epoch: enough to see DDP work, nothing about
convergence. Real data comes in two forms:

* an **image folder**, torchvision's ``ImageFolder`` layout —
  ``DIR/train/<class>/*.png|jpg`` and ``DIR/val/<class>/…`` — with random
  crop + horizontal flip for training;
* **CIFAR-10** through ``torchvision.datasets.CIFAR10`` (``--download``
  fetches it once; torchvision checks the files' checksums).

Every rank builds its datasets *before* joining the process group, and
:func:`check_image_folder` looks at the folder first: a missing or empty
folder, a class with no validation images or a file that is not an image
stops every rank in seconds with one message, instead of a ``PIL`` traceback
from inside a DataLoader worker an epoch later. Only each file's header is
read (``PIL.Image.open``: fast enough for a million files); a file truncated
after a valid header is still found only when it is decoded.
"""

from __future__ import annotations

from pathlib import Path

from ddp_tutorial._kit import kit

# One copy of each helper: scripts/ddp_kit.py, the template's sidecar (ddp_tutorial._kit).
DATA_KINDS = kit.DATA_KINDS
MEAN = kit.MEAN
STD = kit.STD
DataError = kit.DataError
check_image_folder = kit.check_image_folder
image_folder = kit.image_folder
cifar10 = kit.cifar10
build_datasets = kit.build_datasets

DATA_KINDS = ("synthetic", "folder", "cifar10")
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # roughly zero-mean, unit-variance pixels


def write_example_folder(
    root: str | Path,
    classes: tuple[str, ...] = ("a", "b", "c"),
    train: int = 8,
    val: int = 3,
    size: int = 12,
    same: bool = False,
) -> Path:
    """Write a tiny ImageFolder of generated PNGs (a colour per class, plus noise).

    Something to point ``--data-dir`` at without a download. ``same=True``
    writes one picture, a diagonal ramp, everywhere: every crop and flip of
    it shows, so two ranks' augmentations can be compared directly.
    """
    import torch
    from PIL import Image

    root, gen = Path(root), torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 255, size)[:, None, None] * torch.linspace(0.2, 1, size)[None, :, None]
    for split, count in (("train", train), ("val", val)):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                colour = torch.tensor([200.0, 40.0, 40.0]).roll(c)
                noisy = colour + torch.rand(size, size, 3, generator=gen) * 60
                pixels = (ramp.expand(size, size, 3) if same else noisy).clamp(0, 255)
                Image.fromarray(pixels.to(torch.uint8).numpy()).save(
                    root / split / name / f"{i}.png"
                )
    return root
