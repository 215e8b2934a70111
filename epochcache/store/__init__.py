"""The store layer: everything that touches LMDB.

A cache directory is one LMDB environment (``env``) holding the samples by insertion sequence
(``records``, ``codec``), their counters, the snapshot leases, eviction by age, and side tables
(quarantine, state documents, stats history). `SampleStore` puts it together; ``verify``
reads it here, the face's ``status`` from above. This layer imports nothing from ``ingest``, ``data`` or the face, and
never torch: sampler processes use it as it is.
"""

from __future__ import annotations

from .sample_store import SampleStore
from .snapshot import Snapshot
from .writer import PutResult

__all__ = ["PutResult", "SampleStore", "Snapshot", "store_of"]


def store_of(cache: object) -> SampleStore:
    """The `SampleStore` of a cache: an [`epochcache.Cache`][epochcache.Cache] holds one (the public
    surface stops at the Cache; the library's layers, tools and tests work on its store), and a
    store is its own.

    Raises:
        TypeError: ``cache`` is neither.
    """
    if isinstance(cache, SampleStore):
        return cache
    store = getattr(cache, "_store", None)
    if isinstance(store, SampleStore):
        return store
    raise TypeError(f"expected an epochcache.Cache, got {type(cache).__name__}")
