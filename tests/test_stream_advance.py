"""cache.stream() under a new DataLoader per epoch, the way reproducible training scripts build
them (``generator=torch.Generator().manual_seed(0)``, no ``set_epoch``): each ``iter()`` is a
new epoch over a new snapshot, never a replay of a finished one (issue 20, item 3).

With a fixed generator every loader hands its workers the same base seed, so the workers of
epoch 1 looked like the workers of epoch 0 and were given epoch 0's share again: the same
samples in the same order, and once eviction had taken those released samples, a bare
``KeyError`` in the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from common.writer import fill
from torch.utils.data import DataLoader

from epochcache import Cache, SnapshotClosed


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _loader(stream: Any, workers: int) -> DataLoader[Any]:
    return DataLoader(stream, batch_size=25, num_workers=workers,
                      generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("workers", [1, 2])
def test_each_new_loader_is_a_new_epoch(tmp_path: Path, workers: int) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 200, capacity="64MiB")
    cache = Cache(path, sync=False)
    with cache.stream(seed=0) as stream:
        epochs: list[list[int]] = []
        for epoch in range(3):
            epochs.append([i for batch in _loader(stream, workers) for i in _ids(batch)])
            fill(path, 200 + 100 * epoch, 100)  # the cache grows between epochs
        for epoch, ids in enumerate(epochs):
            assert len(ids) == len(set(ids)) == 200 + 100 * epoch, epoch
        assert epochs[0] != epochs[1][:200]  # a new order, not a replay


def test_a_new_loader_after_eviction_reads_the_new_snapshot(tmp_path: Path) -> None:
    """Epoch 0's samples are released and then evicted by new ones: epoch 1 reads the new
    snapshot (a replay of epoch 0 would find its samples gone: KeyError in the workers)."""
    path = str(tmp_path / "c")
    # ~380 B records: 100 KiB keeps ~270 samples.
    fill(path, 0, 200, capacity="100KiB", headroom="8KiB")
    cache = Cache(path, sync=False)
    with cache.stream(seed=0) as stream:
        first = [i for batch in _loader(stream, 2) for i in _ids(batch)]
        fill(path, 1000, 300, capacity="100KiB", headroom="8KiB")  # evicts all of epoch 0
        assert cache.counters().evicted >= 200
        second = [i for batch in _loader(stream, 2) for i in _ids(batch)]
    assert sorted(first) == list(range(200))
    assert second and min(second) >= 1000 and len(second) == len(set(second))


@pytest.mark.parametrize("workers", [0, 2])
def test_reading_a_released_snapshot_names_the_epoch(tmp_path: Path, workers: int) -> None:
    """The epoch's lease is released under it (reclaimed by another process) and its samples
    evicted: the stream raises SnapshotClosed naming the epoch, not KeyError."""
    path = str(tmp_path / "c")
    fill(path, 0, 200, capacity="100KiB", headroom="8KiB")
    cache = Cache(path, sync=False)
    with cache.stream(seed=0) as stream:
        stream.set_epoch(7)
        loader = DataLoader(stream, batch_size=25, num_workers=workers, prefetch_factor=None
                            if workers == 0 else 1)
        it = iter(loader)
        next(it)
        for lease in cache.leases():
            cache.release_lease(lease.lease_id)
        fill(path, 1000, 300, capacity="100KiB", headroom="8KiB")
        with pytest.raises(SnapshotClosed, match="epoch 7") as raised:
            for _batch in it:
                pass
        # The error's traceback holds the iterator (its frames' self): without dropping both,
        # the workers outlived the test by 12 s, waiting for an index.
        raised.value.__traceback__ = None
        del it, raised
