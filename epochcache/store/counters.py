"""Counters in the ``meta`` sub-database, changed in the same transaction as the data.

Because a counter and the records it counts commit together, they never drift: ``verify``
recomputes them from the records and any difference is a bug, not a crash artefact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import lmdb

from .records import (
    C_BYTES,
    C_EVICTED,
    C_EVICTED_BYTES,
    C_INSERTED,
    C_NEXT_SEQ,
    C_QUARANTINED,
    C_SAMPLES,
    pack_u64,
    unpack_u64,
)
from .source_counters import SourceCounters

#: Field name -> key in ``meta``.
_KEYS = {
    "samples": C_SAMPLES,
    "bytes": C_BYTES,
    "next_seq": C_NEXT_SEQ,
    "evicted": C_EVICTED,
    "evicted_bytes": C_EVICTED_BYTES,
    "inserted": C_INSERTED,
    "quarantined": C_QUARANTINED,
}


@dataclass
class Counters:
    """A transaction's working copy of the counters; `save` writes all of them back."""

    samples: int = 0
    bytes: int = 0
    next_seq: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    inserted: int = 0
    quarantined: int = 0
    #: The per-source counters (None: no source registered), saved with these.
    sources: SourceCounters | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, txn: lmdb.Transaction, db: lmdb._Database) -> Counters:
        counters = cls()
        for name, key in _KEYS.items():
            setattr(counters, name, unpack_u64(txn.get(key, db=db)))
        counters.sources = SourceCounters.load(txn, db)
        return counters

    def save(self, txn: lmdb.Transaction, db: lmdb._Database) -> None:
        for name, key in _KEYS.items():
            txn.put(key, pack_u64(getattr(self, name)), db=db)
        if self.sources is not None:
            self.sources.save(txn)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _KEYS}
