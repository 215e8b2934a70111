"""EpochDataset: a snapshot under a lease, small pickles, lazy LMDB per worker, batched reads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from common.writer import fill, sample_array
from torch.utils.data import DataLoader

from epochcache import Cache, SnapshotClosed
from epochcache.data.dataset import EpochDataset


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    fill(str(tmp_path / "c"), 0, 300)
    return Cache(tmp_path / "c", sync=False)


def _index_of(array: np.ndarray) -> int:
    return int(array[0])


def test_context_manager_holds_then_releases_the_lease(cache: Cache) -> None:
    with cache.dataset(epoch=3) as ds:
        assert isinstance(ds, EpochDataset) and len(ds) == 300
        assert [lease.count for lease in cache.leases()] == [300]
        assert ds.seqs.dtype == np.uint64 and ds.seqs.nbytes == 8 * 300
    assert cache.leases() == []
    with pytest.raises(SnapshotClosed):
        ds[0]


def test_items_and_batches_agree(cache: Cache) -> None:
    with cache.dataset() as ds:
        assert _index_of(ds[5]) == 5 and _index_of(ds[-1]) == 299
        np.testing.assert_array_equal(ds[7].view(np.uint32), sample_array(7).view(np.uint32))
        idx = [9, 3, 250]
        items = ds.__getitems__(idx)
        batch = ds.get_batch(idx)
        assert isinstance(batch, torch.Tensor) and batch.shape == (3, 64)
        for row, item, i in zip(batch, items, idx):
            assert _index_of(item) == i
            assert torch.equal(row.view(torch.int32), torch.from_numpy(item).view(torch.int32))
        with pytest.raises(IndexError):
            ds[300]


def test_batch_buffers_are_not_reused_while_held(cache: Cache) -> None:
    with cache.dataset() as ds:
        first = ds.get_batch(range(0, 4))
        view = ds.get_batch(range(4, 8))[1]
        array = ds.get_batch(range(12, 16)).numpy()  # the tensor dropped, its array kept
        third = ds.get_batch(range(8, 12))
        fourth = ds.get_batch(range(16, 20))
        assert [_index_of(r.numpy()) for r in first] == [0, 1, 2, 3]
        assert _index_of(view.numpy()) == 5
        assert [_index_of(r) for r in array] == [12, 13, 14, 15]
        assert [_index_of(r.numpy()) for r in third] == [8, 9, 10, 11]
        assert [_index_of(r.numpy()) for r in fourth] == [16, 17, 18, 19]


def test_pickles_small_without_handles(cache: Cache) -> None:
    with cache.dataset() as ds:
        ds[0]  # opens the environment in this process
        blob = pickle.dumps(ds)
        assert len(blob) < 300 * 8 + 2000
        clone = pickle.loads(blob)
        assert clone.snapshot is None and _index_of(clone[10]) == 10
        clone.close()  # a copy holds no lease: closing it must not release the owner's
        assert len(cache.leases()) == 1


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_read_every_sample_once(cache: Cache, context: str) -> None:
    with cache.dataset() as ds:
        loader = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context=context)
        seen = [int(v) for batch in loader for v in batch[:, 0]]
    assert sorted(seen) == list(range(300))


def test_tar_style_samples_collate_by_field(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "t", "8MiB", sync=False)
    from common.writer import npy_bytes

    cache.put_many([(f"shard/{i:03d}", {"npy": npy_bytes(np.full(4, i, np.float32)),
                                         "cls": str(i % 3).encode(), "json": b'{"i": 1}'})
                    for i in range(10)])
    with cache.dataset() as ds:
        batch = ds.get_batch(range(10))
    assert batch["npy"].shape == (10, 4) and batch["cls"].tolist() == [i % 3 for i in range(10)]
    assert batch["json"]["i"].tolist() == [1] * 10


def test_bad_options_are_named(cache: Cache) -> None:
    with pytest.raises(ValueError, match="on_error"):
        cache.dataset(on_error="ignore")
    with pytest.raises(TypeError, match="transform"):
        cache.dataset(transform=3)
