"""Input pipelines per rank and per worker (ddp_tutorial.pipelines) in one process.

Lesson 02 runs both datasets in 2 real ranks with 2 workers each and asserts
the broken and the fixed setups. Here: the cases it does not run — 3 ranks,
no worker, one or two, a length that does not divide — with real DataLoader workers,
ranks simulated by their number (sharding needs no process group).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from ddp_tutorial.pipelines import NumberStream, RandomCrops
from ddp_tutorial.seeding import loader_generator, seed_worker


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_sharded_stream_reads_every_record_once(workers):
    world, length = 3, 25  # 25 records over 3 x max(1, workers) readers: uneven on purpose
    seen = [
        [int(i) for i in DataLoader(NumberStream(length, r, world), num_workers=workers)]
        for r in range(world)
    ]
    assert sorted(i for s in seen for i in s) == list(range(length))
    counts = [len(s) for s in seen]
    assert max(counts) - min(counts) <= max(1, workers)  # per reader at most one apart


def test_unsharded_stream_is_read_by_every_worker():
    loader = DataLoader(NumberStream(6, sharded=False), num_workers=2)
    assert Counter(int(i) for i in loader) == {i: 2 for i in range(6)}


def test_a_dataset_generator_is_copied_into_workers_unless_reseeded():
    def crops(**options):
        loader = DataLoader(RandomCrops(8, seed=1), batch_size=None, num_workers=2, **options)
        draws: dict[int, list[int]] = {}
        for item in loader:
            draws.setdefault(item["worker"], []).append(item["crop"])
        return draws

    torch.manual_seed(0)
    copied = crops()
    assert copied[0] == copied[1]  # both workers drew the same crops
    reseeded = crops(generator=loader_generator(1, rank=0), worker_init_fn=seed_worker)
    assert reseeded[0] != reseeded[1]
    again = crops(generator=loader_generator(1, rank=0), worker_init_fn=seed_worker)
    assert again == reseeded  # and reproducibly so


def test_one_picture_differs_only_by_augmentation():
    import torch

    from ddp_tutorial.pipelines import OnePicture

    torch.manual_seed(0)
    items = [OnePicture()[0][0] for _ in range(8)]
    assert items[0].shape == (3, 16, 16)
    assert len({tuple(x.flatten().tolist()) for x in items}) > 1, "crops and flips vary"
    torch.manual_seed(0)
    assert torch.equal(OnePicture()[5][0], items[0]), "a function of the generator, not the index"


def test_a_stream_sized_from_its_readers_gives_every_rank_as_many():
    world, workers = 8, 2  # 16 readers, as lesson 02 at 8 ranks

    def counts(length: int) -> list[int]:
        return [len(list(DataLoader(NumberStream(length, r, world), num_workers=workers)))
                for r in range(world)]  # fmt: skip

    assert counts(3 * world * workers) == [3 * workers] * world  # --stream-per-reader 3
    assert counts(24) == [4, 4, 4, 4, 2, 2, 2, 2]  # the lesson's counter-example: 24 records


def test_seeded_crops_differ_on_every_rank_and_worker_at_8_ranks():
    from torch.utils.data.distributed import DistributedSampler

    from ddp_tutorial.seeding import seed_rank

    world, workers, draws = 8, 2, 4  # lesson 02 at 8 ranks: --draws 4 items per worker
    streams: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        seed_rank(42, rank)
        dataset = RandomCrops(draws * world * workers, seed=42)
        loader = DataLoader(
            dataset,
            batch_size=None,
            sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False),
            num_workers=workers,
            generator=loader_generator(42, rank, epoch=0),
            worker_init_fn=seed_worker,
        )
        for item in loader:
            streams.setdefault((rank, item["worker"]), []).append(item["crop"])
    assert len(streams) == world * workers and {len(s) for s in streams.values()} == {draws}
    assert len({tuple(s) for s in streams.values()}) == world * workers, "every stream its own"
