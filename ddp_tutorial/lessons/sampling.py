"""Host-side helpers of lesson 02 (data and sampling): a model trained quickly, the F1 of a
set of predictions, what the launch's records drew, and the taught functions' source.

The rank-side code the lesson teaches (the validation shard, the exact sums, the gathered
predictions) lives in ``scripts/demos/sampling.py``, the script the lesson runs and shows.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def train_classifier(
    model: nn.Module,
    dataset: Dataset,
    epochs: int = 3,
    batch_size: int = 64,
    lr: float = 0.05,
    seed: int = 0,
) -> list[float]:
    """Single-process SGD training (momentum 0.9); returns the mean loss of each epoch.

    For lessons and tests that need a trained model quickly (the kernel or a
    test trains it, the ranks evaluate it). Deterministic for a given seed.
    SGD and not Adam: an Adam step asks the CUDA runtime, and on a machine with a GPU
    starts CUDA (lesson 01), which a lesson's kernel must not.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    torch.manual_seed(seed)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    losses = []
    for _ in range(epochs):
        total, n = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            n += len(y)
        losses.append(total / n)
    return losses


def draw_streams(records: list[dict], setting: str, key: str) -> dict[tuple[int, int], list[int]]:
    """``{(rank, worker): draws}``: what each DataLoader worker of each rank drew, in order.

    ``records`` are ``scripts/demos/sampling.py --pipelines`` rank records; ``key``
    is ``"crop"`` (the dataset's own numpy generator) or ``"flip"`` (torch's).
    """
    streams: dict[tuple[int, int], list[int]] = {}
    for record in records:
        for item in record["augment"][setting]:
            streams.setdefault((record["rank"], item["worker"]), []).append(item[key])
    return dict(sorted(streams.items()))


def reseeded_with(worker_init_fn: Callable[[int], None], worker_seed: int = 1234) -> int | None:
    """The seed ``worker_init_fn`` hands to the ``reseed`` of a dataset, inside a stand-in worker.

    Lets the notebook check a ``worker_init_fn`` written in a cell against
    :func:`ddp_tutorial.seeding.seed_worker` without starting a worker process
    (the kernel never forks): ``get_worker_info()`` answers for worker 0 of
    one, whose torch seed is ``worker_seed``. ``None``: ``reseed`` was not called.
    """

    class Owned:  # a dataset that owns a generator, as RandomCrops does
        seed: int | None = None

        def reseed(self, seed: int) -> None:
            self.seed = seed

    info = SimpleNamespace(id=0, num_workers=1, seed=worker_seed, dataset=Owned())
    with (
        mock.patch("torch.utils.data.get_worker_info", return_value=info),
        mock.patch("ddp_tutorial.seeding.get_worker_info", return_value=info),
    ):
        worker_init_fn(0)
    return info.dataset.seed


def stream_counts(length: int, world_size: int, workers: int) -> list[int]:
    """Records each rank reads from a sharded ``NumberStream``, its ``workers`` workers together.

    The real :class:`ddp_tutorial.pipelines.NumberStream`, iterated once per
    (rank, worker) in this process with ``get_worker_info()`` answering for
    that worker: the counts a launch of ``world_size`` ranks would see, without one.
    """
    from ddp_tutorial import pipelines

    counts = []
    for rank in range(world_size):
        total = 0
        for worker in range(max(1, workers)):
            info = SimpleNamespace(id=worker, num_workers=max(1, workers))
            with mock.patch.object(pipelines, "get_worker_info", return_value=info):
                total += sum(1 for _ in pipelines.NumberStream(length, rank, world_size))
        counts.append(total)
    return counts


def macro_f1(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> float:
    """Macro F1: the mean over classes of ``2·TP / (2·TP + FP + FN)`` (0 for an empty class).

    Not a sum over samples: the F1 of each rank's shard, averaged over ranks,
    is not the F1 of the whole set (lesson 02 shows by how much).
    """
    scores = []
    for c in range(num_classes):
        tp = int(((pred == c) & (target == c)).sum())
        wrong = int(((pred == c) != (target == c)).sum())  # FP + FN
        scores.append(2 * tp / (2 * tp + wrong) if tp + wrong else 0.0)
    return sum(scores) / num_classes


def function_source(path: str | Path, *names: str) -> str:
    """The source of the named top-level functions of ``path``, in the order given, as the
    lesson's markdown shows them (two blank lines apart).

    Read from the file, not imported: a script that torchrun runs is not a module of the
    package. The lesson's cells compare it with what the launch recorded it ran; a test keeps
    the markdown's copy equal to it.
    """
    text = Path(path).read_text()
    found = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in names if name not in found]
    if missing:
        raise LookupError(f"{path} defines no function {missing}")
    lines = text.splitlines()
    parts = []
    for name in names:
        node = found[name]
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        parts.append("\n".join(lines[start - 1 : node.end_lineno]))
    return "\n\n\n".join(parts) + "\n"
