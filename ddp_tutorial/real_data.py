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
from typing import Any

from torch.utils.data import Dataset

from ddp_tutorial.data import SyntheticImages

DATA_KINDS = ("synthetic", "folder", "cifar10")
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # roughly zero-mean, unit-variance pixels


class DataError(ValueError):
    """The data cannot be used; the message names the flag or file and what to do."""


def _images(directory: Path) -> list[Path]:
    """What ``ImageFolder`` will load: torchvision's own list of image suffixes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return sorted(p for p in directory.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS)


def _classes(split: Path) -> list[str]:
    return sorted(p.name for p in split.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_image_folder(root: str | Path) -> list[str]:
    """The class names of ``root/train`` after checking the layout; :class:`DataError` if bad."""
    from PIL import Image, UnidentifiedImageError

    root = Path(root)
    hint = "expected DIR/train/<class>/*.png|jpg and DIR/val/<class>/*.png|jpg"
    if not root.is_dir():
        raise DataError(f"--data-dir {root}: no such folder ({hint})")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise DataError(f"--data-dir {root}: no {split}/ folder inside ({hint})")
    classes = _classes(root / "train")
    if len(classes) < 2:
        raise DataError(f"--data-dir {root}: train/ needs at least 2 class folders ({hint})")
    for split in ("train", "val"):
        for name in classes:
            folder = root / split / name
            files = _images(folder) if folder.is_dir() else []
            if not files:
                raise DataError(
                    f"--data-dir {root}: class {name!r} has no images in {split}/ "
                    f"(every class of train/ needs {split}/{name}/ with .png or .jpg files)"
                )
            for path in files:
                try:
                    with Image.open(path) as image:
                        image.size  # noqa: B018 - the header is parsed by open(); size needs it
                except (UnidentifiedImageError, OSError) as exc:
                    raise DataError(
                        f"--data-dir: {path} is not a readable image ({exc}); delete or replace it"
                    ) from None
    extra = sorted(set(_classes(root / "val")) - set(classes))
    if extra:
        raise DataError(f"--data-dir {root}: val/ has classes that train/ lacks: {extra}")
    return classes


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


def _transforms(image_size: int, train: bool) -> Any:
    from torchvision import transforms as T

    if train:  # random crop + flip: the augmentation that must differ per rank (seeding.py)
        steps = [T.RandomResizedCrop(image_size, scale=(0.6, 1.0)), T.RandomHorizontalFlip()]
    else:
        steps = [T.Resize(image_size), T.CenterCrop(image_size)]
    return T.Compose([*steps, T.ToTensor(), T.Normalize(MEAN, STD)])


def image_folder(root: str | Path, image_size: int) -> tuple[Dataset, Dataset, int]:
    """``(train, val, num_classes)`` from a checked ImageFolder layout."""
    from torchvision.datasets import ImageFolder

    classes = check_image_folder(root)
    root = Path(root)
    train = ImageFolder(root / "train", transform=_transforms(image_size, train=True))
    val = ImageFolder(root / "val", transform=_transforms(image_size, train=False))
    if val.classes != classes:  # val/ lacks no class (checked); ImageFolder numbers by name
        raise DataError(f"--data-dir {root}: val/ classes {val.classes} != train/ {classes}")
    return train, val, len(classes)


def cifar10(root: str | Path | None, image_size: int, download: bool) -> tuple[Any, Any, int]:
    """CIFAR-10 from ``root`` (``--data-dir``); a clear :class:`DataError` when it is not there."""
    from torchvision.datasets import CIFAR10

    if root is None:
        raise DataError("--data cifar10 needs --data-dir: the folder that holds (or will hold) it")
    try:
        train, val = (
            CIFAR10(root, train=split, download=download, transform=_transforms(image_size, split))
            for split in (True, False)
        )
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted. …"
        raise DataError(
            f"--data cifar10: no intact copy in {root} ({exc}). Add --download to fetch it "
            f"once (needs internet; run it with one rank first, so ranks do not all download)"
        ) from None
    return train, val, 10


def build_datasets(args: Any) -> tuple[Dataset, Dataset, int]:
    """``(train, val, num_classes)`` for the template's flags.

    ``args`` needs ``data`` (None: folder with ``data_dir``, else synthetic),
    ``data_dir``, ``download``, ``image_size`` and, for synthetic data,
    ``num_samples``, ``num_val``, ``num_classes``, ``seed``.
    """
    kind = args.data or ("folder" if args.data_dir else "synthetic")
    if kind == "folder":
        if args.data_dir is None:
            raise DataError("--data folder needs --data-dir DIR (DIR/train/<class>/…, DIR/val/…)")
        return image_folder(args.data_dir, args.image_size)
    if kind == "cifar10":
        return cifar10(args.data_dir, args.image_size, args.download)
    if kind != "synthetic":
        raise DataError(f"--data must be one of {DATA_KINDS}, got {kind!r}")
    # Same data on every rank: sample i is a pure function of (seed, i).
    try:
        train = SyntheticImages(args.num_samples, args.image_size, args.num_classes, seed=args.seed)
        val = SyntheticImages(args.num_val, args.image_size, args.num_classes, seed=args.seed + 1)
    except ValueError as exc:  # e.g. --image-size 2 or --num-classes 1
        raise DataError(
            f"synthetic data: {exc} (--num-samples, --image-size, --num-classes)"
        ) from None
    return train, val, args.num_classes
