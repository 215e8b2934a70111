"""Lease liveness across PID namespaces and hostnames, long epochs, and reclaimed leases.

A lease protects an epoch's snapshot from eviction while its owner lives. Owners here are real
processes in other PID or UTS namespaces (``unshare``, as containers sharing the cache's volume on
one machine are), judged by a shortened lease timeout of 1 s, while this process writes past
capacity + headroom and reclaims leases it takes for dead.

Internals: leases are written and reclaimed as other hosts' processes would (``cache.env``,
``plumbing.reclaim_leases``).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.cachecheck import content_for
from common.procs import Proc, spawn_script

from epochcache import Cache
from epochcache.errors import CacheFull, SnapshotClosed
from epochcache.store.leases import Lease
from epochcache.store.plumbing import reclaim_leases

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs unshare and root for PID/UTS namespaces")

PID_NS = ("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")
OTHER_HOST = ("unshare", "--uts", "--fork", "--kill-child", "sh", "-c",
              'hostname epochcache-other-host && exec "$0" "$@"')

OWNER = """
import sys, time
from epochcache import Cache
cache = Cache(sys.argv[1], lease_timeout_s=1.0)
snap = cache.snapshot(epoch=3)
print("SNAP", snap.lease_id, flush=True)
sys.stdin.readline()  # an epoch: until told to read its samples
missing = []
for seq in snap.seqs:
    try:
        cache.get(int(seq))
    except KeyError:
        missing.append(int(seq))
print("READ", len(snap.seqs), len(missing), flush=True)
sys.stdin.readline()
"""


def _fill(cache: Cache, prefix: str, count: int) -> None:
    cache.put_many([(f"{prefix}{i}", content_for(f"{prefix}{i}", 2000, compressible=False))
                    for i in range(count)])


def _owner(tmp_path: Path, path: str, prefix: tuple[str, ...]) -> tuple[Proc, str]:
    owner = spawn_script(tmp_path, "owner", OWNER, path, prefix=prefix)
    return owner, owner.wait_line("SNAP", 60).split()[1]


def _churn(cache: Cache, seconds: float) -> int:
    """Write past capacity + headroom and reclaim dead leases for ``seconds``; count the writes
    refused because a lease pins the oldest samples (back-pressure)."""
    deadline, i, blocked = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline:
        try:
            cache.put(f"new{i}", content_for(f"new{i}", 2000, compressible=False), wait=False)
        except CacheFull:
            blocked += 1
            time.sleep(0.05)
        reclaim_leases(cache)
        i += 1
    return blocked


def _reclaimed_soon(cache: Cache, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        dead = [lease.lease_id for lease in reclaim_leases(cache)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)


@pytest.mark.parametrize("where", ["pid namespace", "other hostname"])
def test_a_live_owner_elsewhere_keeps_its_lease_for_a_long_epoch(tmp_path: Path,
                                                                   where: str) -> None:
    """Before: in another PID namespace the owner's pid means nothing here (its lease was taken
    for dead at once); under another hostname it was judged by a heartbeat nothing refreshed
    (gone after the timeout)."""
    path = str(tmp_path / "cache")
    cache = Cache(path, 40_000, lease_timeout_s=1.0, sync=False)
    _fill(cache, "old", 18)
    owner, lease_id = _owner(tmp_path, path, PID_NS if where == "pid namespace" else OTHER_HOST)
    try:
        [lease] = cache.leases()
        if where == "pid namespace":
            assert lease.pid == 1  # its own namespace's pid, meaningless here
        else:
            assert lease.host == "epochcache-other-host"
        # An epoch 5x the lease timeout (a 50-minute epoch with the default 600 s), while
        # writers wait on the lease and reclaim what they take for dead.
        assert _churn(cache, 5.0) > 0
        assert lease_id in {lease.lease_id for lease in cache.leases()}
        owner.send("read")
        assert owner.wait_line("READ", 30).split()[1:] == ["18", "0"]  # all there
        # Once the owner is gone, its lease is reclaimed at once. (SIGKILL reaches the owner
        # itself, unshare's child, a moment after unshare: its lock goes when it is gone.)
        owner.kill9()
        assert _reclaimed_soon(cache) == [lease_id]
    finally:
        owner.close()
        cache.close()


def _signal_tree(pid: int, sig: int) -> None:
    os.kill(pid, sig)
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        os.kill(int(child), sig)


def _freeze_outside_a_commit(pid: int, cache: Cache) -> None:
    """SIGSTOP the owner (and unshare's child), but not in the middle of a commit: a process
    frozen holding LMDB's write lock would block every writer, this test's too. So stop it,
    try a write, and if that waits, let the owner finish its commit and stop it again."""
    for _attempt in range(50):
        _signal_tree(pid, signal.SIGSTOP)
        writer = threading.Thread(target=cache.env.write, args=(lambda txn: None,))
        writer.start()
        writer.join(2.0)
        if not writer.is_alive():
            return
        _signal_tree(pid, signal.SIGCONT)
        writer.join(30)
    raise AssertionError("could not freeze the owner outside a commit")


def test_without_owner_locks_a_heartbeat_keeps_the_lease(tmp_path: Path) -> None:
    """Where the owner lock cannot serve (here: the cache's owners directory is unusable), the
    owner's heartbeat thread refreshes its lease while the snapshot is open."""
    path = str(tmp_path / "cache")
    cache = Cache(path, 40_000, lease_timeout_s=1.0, sync=False)
    _fill(cache, "old", 18)
    (tmp_path / "cache" / "owners").write_text("not a directory")
    owner, lease_id = _owner(tmp_path, path, OTHER_HOST)
    try:
        assert _churn(cache, 5.0) > 0
        assert lease_id in {lease.lease_id for lease in cache.leases()}
        owner.send("read")
        assert owner.wait_line("READ", 30).split()[1:] == ["18", "0"]
        # A frozen owner (no heartbeat) loses its lease after the timeout.
        _freeze_outside_a_commit(owner.pid, cache)
        time.sleep(1.5)
        assert [dead.lease_id for dead in reclaim_leases(cache)] == [lease_id]
    finally:
        owner.close()
        cache.close()


def test_reads_of_a_reclaimed_snapshot_raise_snapshot_closed_naming_the_lease(
        tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    cache = Cache(path, 40_000, sync=False)
    _fill(cache, "old", 18)
    ds = cache.dataset(epoch=4)
    lease_id = ds.snapshot.lease_id
    # Another process judged the owner dead and reclaimed its lease; writers evicted since.
    other = Cache(path, sync=False)
    from epochcache.store.leases import delete_lease
    from epochcache.store.records import DB_LEASES

    other.env.write(lambda txn: delete_lease(txn, other.env.dbs[DB_LEASES], lease_id))
    _fill(other, "new", 25)
    with pytest.raises(SnapshotClosed, match=lease_id[:8]) as info:
        for i in range(len(ds)):
            ds[i]
    assert "epoch 4" in str(info.value) and "reclaimed" in str(info.value)
    with pytest.raises(SnapshotClosed, match=lease_id[:8]):
        ds.get_batch(np.arange(len(ds)))
    ds.close()
    other.close()
    cache.close()


@pytest.mark.parametrize(("workers", "collate_fn"), [(0, list), (0, None), (1, list)])
def test_an_epoch_whose_lease_was_reclaimed_raises_snapshot_closed(
        tmp_path: Path, workers: int, collate_fn: Any) -> None:
    """The same through epochs(), in process (batches the user collates, and the reader's own)
    and in a DataLoader worker."""
    path = str(tmp_path / "cache")
    cache = Cache(path, 40_000, sync=False)
    _fill(cache, "old", 18)
    other = Cache(path, sync=False)
    from epochcache.store.leases import delete_lease
    from epochcache.store.records import DB_LEASES

    with pytest.raises(SnapshotClosed, match="epoch 0 lost its lease") as info:
        for _epoch, loader in cache.epochs(1, batch_size=1, num_workers=workers,
                                           collate_fn=collate_fn, stall_s=None):
            lease_id = loader.dataset.lease_id
            for i, _batch in enumerate(loader):
                if i == 0:
                    other.env.write(lambda txn: delete_lease(
                        txn, other.env.dbs[DB_LEASES], lease_id))  # noqa: B023 - at once
                    _fill(other, "new", 25)
    assert lease_id[:8] in str(info.value)
    other.close()
    cache.close()


def test_lease_records_of_other_versions_are_read(tmp_path: Path) -> None:
    """Unknown keys (a newer version's) are ignored; missing ones (an older version's) default."""
    import json

    lease = Lease.new(0, 10, 10, label="x")
    doc = json.loads(lease.to_bytes())
    newer = Lease.from_bytes(json.dumps({**doc, "from_the_future": [1, 2]}).encode())
    assert newer.lease_id == lease.lease_id
    older = {k: v for k, v in doc.items() if k not in ("owner", "timeout_s")}
    assert Lease.from_bytes(json.dumps(older).encode()).owner == ""
