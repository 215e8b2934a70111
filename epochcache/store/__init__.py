"""The store layer: everything that touches LMDB.

A cache directory is one LMDB environment (``env``) holding the samples by insertion sequence
(``records``), their counters, the snapshot leases, eviction by age, and side tables
(quarantine, state documents, stats history). `SampleStore` puts it together; ``verify``
reads it here, the face's ``status`` from above. This layer imports nothing from ``ingest``, ``data`` or the face, and
never torch: sampler processes use it as it is.
"""

from __future__ import annotations

from .sample_store import SampleStore
from .snapshot import Snapshot
from .writer import PutResult

__all__ = ["PutResult", "SampleStore", "Snapshot"]

