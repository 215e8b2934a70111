"""Progressive release in the store: a sample its plan lease has released is evicted once no
other lease protects it, whatever kind of lease that other one is and whenever it ends.

Found by tests/test_eviction_props.py's state machine (CI, 2026-11-24): a released sample that
eviction found inside a plain snapshot's range was set aside until "a lease ends", but only
the end of another *plan* lease brought it back, so after the plain snapshot ended it stayed
protected for as long as its own plan lease lived and writers waited at a full cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.writer import npy_bytes, sample_array
from epochcache import Cache, CacheFull
from epochcache.store.plans import Releaser


def _put(cache: Cache, start: int, count: int) -> None:
    cache.put_many([(f"s/{i:07d}.npy", npy_bytes(sample_array(i))) for i in range(start,
                                                                                 start + count)],
                   wait=False)


def _planned(cache: Cache) -> tuple[object, Releaser]:
    snap = cache.snapshot(plan_parts=1)
    lane = np.asarray(snap.seqs, dtype=np.uint64)
    cache.write_plan_part(snap.lease_id, 0, [lane])
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
