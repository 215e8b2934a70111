"""Fork-started DataLoader workers at volume: tens of thousands of reads leave LMDB's reader table
as they found it.

LMDB forbids using an environment across fork(), and py-lmdb never frees a read transaction that
a forked child begins on an inherited environment: each read keeps one of the table's 1024
reader slots, registered under the parent's pid, for as long as the parent lives. Once the table
is full, no process can read the cache (issue 20, item 1). Each process must use its own
environment; these tests read 25,000 samples through fork-started workers in the three ways
users do, then check the reader table and read the cache from a new process.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from epochcache import Cache

SAMPLES = 2_500
EPOCHS = 10  # 25,000 samples read in all (the old leak filled the table after ~3,000)
BATCH = 16
#: Slots a process may use at once: one per thread with a read open, a few threads at most.
MAX_SLOTS = 32


def _npy(i: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.full(4, i, dtype=np.float32))
    return buf.getvalue()


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Cache]:
    cache = Cache(tmp_path / "cache", "64MiB", sync=False)
    cache.put_many([(f"s{i:05d}.npy", _npy(i)) for i in range(SAMPLES)])
    yield cache
    cache.close()


def _slots_in_use(path: str) -> tuple[int, int]:
    """``(slots occupied now, the most ever occupied)`` of the cache's reader table, read by a
    new process (as `status` or a sampler would open it)."""
    code = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=16, max_readers=1024)\n"
        "rows = [l for l in env.readers().splitlines()[1:] if l.strip()]\n"
        "print(len(rows), env.info()['num_readers'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return int(out[0]), int(out[1])


def _read_all_from_another_process(path: str) -> int:
    code = (
        "import sys, epochcache as ec\n"
        "cache = ec.Cache(sys.argv[1], readonly=True)\n"
        f"print(sum(v is not None for v in cache.get_many(list(range({SAMPLES})))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def _check_table(cache: Cache, read: int) -> None:
    assert read == SAMPLES * EPOCHS
    now, most = _slots_in_use(cache.path)
    assert now <= MAX_SLOTS, f"{now} reader slots still occupied after {read} reads"
    assert most <= MAX_SLOTS, f"{most} reader slots were used at once (leaked by forked readers)"
    # The trainer itself, and any other process, can still read everything.
    assert cache.get_many(list(range(10))) is not None
    assert _read_all_from_another_process(cache.path) == SAMPLES


def _count(batch: object) -> int:
    assert isinstance(batch, torch.Tensor), type(batch)
    return int(batch.shape[0])


def test_dataset_per_epoch_through_forked_workers(cache: Cache) -> None:
    read = 0
    for epoch in range(EPOCHS):
        with cache.dataset(epoch=epoch) as ds:
            loader = DataLoader(ds, batch_size=BATCH, num_workers=2, shuffle=True,
                                multiprocessing_context="fork")
            read += sum(_count(batch) for batch in loader)
    _check_table(cache, read)


def test_one_stream_across_epochs_through_forked_workers(cache: Cache) -> None:
    read = 0
    with cache.stream(seed=0) as stream:
        loader = DataLoader(stream, batch_size=BATCH, num_workers=2,
                            multiprocessing_context="fork")
        for epoch in range(EPOCHS):
            stream.set_epoch(epoch)
            read += sum(_count(batch) for batch in loader)
    _check_table(cache, read)


def test_epochs_with_fork_context(cache: Cache) -> None:
    read = 0
    for _epoch, loader in cache.epochs(EPOCHS, batch_size=BATCH, num_workers=2, seed=0,
                                       multiprocessing_context="fork"):
        read += sum(_count(batch) for batch in loader)
    _check_table(cache, read)


def test_reader_slots_of_a_forked_child_are_its_own(cache: Cache) -> None:
    """A child that inherited an open cache (not pickled: the same object) reads through an
    environment of its own: its reads free their slots, and the parent's cache still reads."""
    import multiprocessing as mp

    before = cache.get_many([0, 1, 2])
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_read_many_times, args=(cache, 3_000, queue))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert queue.get() == 3_000
    now, most = _slots_in_use(cache.path)
    assert (now, most) <= (MAX_SLOTS, MAX_SLOTS), (now, most)
    assert cache.get_many([0, 1, 2]) == before


def _read_many_times(cache: Cache, times: int, queue: object) -> None:
    try:
        ok = sum(cache.get(i % SAMPLES) is not None for i in range(times))
    except Exception as exc:
        ok = repr(exc)  # type: ignore[assignment]
    queue.put(ok)  # type: ignore[attr-defined]
