"""cache.stream(): a torch IterableDataset that takes a fresh snapshot on every iter().

Real DataLoader workers (fork, forkserver, spawn) and a real writer subprocess; each epoch is
checked against the lease the stream held while it ran (the snapshot's range and count).

Internals: a lease's plan (``reads.read_seqs``), its reclaim (``plumbing.reclaim_leases``)
and the state documents (``cache.tables``) are what the daemon and loaders leave.
"""

from __future__ import annotations

import gc
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.procs import kill_job
from common.writer import Writer, fill
from torch.utils.data import DataLoader

from epochcache import Cache, CacheStream
from epochcache.store.plumbing import reclaim_leases
from epochcache.store.reads import read_seqs


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _stream_leases(cache: Cache, stream: CacheStream) -> list[Any]:
    return [lease for lease in cache.leases() if lease.label.startswith(f"stream {stream.stream_id}")]


def _snapshot_ids(cache: Cache, stream: CacheStream) -> tuple[int, set[int]]:
    """The epoch and the sample ids of the stream's one live lease (read while it holds).

    The snapshot as taken is in its release plan: samples the workers have read may already
    be evicted (progressive release). Samples are written with id == sequence number here
    (checked on those still present)."""
    (lease,) = _stream_leases(cache, stream)
    seqs = read_seqs(cache.path, lease.lease_id)
    assert seqs is not None and len(seqs) == lease.count
    for seq in seqs[:: max(1, len(seqs) // 20)]:
        try:
            assert int(cache.info(int(seq)).key[2:9]) == int(seq)
        except KeyError:
            pass  # released and evicted
    return int(lease.label.rsplit(" ", 1)[1]), {int(s) for s in seqs}


@pytest.mark.parametrize("set_epoch", [False, True])
def test_three_epochs_two_workers_while_a_writer_inserts_and_evicts(tmp_path: Path,
                                                                     set_epoch: bool) -> None:
    path = str(tmp_path / "c")
    # ~380 B records: 400 KiB keeps ~1075 samples, so the writer forces eviction; the large
    # headroom keeps it from waiting on the epoch's lease.
    fill(path, 0, 1000, capacity="400KiB", headroom="16MiB")
    cache = Cache(path, sync=False)
    stream = cache.stream(seed=3)
    delivered: list[list[int]] = []
    snapshots: list[set[int]] = []
    with Writer(path, start=1000, per_batch=20, pause_s=0.01):
        for epoch in range(3):
            if set_epoch:  # prepared in the main process, claimed by the workers
                stream.set_epoch(10 + epoch)
            loader = DataLoader(stream, batch_size=50, num_workers=2)
            ids: list[int] = []
            for i, batch in enumerate(loader):
                if i == 0:  # the workers hold one lease for the epoch, named by its number
                    number, snapshot = _snapshot_ids(cache, stream)
                    assert number == (10 + epoch if set_epoch else epoch)
                ids.extend(_ids(batch))
                time.sleep(0.03)  # a training step: the writer gets to run
            delivered.append(ids)
            snapshots.append(snapshot)
            assert _stream_leases(cache, stream) == [] or set_epoch  # released by the workers
    assert cache.counters().evicted > 0
    for ids, snapshot in zip(delivered, snapshots):
        assert len(ids) == len(set(ids))  # exactly once ...
        assert set(ids) == snapshot  # ... every sample of the epoch's snapshot
    # Each epoch sees samples the writer added during the previous one.
    assert max(delivered[1]) > max(delivered[0]) and max(delivered[2]) > max(delivered[1])
    stream.close()
    assert cache.leases() == [] and cache.tables.states("stream/") == {}


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_workers_started_by_forkserver_and_spawn(tmp_path: Path, context: str) -> None:
    fill(str(tmp_path / "c"), 0, 90)
    cache = Cache(tmp_path / "c", sync=False)
    stream = cache.stream(seed=1)
    seen = []
    for epoch in range(2):
        loader = DataLoader(stream, batch_size=8, num_workers=2, multiprocessing_context=context)
        ids = [i for batch in loader for i in _ids(batch)]
        assert sorted(ids) == list(range(90)) + list(range(1000, 1000 + 10 * epoch))
        seen.append(ids)
        fill(str(tmp_path / "c"), 1000 + epoch * 10, 10)
    assert seen[0] != seen[1][: len(seen[0])]  # another epoch, another order
    assert cache.leases() == []


def test_order_is_fixed_by_seed_and_epoch(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 100)
    cache = Cache(tmp_path / "c", sync=False)

    def epoch_of(stream: CacheStream, epoch: int) -> list[int]:
        stream.set_epoch(epoch)
        return [i for batch in DataLoader(stream, batch_size=10) for i in _ids(batch)]

    a, b = cache.stream(seed=5), cache.stream(seed=5)
    assert epoch_of(a, 2) == epoch_of(b, 2)
    assert epoch_of(a, 3) != epoch_of(b, 2)
    assert sorted(epoch_of(cache.stream(seed=6), 2)) == list(range(100))
    unshuffled = cache.stream(shuffle=False)
    assert [i for batch in DataLoader(unshuffled, batch_size=10) for i in _ids(batch)] == \
        list(range(100))
    # With workers, the same epoch gives the same samples to the same worker in the same order.
    w1 = [_ids(b) for b in DataLoader(_at(cache.stream(seed=5), 4), batch_size=10, num_workers=2)]
    w2 = [_ids(b) for b in DataLoader(_at(cache.stream(seed=5), 4), batch_size=10, num_workers=2)]
    assert w1 == w2


def _at(stream: CacheStream, epoch: int) -> CacheStream:
    stream.set_epoch(epoch)
    return stream


def test_without_set_epoch_each_iter_advances_by_one(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 40)
    cache = Cache(tmp_path / "c", sync=False)
    stream = cache.stream(seed=0)
    for expected in range(3):
        it = iter(stream)
        next(it)
        assert stream.epoch == expected
        assert [lease.label for lease in cache.leases()] == [
            f"stream {stream.stream_id} epoch {expected}"]
        list(it)  # exhausted: released
        assert cache.leases() == []
    stream.set_epoch(7)
    assert stream.epoch == 7
    list(stream)
    list(stream)
    assert stream.epoch == 8
    # Workers advance the count too; the main process continues after them.
    list(DataLoader(stream, batch_size=8, num_workers=2))
    list(stream)
    assert stream.epoch == 10


def test_lease_released_when_closed_collected_and_when_workers_exit(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 200)
    cache = Cache(tmp_path / "c", sync=False)
    stream = cache.stream()
    it = iter(stream)
    next(it)
    assert len(cache.leases()) == 1
    it.close()  # type: ignore[attr-defined]
    assert cache.leases() == []
    it = iter(stream)
    next(it)
    assert len(cache.leases()) == 1
    del it
    gc.collect()
    assert cache.leases() == []
    # Workers that stop early (the loop broke off) release the lease as they exit.
    loader = DataLoader(stream, batch_size=4, num_workers=2, prefetch_factor=1)
    batches = iter(loader)
    next(batches)
    assert len(cache.leases()) == 1
    del batches
    gc.collect()
    deadline = time.monotonic() + 10
    while cache.leases() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.leases() == []
    # A stream collected while it holds a prepared epoch drops its lease and document.
    stream.set_epoch(3)
    assert len(cache.leases()) == 1 and cache.tables.states("stream/")
    del stream, loader
    gc.collect()
    assert cache.leases() == [] and cache.tables.states("stream/") == {}


def test_persistent_workers_advance_one_epoch_per_iteration(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 50)
    cache = Cache(tmp_path / "c", sync=False)
    stream = cache.stream()
    loader = DataLoader(stream, batch_size=5, num_workers=2, persistent_workers=True)
    for epoch in range(3):
        ids = [i for batch in loader for i in _ids(batch)]
        assert sorted(ids) == list(range(50)) + list(range(100, 100 + 5 * epoch)), epoch
        fill(str(tmp_path / "c"), 100 + 5 * epoch, 5)
    assert cache.tables.states("stream/")[f"stream/{stream.stream_id}"]["epoch"] == 2
    del loader
    stream.close()
    assert cache.leases() == []


def test_samples_per_epoch_resamples_a_small_cache(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 30)
    cache = Cache(tmp_path / "c", sync=False)
    ids = [i for batch in DataLoader(cache.stream(samples_per_epoch=70), batch_size=10)
           for i in _ids(batch)]
    assert len(ids) == 70 and set(ids) == set(range(30))
    assert max(np.bincount(ids)) - min(np.bincount(ids)) <= 1


def test_fields_make_tuples_that_the_default_collate_batches(tmp_path: Path) -> None:
    from common.writer import npy_bytes

    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([(f"shard/{i:04d}", {"npy": npy_bytes(np.full(3, i, dtype=np.int16)),
                                         "cls": str(i % 7).encode()}) for i in range(40)])
    stream = cache.stream(fields=("npy", "cls"), seed=1)
    got = []
    for arrays, labels in DataLoader(stream, batch_size=8, num_workers=2):
        assert arrays.shape[1:] == (3,)
        got.extend(zip(arrays[:, 0].tolist(), labels.tolist()))
    assert sorted(got) == [(i, i % 7) for i in range(40)]


def test_options_are_checked_and_the_stream_pickles(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 10)
    cache = Cache(tmp_path / "c", sync=False)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        cache.stream(samples_per_epoch=0)
    with pytest.raises(ValueError, match="on_error"):
        cache.stream(on_error="ignore")
    with pytest.raises(ValueError, match="fields"):
        cache.stream(fields=())
    with pytest.raises(ValueError, match="set_epoch"):
        cache.stream().set_epoch(-1)
    with pytest.raises(TypeError):
        cache.stream(batch_size=4)  # a DataLoader argument, not the stream's
    stream = cache.stream(seed=2)
    stream.set_epoch(1)
    copy = pickle.loads(pickle.dumps(stream))  # what spawn sends a worker: no lease, no handle
    assert "CacheStream(" in repr(copy) and copy.seed == 2
    assert sorted(int(a[0]) for a in copy) == list(range(10))  # a stream of its own
    assert copy.stream_id != stream.stream_id and copy.epoch == 2  # continues the count
    stream.close()
    copy.close()
    assert cache.leases() == []


def _hold_with_workers(path: str, ready: Any) -> None:
    """A trainer whose workers took the epoch's lease (no set_epoch), stopped mid-epoch."""
    import os

    from epochcache import Cache as _Cache

    os.setpgrp()  # its forked workers join its process group: killed with it, at once

    # A long heartbeat timeout: only the owner lock can tell the lease's owner died.
    stream = _Cache(path, sync=False, lease_timeout_s=600).stream()
    batches = iter(DataLoader(stream, batch_size=4, num_workers=2, prefetch_factor=1))
    next(batches)
    ready.set()
    time.sleep(600)


def test_a_lease_taken_by_workers_lives_with_the_trainer_and_dies_with_it(tmp_path: Path) -> None:
    import multiprocessing as mp

    path = str(tmp_path / "c")
    fill(path, 0, 200)
    cache = Cache(path, sync=False)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    trainer = ctx.Process(target=_hold_with_workers, args=(path, ready))
    trainer.start()
    try:
        assert ready.wait(60)
        (lease,) = cache.leases()
        assert lease.pid == trainer.pid and lease.owner  # the trainer's name and owner lock
        assert lease.timeout_s == 600
        assert reclaim_leases(cache) == []  # alive: the trainer holds the lock
    finally:
        kill_job(trainer.pid)  # trainer and workers at once: no cleanup runs
        trainer.join(30)
    deadline = time.monotonic() + 20  # the kernel drops the trainer's owner lock
    while cache.leases() and time.monotonic() < deadline:
        reclaim_leases(cache)
        time.sleep(0.1)
    assert cache.leases() == []
