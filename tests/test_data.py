"""ddp_tutorial.data: datasets, sampler claims (lesson 02), exact distributed evaluation.

The 2-rank exact evaluation of scripts/demos/sampling.py against one process is
asserted by notebooks/02_data_sampling.ipynb.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEMOS, gpu_count
from ddp_tutorial.data import GaussianBlobs, IndexDataset, SyntheticImages, distributed_evaluate
from ddp_tutorial.lessons.sampling import train_classifier
from ddp_tutorial.models import MLP, SmallCNN
from ddp_tutorial.samplers import (
    UnpaddedDistributedSampler,
    batch_plan,
    expected_padding,
    sampler_shards,
    shard_report,
)

# ---------------------------------------------------------------- sampler claims


@pytest.mark.parametrize("length,world", [(20, 2), (24, 4), (9, 3), (1, 1)])
def test_divisible_length_is_a_partition(length, world):
    for epoch in sampler_shards(length, world, epochs=3):
        report = shard_report(epoch, length)
        assert report.partition and report.padded == 0
        assert report.per_rank == [length // world] * world


@pytest.mark.parametrize("length,world", [(21, 2), (10, 4), (7, 3), (3, 4), (101, 8)])
def test_padding_repeats_indices_to_a_multiple_of_world_size(length, world):
    want = expected_padding(length, world)
    assert want["padded"] == -length % world
    for epoch in sampler_shards(length, world, epochs=2):
        report = shard_report(epoch, length)
        assert report.covering, "padding never drops a sample"
        assert report.per_rank == [want["per_rank"]] * world, "every rank gets the same count"
        assert report.total == length + want["padded"]
        assert report.padded == want["padded"]
        assert not report.disjoint
        # Each duplicated index is seen one extra time per padded slot.
        extra = sum(sum(i in shard for shard in epoch) - 1 for i in report.duplicates)
        assert extra == want["padded"]


@pytest.mark.parametrize("length,world", [(21, 2), (10, 4), (7, 3)])
def test_drop_last_is_disjoint_but_misses_samples(length, world):
    want = expected_padding(length, world, drop_last=True)
    for epoch in sampler_shards(length, world, epochs=2, drop_last=True):
        report = shard_report(epoch, length)
        assert report.disjoint and not report.covering
        assert len(report.missing) == want["dropped"] == length % world
        assert report.per_rank == [length // world] * world


def test_without_set_epoch_every_epoch_repeats_the_same_order():
    shards = sampler_shards(40, 2, epochs=4, set_epoch=False)
    assert all(epoch == shards[0] for epoch in shards)


def test_with_set_epoch_orders_differ_and_each_epoch_is_a_partition():
    shards = sampler_shards(40, 2, epochs=4, set_epoch=True)
    for a in range(4):
        assert shard_report(shards[a], 40).partition
        for b in range(a + 1, 4):
            assert shards[a][0] != shards[b][0], f"epochs {a} and {b} gave rank 0 the same order"


def test_sampler_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        sampler_shards(10, 0)
    with pytest.raises(ValueError, match="outside"):
        shard_report([[0, 11]], 10)
    with pytest.raises(ValueError, match="rank 2"):
        UnpaddedDistributedSampler(IndexDataset(5), num_replicas=2, rank=2)


@pytest.mark.parametrize("length", [0, 1, 2, 7, 21, 100])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_unpadded_sampler_covers_every_index_exactly_once(length, world, shuffle):
    ds = IndexDataset(length)
    samplers = [UnpaddedDistributedSampler(ds, world, r, shuffle=shuffle) for r in range(world)]
    shards = [list(s) for s in samplers]
    assert [len(s) for s in samplers] == [len(s) for s in shards]
    assert shard_report(shards, length).partition
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


# ---------------------------------------------------------------- datasets


def test_datasets_are_deterministic_per_index():
    a, b = SyntheticImages(50, image_size=16, seed=3), SyntheticImages(50, image_size=16, seed=3)
    for i in (0, 7, 49):
        xa, ya = a[i]
        xb, yb = b[i]
        assert torch.equal(xa, xb) and ya == yb
    assert a[0][0].shape == (3, 16, 16) and a[0][0].dtype == torch.float32
    other = SyntheticImages(50, image_size=16, seed=4)
    assert not torch.equal(a[0][0], other[0][0]), "a different seed draws different samples"
    assert torch.equal(a.colors, other.colors), "...of the same classes"
    g1, g2 = GaussianBlobs(30, seed=0), GaussianBlobs(30, seed=0)
    assert torch.equal(g1.data, g2.data) and torch.equal(g1.targets, g2.targets)
    with pytest.raises(IndexError):
        a[50]
    with pytest.raises(ValueError, match="num_classes"):
        SyntheticImages(10, num_classes=1)


def test_synthetic_images_are_learnable_by_a_small_cnn():
    """A few epochs of SmallCNN, single process, land far above chance (10%)."""
    torch.manual_seed(0)
    train = SyntheticImages(800, image_size=16, num_classes=10, seed=0)
    val = SyntheticImages(300, image_size=16, num_classes=10, seed=1)
    model = SmallCNN(3, 10)
    losses = train_classifier(model, train, epochs=3, batch_size=64)
    accuracy = distributed_evaluate(model, val).accuracy
    assert losses[-1] < 0.75 * losses[0], losses
    assert accuracy > 0.6, f"val accuracy {accuracy:.2f} after 3 epochs (chance: 0.10)"


def test_blobs_are_learnable_but_not_perfect():
    model = MLP(16, 4)
    train_classifier(model, GaussianBlobs(1000, seed=0), epochs=3)
    accuracy = distributed_evaluate(model, GaussianBlobs(301, seed=1)).accuracy
    assert 0.6 < accuracy < 1.0


# ---------------------------------------------------------------- exact evaluation


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_ranks_sums_add_up_to_one_process_and_padding_counts_twice(world):
    """What distributed_evaluate's all_reduce adds: each rank's [correct, count, loss] sums.

    Unpadded shards add up to the single process's numbers exactly; DistributedSampler's
    padded ones count the first ``-301 % world`` samples twice (seed 000's evaluation).
    """
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_tutorial.data import local_sums

    torch.manual_seed(0)
    model, data, cpu = MLP(16, 4), GaussianBlobs(301, seed=1), torch.device("cpu")
    whole = distributed_evaluate(model, data)  # no group: this process evaluates everything

    def summed(sampler_class) -> torch.Tensor:
        shards = [sampler_class(data, world, r, shuffle=False) for r in range(world)]
        return sum(local_sums(model, DataLoader(data, 16, sampler=s), cpu) for s in shards)

    exact = summed(UnpaddedDistributedSampler)
    assert (int(exact[0]), int(exact[1])) == (whole.correct, whole.count) == (whole.correct, 301)
    assert float(exact[2]) / 301 == pytest.approx(whole.loss, rel=1e-6)  # float32 batches
    padding = -301 % world
    naive = summed(DistributedSampler)
    repeated = local_sums(model, DataLoader(torch.utils.data.Subset(data, range(padding))), cpu)
    assert int(naive[1]) == 301 + padding and int(naive[0]) == whole.correct + int(repeated[0])


def test_evaluation_scores_with_trainings_loss():
    """A loss_fn given (the template passes training's): the mean of it over every sample."""
    torch.manual_seed(0)
    model, data = MLP(16, 4), GaussianBlobs(301, seed=1)
    sharp = torch.nn.CrossEntropyLoss(label_smoothing=0.3)
    x = torch.stack([data[i][0] for i in range(len(data))])
    y = torch.tensor([int(data[i][1]) for i in range(len(data))])
    with torch.no_grad():
        logits = model(x)
        want = sharp(logits, y).item()
        assert want != pytest.approx(torch.nn.functional.cross_entropy(logits, y).item())
    got = distributed_evaluate(model, data, 16, loss_fn=sharp)
    assert got.loss == pytest.approx(want, rel=1e-5) and got.count == 301


# ---------------------------------------------------------------- batch arithmetic, plots


def test_batch_plan_global_batch_is_per_rank_batch_times_world_size():
    plan = batch_plan(50_000, 64, 4)
    assert plan["global_batch"] == 256 and plan["samples_per_rank"] == 12_500
    assert plan["steps_per_epoch"] == 196
    assert batch_plan(21, 4, 2)["steps_per_epoch"] == 3  # 11 samples per rank, batches of 4
    with pytest.raises(ValueError):
        batch_plan(10, 0, 2)


def test_macro_f1_is_the_mean_of_per_class_f1_and_not_a_sum_over_shards():
    from ddp_tutorial.lessons.sampling import macro_f1

    pred, target = torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([0, 1, 1, 1, 2, 2])
    # class 0: TP 1, FP 1, FN 0 -> 2/3; class 1: TP 2, FP 1, FN 1 -> 2/3; class 2: 1, 0, 1 -> 2/3
    assert macro_f1(pred, target, 3) == pytest.approx(2 / 3)
    assert macro_f1(pred, target, 4) == pytest.approx(0.5)  # an empty class counts 0
    halves = [macro_f1(pred[s], target[s], 3) for s in (slice(0, 3), slice(3, 6))]
    assert sum(halves) / 2 != pytest.approx(macro_f1(pred, target, 3))  # why lesson 02 gathers


def test_reseeded_with_reports_the_seed_a_worker_init_fn_hands_the_dataset():
    from ddp_tutorial.lessons.sampling import reseeded_with
    from ddp_tutorial.seeding import seed_worker

    assert reseeded_with(seed_worker) == 1234
    assert reseeded_with(seed_worker, worker_seed=7) == 7
    assert reseeded_with(lambda worker_id: None) is None  # never called reseed


def test_stream_counts_are_the_sharded_stream_per_rank():
    from ddp_tutorial.lessons.sampling import stream_counts

    assert stream_counts(24, 8, 2) == [4] * 4 + [2] * 4  # lesson 02: readers 0-7 get two
    assert stream_counts(12, 2, 0) == [6, 6]  # no workers: the rank itself is one reader
    assert sum(stream_counts(101, 3, 4)) == 101  # every record exactly once


def test_plots_return_figures_that_render_as_png():
    from ddp_tutorial.harness.plots import NotebookFigure, grouped_bars, sampler_index_map

    fig = sampler_index_map(
        {"a": sampler_shards(9, 2, 2), "b": sampler_shards(9, 2, 2, drop_last=True)}, 9
    )
    assert isinstance(fig, NotebookFigure)
    assert fig._repr_png_().startswith(b"\x89PNG")
    rows = [{"w": w, "rank": r, "v": 1.0 + w + r} for w in (0, 2) for r in (0, 1)]
    assert grouped_bars(rows, "w", "rank", "v")._repr_png_().startswith(b"\x89PNG")
    with pytest.raises(ValueError):
        grouped_bars([], "w", "rank", "v")


@pytest.mark.gpu
def test_exact_evaluation_on_nccl_matches_single_process(tmp_path):
    from ddp_tutorial.harness.launch import torchrun

    n = gpu_count()
    model = MLP(16, 4)
    train_classifier(model, GaussianBlobs(600, seed=0), epochs=2)
    torch.save(model.state_dict(), tmp_path / "mlp.pt")
    truth = distributed_evaluate(model, GaussianBlobs(301, seed=1))
    result = torchrun(
        DEMOS / "sampling.py", "--model", tmp_path / "mlp.pt", "--val-length", 301,
        nproc=n, run_dir=tmp_path / "run", env={"DDP_TUTORIAL_BACKEND": "nccl"},
        timeout=180, echo=False,
    )  # fmt: skip
    for r in result.records:
        assert r["exact"]["count"] == 301 and r["exact"]["correct"] == truth.correct
        assert r["naive"]["count"] == 301 + (-301 % n)
