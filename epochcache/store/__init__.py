"""The store layer: everything that touches LMDB.

A cache directory is one LMDB environment (``env``) holding the samples by insertion sequence
(``schema``, ``codec``), their counters, the snapshot leases, eviction by age, and side tables
(quarantine, state documents, stats history). :class:`SampleStore` puts it together; ``verify``
and ``status`` read it. This layer imports nothing from ``ingest``, ``data`` or the face, and
never torch: sampler processes use it as it is.
"""

from __future__ import annotations

from .cache import SampleStore
from .snapshot import Snapshot
from .writer import PutResult

__all__ = ["PutResult", "SampleStore", "Snapshot"]
