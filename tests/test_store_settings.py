"""A store's settings hold where it goes: what ``sync`` asks of LMDB, and every constructor
setting of a store pickled into another process (issue 20, items 6 and 7).

Internals: what ``sync`` asks of LMDB is read from the environment (``cache.env``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from epochcache import Cache, CacheError


@pytest.mark.parametrize("sync", [True, False])
def test_sync_flushes_the_meta_page_too(tmp_path: Path, sync: bool) -> None:
    """``sync: true`` promises that a returned commit survives power loss: LMDB keeps that
    promise only with the meta page flushed as well (without MDB_NOMETASYNC a system crash may
    undo the last commit, lmdb.h)."""
    cache = Cache(tmp_path / "c", "8MiB", sync=sync)
    try:
        flags = cache.env.lmdb_env.flags()
        assert (flags["sync"], flags["metasync"]) == (sync, sync)
    finally:
        cache.close()


def test_a_pickled_store_keeps_every_setting(tmp_path: Path) -> None:
    path = tmp_path / "c"
    Cache(path, "8MiB").close()
    cache = Cache(path, readonly=True, sync=False, lease_timeout_s=42.0, compression="none",
                  level=7, max_map_size="64MiB")
    copy = pickle.loads(pickle.dumps(cache))
    try:
        assert copy.path == cache.path
        assert copy.env.readonly and copy.env.sync is False
        assert copy.lease_timeout_s == 42.0
        assert (copy.compress, copy.level) == (False, 7)
        assert copy.env.max_map_size == cache.env.max_map_size
        assert copy.capacity_bytes == cache.capacity_bytes
        with pytest.raises(CacheError, match="read-only"):
            copy.put_many([("k", b"v")])  # a read-only cache stays read-only in the copy
    finally:
        copy.close()
        cache.close()
