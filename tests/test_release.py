"""Progressive release in the store: a sample its plan lease has released is evicted once no
other lease protects it, whatever kind of lease that other one is and whenever it ends.

Found by tests/test_eviction_props.py's state machine (CI, 2026-11-24): a released sample that
eviction found inside a plain snapshot's range was set aside until "a lease ends", but only
the end of another *plan* lease brought it back, so after the plain snapshot ended it stayed
protected for as long as its own plan lease lived and writers waited at a full cache.

Internals: release plans (``reads.write_part``) are what loaders write, here written by
hand.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from common.procs import spawn_script
from common.writer import npy_bytes, sample_array

from epochcache import Cache, CacheFull
from epochcache.store.reads import Releaser, write_part


def _put(cache: Cache, start: int, count: int) -> None:
    cache.put_many([(f"s/{i:07d}.npy", npy_bytes(sample_array(i))) for i in range(start,
                                                                                 start + count)],
                   wait=False)


def _planned(cache: Cache) -> tuple[object, Releaser]:
    snap = cache.snapshot(plan_parts=1)
    lane = np.asarray(snap.seqs, dtype=np.uint64)
    write_part(cache.path, snap.lease_id, 0, [lane])
    return snap, Releaser(cache.path, snap.lease_id, 0, 0)


@pytest.mark.parametrize("evict_before_plain", [True, False])
def test_a_released_sample_goes_once_the_plain_snapshot_over_it_ends(
        tmp_path: Path, evict_before_plain: bool) -> None:
    cache = Cache(str(tmp_path / "c"), 40_000, headroom=0.0, sync=False)
    _put(cache, 0, 10)
    planned, reader = _planned(cache)
    if evict_before_plain:
        assert cache.evict(0).count == 0  # the plan is loaded; nothing read yet
    plain = cache.snapshot()
    reader.release(10)  # the plan lease's reader read everything
    assert cache.evict(0).count == 0  # the plain snapshot still protects all ten
    plain.release()
    eviction = cache.evict(0)  # only the plan lease is left, and it has released them all
    assert eviction.count == 10, eviction
    assert cache.counters().samples == 0
    planned.release()  # type: ignore[attr-defined]


def test_a_writer_at_a_full_cache_goes_on_once_the_plain_snapshot_ends(tmp_path: Path) -> None:
    cache = Cache(str(tmp_path / "c"), 40_000, headroom=0.0, sync=False)
    for start in range(0, 200, 10):  # full (~100 samples of ~380 B), and evicting
        _put(cache, start, 10)
    planned, reader = _planned(cache)
    plain = cache.snapshot()
    reader.release(len(planned.seqs))  # type: ignore[attr-defined]
    with pytest.raises(CacheFull):
        _put(cache, 1000, 10)
    plain.release()
    _put(cache, 2000, 10)  # room made by evicting what the plan lease released
    assert cache.counters().bytes <= cache.capacity_bytes
    planned.release()  # type: ignore[attr-defined]


def test_a_batch_larger_than_the_cache_names_what_is_wrong(tmp_path: Path) -> None:
    """No lease is in the way: the message said "held by lease 00000000 ((none: disk
    limit)) of pid 0"."""
    cache = Cache(str(tmp_path / "c"), 40_000, headroom=0.0, sync=False)
    with pytest.raises(CacheFull, match="larger than capacity \\+ headroom") as full:
        _put(cache, 0, 200)  # ~76 KB in one batch
    assert "lease" not in str(full.value)
    assert 0 < full.value.result.inserted < 200  # type: ignore[attr-defined]


WRITER = """
import sys
from common.writer import npy_bytes, sample_array
from epochcache import Cache

cache = Cache(sys.argv[1], "256MiB", sync=False)  # far below capacity: it never evicts
print("READY", flush=True)
for line in sys.stdin:
    start = int(line)
    cache.put_many([(f"w/{i:07d}.npy", npy_bytes(sample_array(i))) for i in range(start,
                                                                                start + 10)])
    print("PUT", start, flush=True)
"""


def _deleted_plan_files(pid: int) -> list[str]:
    """The writer's descriptors and mappings of plan files that were deleted."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if "/plans/" in target and target.endswith("(deleted)"):
            held.append(f"fd {fd}: {target}")
    with open(f"/proc/{pid}/maps") as maps:
        held += [f"map {line.split()[-2]}" for line in maps
                 if "/plans/" in line and line.rstrip().endswith("(deleted)")]
    return held


def test_a_writer_that_never_evicts_drops_the_plans_of_ended_leases(tmp_path: Path) -> None:
    """A sampler below capacity loaded each epoch's release plan (to be ready to evict) and
    never let go of it: 74 descriptors on deleted plan files after 60 epochs, about 25 MiB
    of memory per epoch of a million samples."""
    path = str(tmp_path / "c")
    cache = Cache(path, "256MiB", sync=False)
    _put(cache, 0, 50)
    writer = spawn_script(tmp_path, "writer", WRITER, path)
    try:
        writer.wait_line("READY")
        for epoch in range(60):
            snap, reader = _planned(cache)  # an epoch with progressive release ...
            writer.send(str(1000 * epoch))  # ... while the writer commits
            writer.wait_line(f"PUT {1000 * epoch}")
            reader.release(len(snap.seqs) // 2)  # type: ignore[attr-defined]
            snap.release()  # type: ignore[attr-defined]  # the epoch ends: its plan is deleted
        writer.send("999999")
        writer.wait_line("PUT 999999")
        held = _deleted_plan_files(writer.pid)
        assert held == [], f"{len(held)} held after 60 epochs: {held[:6]}"
    finally:
        writer.close()
        cache.close()
