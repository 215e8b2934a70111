"""Continuous turnover (issue 21): once the cache is full, what an epoch has delivered is
released while it runs, so writers keep replacing it with new samples through the epoch instead
of waiting for the epoch's lease, and what the epoch has not delivered yet is never evicted.

A writer subprocess keeps inserting into a full cache while epochs read it slowly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from common.writer import Writer, fill, npy_bytes, sample_array
from torch.utils.data import DataLoader

from epochcache import Cache, CacheFull

# ~380 B records: 200 KiB holds ~540 samples; a headroom of 8 KiB only ~20 of them.
CAPACITY, HEADROOM = "200KiB", "8KiB"


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _inserted(cache: Cache) -> int:
    return cache.counters().next_seq


def _wait_for_writer(cache: Cache, since: int, at_least: int, deadline_s: float = 90) -> int:
    """Wait until the writer has inserted ``at_least`` samples after ``since``; return how many.

    A wait on a condition, not a rate: on a busy machine the writer may take seconds to start
    or to commit. Without progressive release it could add only the headroom (~20 samples) while
    the epoch's lease is held, however long it waited, so the deadline is then reached.
    """
    end = time.monotonic() + deadline_s
    while (added := _inserted(cache) - since) < at_least and time.monotonic() < end:
        time.sleep(0.05)
    return added


@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_release_what_they_delivered_and_the_writer_keeps_going(
        tmp_path: Path, workers: int) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 600, capacity=CAPACITY, headroom=HEADROOM)  # full, and evicting
    cache = Cache(path, sync=False)
    per_epoch_new: list[int] = []
    with Writer(path, start=600, per_batch=10, pause_s=0.005):
        for _epoch, loader in cache.epochs(3, batch_size=20, num_workers=workers,
                                           multiprocessing_context="spawn" if workers else None):
            before = _inserted(cache)
            ids: list[int] = []
            for i, batch in enumerate(loader):  # every sample reads: nothing undelivered was evicted
                ids.extend(_ids(batch))
                if i < 9:
                    # Slow batches: the loader takes the next epoch's snapshot (which protects
                    # all it holds) when the batches left take less than its lead time.
                    time.sleep(0.1)
                elif i == 9:
                    # A third delivered, the next snapshot not taken yet: the writer replaces
                    # what was delivered while this epoch's lease holds.
                    per_epoch_new.append(_wait_for_writer(cache, before, at_least=150))
            assert len(ids) == len(set(ids)) == len(loader.seqs)
    assert min(per_epoch_new) >= 150, per_epoch_new
    assert cache.leases() == []
    assert cache.counters().bytes <= cache.capacity_bytes + cache.headroom_bytes


def test_a_stream_releases_what_its_workers_read(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 600, capacity=CAPACITY, headroom=HEADROOM)
    cache = Cache(path, sync=False)
    with cache.stream(seed=0) as stream, Writer(path, start=600, per_batch=10, pause_s=0.005):
        for epoch in range(2):
            loader = DataLoader(stream, batch_size=20, num_workers=2,
                                generator=torch.Generator().manual_seed(epoch))
            ids: list[int] = []
            before = 0
            for i, batch in enumerate(loader):  # counted from the first batch: the lease is held
                before = before or _inserted(cache)
                ids.extend(_ids(batch))
                if i == 9:
                    assert _wait_for_writer(cache, before, at_least=150) >= 150
            assert len(ids) == len(set(ids)) > 400


def test_a_dataset_keeps_its_whole_snapshot(tmp_path: Path) -> None:
    """cache.dataset() is read in the user's own order: it protects its whole snapshot until
    it is closed, read or not, as before."""
    path = str(tmp_path / "c")
    fill(path, 0, 600, capacity=CAPACITY, headroom=HEADROOM)
    cache = Cache(path, sync=False)
    items = [(f"s/{i:07d}.npy", npy_bytes(sample_array(i))) for i in range(600, 700)]
    with cache.dataset(epoch=0) as ds:
        for i in range(len(ds)):
            ds[i]
        with pytest.raises(CacheFull) as full:
            cache.put_many(items, wait=False)
        assert full.value.result.inserted < 40  # the headroom's worth, no more
        assert all(ds[i] is not None for i in range(len(ds)))
    cache.put_many(items, wait=False)  # once closed, its samples make room


def test_release_epoch_keeps_the_whole_snapshot_until_the_epoch_ends(tmp_path: Path) -> None:
    """``release="epoch"``: the behaviour before progressive release, for who wants it."""
    path = str(tmp_path / "c")
    fill(path, 0, 600, capacity=CAPACITY, headroom=HEADROOM)
    cache = Cache(path, sync=False)
    items = [(f"s/{i:07d}.npy", npy_bytes(sample_array(i))) for i in range(600, 700)]
    for _epoch, loader in cache.epochs(1, batch_size=20, release="epoch"):
        for i, _batch in enumerate(loader):
            if i == len(loader) - 2:  # nearly all delivered, nothing released
                with pytest.raises(CacheFull):
                    cache.put_many(items, wait=False)
    with pytest.raises(ValueError, match="release"):
        cache.epochs(1, release="sometimes")
