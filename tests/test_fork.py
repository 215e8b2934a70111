"""A Cache opened and used in the parent works in forked children, and the parent keeps
working afterwards. LMDB is fork-hostile: a child must neither use nor close the inherited environment (closing
would clear the parent's reader slots), so the child leaves it alone and opens its own
(``epochcache.store.env._after_fork_in_child``; tests/test_fork_volume.py reads at volume).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.cachecheck import assert_consistent, content_for, digest

from epochcache import Cache

N = 120




@pytest.fixture
def used_cache(tmp_path: Path) -> Iterator[tuple[Cache, list[int]]]:
    """A cache opened in this process, written and read, with a snapshot held."""
    cache = Cache(tmp_path / "cache", "4MiB", sync=False)
    seqs = cache.put_many([(f"k{i}", content_for(f"k{i}")) for i in range(N)]).seqs
    assert cache.get(seqs[0]) == content_for("k0")
    yield cache, seqs
    cache.close()


def _child(cache: Cache, seqs: list[int], index: int, queue: Any) -> None:
    try:
        values = cache.get_many(seqs)
        digests = [digest(v) for v in values]
        written = None
        if index == 0:  # one child also writes
            items = [(f"child{i}", content_for(f"child{i}")) for i in range(10)]
            written = cache.put_many(items).seqs
        with cache.snapshot() as snap:
            snap_len = len(snap)
        queue.put((index, os.getpid(), digests, written, snap_len, None))
    except BaseException as exc:  # report, do not hang the parent
        queue.put((index, os.getpid(), None, None, None, repr(exc)))


def test_multiprocessing_fork_children_read_and_write(used_cache: tuple[Cache, list[int]]) -> None:
    cache, seqs = used_cache
    snap = cache.snapshot(epoch=1)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    parts = [seqs[i::3] for i in range(3)]
    procs = [
        ctx.Process(target=_child, args=(cache, part, i, queue)) for i, part in enumerate(parts)
    ]
    results = {}
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            index, pid, digests, written, snap_len, error = queue.get(timeout=60)
            assert error is None, f"child {index}: {error}"
            results[index] = (pid, digests, written, snap_len)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        queue.close()
        queue.join_thread()
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    for index, part in enumerate(parts):
        pid, digests, _, snap_len = results[index]
        assert pid != os.getpid()
        assert digests == [digest(content_for(f"k{seq}")) for seq in part]
        assert snap_len >= N
    # The child's write is visible here; the parent's lease survived the children's exits.
    written = results[0][2]
    assert written == list(range(N, N + 10))
    assert cache.get(N) == content_for("child0")
    assert snap.lease_id in {lease.lease_id for lease in cache.leases()}
    assert len(cache.leases()) == 1  # the children released theirs
    # And the parent goes on reading and writing.
    cache.put_many([(f"after{i}", content_for(f"after{i}")) for i in range(5)])
    assert cache.get_many(snap.seqs[:5]) == [content_for(f"k{i}") for i in range(5)]
    snap.release()
    state = assert_consistent(cache)
    assert len(state.seqs) == N + 15


class _CacheDataset:
    """A tiny map-style Dataset reading through a Cache inherited by fork."""

    def __init__(self, cache: Cache, seqs: np.ndarray) -> None:
        self.cache = cache
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[int, str, int]:
        seq = int(self.seqs[i])
        return seq, digest(self.cache.get(seq)), os.getpid()


def test_torch_dataloader_workers_read_through_the_parents_cache(
    used_cache: tuple[Cache, list[int]],
) -> None:
    torch_data = pytest.importorskip("torch.utils.data")
    cache, _ = used_cache
    with cache.snapshot(epoch=0) as snap:
        dataset = _CacheDataset(cache, snap.seqs)
        for _epoch in range(2):  # workers are forked again for each epoch
            loader = torch_data.DataLoader(
                dataset, batch_size=8, num_workers=2, multiprocessing_context="fork", shuffle=True
            )
            seen, pids = _run_loader(loader)
            assert sorted(seen) == list(range(N))
            assert all(seen[seq] == digest(content_for(f"k{seq}")) for seq in seen)
            assert os.getpid() not in pids and len(pids) == 2
        # The parent reads and writes as before.
        assert cache.get(3) == content_for("k3")
        cache.put("after", b"after fork")
    assert_consistent(cache)
    assert cache.leases() == []


def _run_loader(loader: Any) -> tuple[dict[int, str], set[int]]:
    """Iterate a DataLoader; a worker failure is re-raised without the iterator's frames, so
    its worker processes shut down at once instead of at interpreter exit."""
    seen: dict[int, str] = {}
    pids: set[int] = set()
    error = None
    try:
        for seq_batch, digest_batch, pid_batch in loader:
            for seq, dig in zip(seq_batch.tolist(), digest_batch):
                seen[seq] = dig
            pids.update(pid_batch.tolist())
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        raise AssertionError(f"DataLoader failed: {error}")
    return seen, pids


def test_spawned_children_get_the_cache_by_pickling(used_cache: tuple[Cache, list[int]]) -> None:
    """With 'spawn' (the samplers' start method) a Cache pickles as its path and reopens."""
    cache, seqs = used_cache
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(cache, seqs[:20], 0, queue))
    proc.start()
    index, pid, digests, written, snap_len, error = queue.get(timeout=60)
    proc.join(30)
    assert error is None, error
    assert proc.exitcode == 0 and pid != os.getpid()
    assert digests == [digest(content_for(f"k{seq}")) for seq in seqs[:20]]
    assert written == list(range(N, N + 10)) and snap_len == N + 10
    assert cache.get(N + 9) == content_for("child9")
    assert cache.leases() == []
    assert_consistent(cache)


def test_forked_child_keeps_the_parents_reader_slots(tmp_path: Path) -> None:
    """A child that uses (then drops) the inherited cache must not clear the parent's reader
    slots: a read transaction open in the parent at fork time stays registered, so its pages
    stay protected from reuse by writers."""
    cache = Cache(tmp_path / "cache", "4MiB")
    cache.put("a", b"x" * 1000)
    env = cache.env.lmdb_env
    held = env.begin()
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = cache.get(cache.seq_of("a")) == b"x" * 1000
            cache.put("b", b"y" * 1000)
            cache.close()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        active = [line.split() for line in env.readers().splitlines()[1:]]
        assert any(row[0] == str(os.getpid()) and row[-1] != "-" for row in active), env.readers()
        assert cache.get(cache.seq_of("b")) == b"y" * 1000
    finally:
        held.abort()
        cache.close()
