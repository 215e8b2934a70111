"""The read log: which samples training read, and when, for eviction policies that order by
reads (`epochcache.store.eviction.EvictionPolicy.uses_reads`).

Nothing is written on the read path. Readers already publish how far they read in their
epoch's release plan (`epochcache.store.plans`: one 8-byte store per batch); when the lease
ends (released at its epoch's end, left unfinished, or reclaimed from a dead owner), the
process that deletes it records, in the same write transaction, the samples its readers read:
the union of its lanes' read prefixes, once per epoch, O(snapshot) in numpy. A lease without a
plan (``cache.dataset()``, ``epochs(release="epoch")``) records nothing: its reads are not
known. Each recording is a *generation* (1, 2, ...); ``meta`` counts them
(``C_READ_GENERATION``), so a policy loads the log again only when it changed.

The log is one file beside the LMDB environment, ``reads.npz``, rewritten whole (renamed into
place, so a reader sees the old file or the new one) and kept by every process that ends a
lease: it survives any restart. It holds

* ``seqs``: the samples recorded as read that may still be cached, sorted;
* ``stamps``: for each, the generation of its newest read;
* ``bounds``: for each generation ``g`` (from 1), the cache's ``next_seq`` when it was
  recorded: a sample never read was inserted between two recordings, which orders it among
  those read.

Size: 12 bytes per sample recorded and still cached, 8 per generation. Samples that left the
cache are dropped when the log is rewritten: those older than the oldest cached sample every
time, the others once they make up half the log (one walk over the cached keys, so the work is
proportional to what was dropped). The log is written only while the cache's policy uses it,
and removed when the cache's policy changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zipfile
from dataclasses import dataclass

import lmdb
import numpy as np

from ..limits import AST_LOCK
from ..paths import atomic_write
from ..registry import EVICTION
from .plans import Part, plans_dir
from .records import (
    C_NEXT_SEQ,
    C_READ_GENERATION,
    DB_META,
    DB_SAMPLES,
    M_EVICTION,
    pack_u64,
    seq_of,
    unpack_u64,
)

log = logging.getLogger("epochcache.cache")

READS_FILE = "reads.npz"


@dataclass
class ReadLog:
    """The read log as loaded (see the module docstring); empty when nothing was recorded.

    Args:
        seqs: samples recorded as read, sorted.
        stamps: the generation of each one's newest read.
        bounds: ``next_seq`` at each generation (index ``g - 1``).
        generation: the generation count it was loaded at.
    """

    seqs: np.ndarray
    stamps: np.ndarray
    bounds: np.ndarray
    generation: int = 0

    @classmethod
    def empty(cls, generation: int = 0) -> ReadLog:
        return cls(np.empty(0, np.uint64), np.empty(0, np.uint32), np.empty(0, np.uint64),
                   generation)


def reads_path(cache_path: str) -> str:
    return os.path.join(cache_path, READS_FILE)


def read_generation(txn: lmdb.Transaction, meta: lmdb._Database) -> int:
    """The count of recordings so far, as ``txn`` sees it."""
    raw = txn.get(C_READ_GENERATION, db=meta)
    return 0 if raw is None else unpack_u64(raw)


def load_reads(cache_path: str, generation: int = 0) -> ReadLog:
    """The read log of the cache at ``cache_path`` (empty when there is none, or it cannot be
    read: eviction then orders as if nothing had been read, and says so in the log)."""
    path = reads_path(cache_path)
    try:
        with AST_LOCK, np.load(path) as data:  # headers parsed with ast (see limits.AST_LOCK)
            found = ReadLog(data["seqs"].astype(np.uint64), data["stamps"].astype(np.uint32),
                            data["bounds"].astype(np.uint64), generation)
    except FileNotFoundError:
        return ReadLog.empty(generation)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.warning("%s: the read log cannot be read (%s): eviction orders as if nothing had "
                    "been read until the next epoch ends", path, exc)
        return ReadLog.empty(generation)
    if len(found.seqs) != len(found.stamps):
        log.warning("%s: the read log is damaged (%d samples, %d stamps): ignored", path,
                    len(found.seqs), len(found.stamps))
        return ReadLog.empty(generation)
    return found


def remove_reads(cache_path: str) -> None:
    """Forget what was read (the cache's policy changed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(reads_path(cache_path))


def policy_uses_reads(txn: lmdb.Transaction, meta: lmdb._Database) -> bool:
    """Whether the cache's stored policy orders by reads (an unknown one: no)."""
    raw = txn.get(M_EVICTION, db=meta)
    entry = EVICTION.get(bytes(raw).decode() if raw is not None else "")
    if entry is None:
        return False
    try:
        return bool(getattr(entry.resolve(), "uses_reads", False))
    except (ImportError, AttributeError, TypeError):
        return False


def plan_reads(cache_path: str, lease_id: str) -> np.ndarray:
    """The samples the readers of a lease's plan read (its lanes' read prefixes), sorted
    unique; empty without a plan."""
    try:
        names = os.listdir(plans_dir(cache_path))
    except FileNotFoundError:
        return np.empty(0, np.uint64)
    read: list[np.ndarray] = []
    for name in names:
        if not (name.startswith(lease_id + ".") and name.endswith(".plan")):
            continue
        try:
            part = Part(os.path.join(plans_dir(cache_path), name))
        except (OSError, ValueError):
            continue  # a damaged part: its reads are not known
        positions = part.positions.astype(np.int64)
        for lane in np.flatnonzero(positions):
            read.append(np.array(part.lane(int(lane))[: int(positions[lane])], np.uint64))
    if not read:
        return np.empty(0, np.uint64)
    return np.unique(np.concatenate(read))


def record_reads(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], cache_path: str,
                 lease_id: str) -> int:
    """In the transaction that deletes lease ``lease_id`` (before its plan files go): record
    what its readers read as a new generation, if the cache's policy orders by reads. Returns
    the samples recorded."""
    meta = dbs[DB_META]
    if not policy_uses_reads(txn, meta):
        return 0
    read = plan_reads(cache_path, lease_id)
    if not len(read):
        return 0
    generation = read_generation(txn, meta) + 1
    old = load_reads(cache_path)
    raw_next = txn.get(C_NEXT_SEQ, db=meta)
    next_seq = 0 if raw_next is None else unpack_u64(raw_next)
    # Generations lost with an unreadable log restart from the count in meta.
    bounds = np.concatenate([old.bounds[: generation - 1],
                             np.full(max(0, generation - 1 - len(old.bounds)), 0, np.uint64),
                             np.array([next_seq], np.uint64)])
    seqs = np.union1d(old.seqs, read).astype(np.uint64)
    stamps = np.zeros(len(seqs), np.uint32)
    stamps[np.searchsorted(seqs, old.seqs)] = old.stamps
    stamps[np.searchsorted(seqs, read)] = generation
    seqs, stamps = _cached_only(txn, dbs[DB_SAMPLES], seqs, stamps)
    with atomic_write(reads_path(cache_path), suffix=".npz") as f:
        np.savez(f, seqs=seqs, stamps=stamps, bounds=bounds)
    txn.put(C_READ_GENERATION, pack_u64(generation), db=meta)
    return len(read)


def _cached_only(txn: lmdb.Transaction, samples: lmdb._Database, seqs: np.ndarray,
                 stamps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop the entries of samples no longer cached: below the oldest one always; the others
    once the log holds twice the cached samples (one walk over the keys)."""
    cursor = txn.cursor(db=samples)
    if not cursor.first():
        return seqs[:0], stamps[:0]
    start = int(np.searchsorted(seqs, seq_of(bytes(cursor.key()))))
    seqs, stamps = seqs[start:], stamps[start:]
    cached = int(txn.stat(samples)["entries"])
    if len(seqs) <= max(2 * cached, 4096):
        return seqs, stamps
    keys = b"".join(bytes(key) for key in cursor.iternext(keys=True, values=False))
    present = np.frombuffer(keys, dtype=">u8").astype(np.uint64)
    keep = np.isin(seqs, present, assume_unique=True)
    return seqs[keep], stamps[keep]
