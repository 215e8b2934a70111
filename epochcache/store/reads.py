"""What a snapshot's readers read: its release plan while the epoch runs, the read log after.

**Release plans.** A lease with a plan protects less: a sample its epoch has delivered to every
reader that was to read it is released, and eviction may take it while the epoch goes on
(invariant 1, progressive release). The plan lives in files beside the LMDB environment, in
``plans/``, named by the lease:

* ``<lease>.seqs.npy``: the snapshot's sequence numbers, sorted (written by the process that
  took the snapshot; a stream's workers and a resumed run rebuild the snapshot from it).
* ``<lease>.<part>.plan``: one per reader group (a DDP rank of the node): its *lanes*, each
  the sequence of samples one reader reads in order (the rank's loop, or one DataLoader worker
  of a stream), and one position per lane, the count of its samples released so far. Readers
  advance their position in place (an aligned 8-byte store into a shared mapping), so
  releasing costs the training loop no transaction and no system call.

A lease says how many parts its plan has (``Lease.plan_parts``); until every part exists it
protects its whole range, as a lease without a plan does. Files are written under a temporary
name and renamed into place, so a reader of the directory sees a whole file or none. They are
removed with their lease (released or reclaimed) and swept when no lease names them.
Part file layout (little-endian u64 words): ``magic, lanes, total``, then ``lanes + 1`` lane
offsets into the data, ``lanes`` positions, and ``total`` sequence numbers.

**The read log**: which samples training read, and when, for eviction policies that order by
reads (`epochcache.store.eviction.EvictionPolicy.uses_reads`). Nothing is written on the read
path: when a lease ends (released at its epoch's end, left unfinished, or reclaimed from a dead
owner), the process that deletes it records, in the same write transaction, the samples its
readers read: the union of its lanes' read prefixes, once per epoch, O(snapshot) in numpy.
A lease without a plan (``cache.dataset()``, ``epochs(release="epoch")``) records nothing:
its reads are not known. Each recording is a *generation* (1, 2, ...); ``meta`` counts them
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
import mmap
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb
import numpy as np

from ..limits import AST_LOCK
from ..paths import atomic_write
from ..registry import EVICTION
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


class Reads:
    """The read log as one writer process sees it: loaded again only when a lease end
    recorded reads since (``meta`` counts them), so a pass costs one ``get``.

    Args:
        cache_path: the cache directory.
    """

    def __init__(self, cache_path: str) -> None:
        self.cache_path = cache_path
        self._log = ReadLog.empty()

    def current(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database]) -> ReadLog:
        """The read log as of ``txn`` (the same object until a new generation is recorded)."""
        generation = read_generation(txn, dbs[DB_META])
        if generation != self._log.generation:
            self._log = load_reads(self.cache_path, generation)
        return self._log


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


PLANS_DIR = "plans"
_MAGIC = int.from_bytes(b"ECPLAN01", "little")
_HEAD = 3  # words before the offsets


def plans_dir(cache_path: str) -> str:
    return os.path.join(cache_path, PLANS_DIR)


def seqs_path(cache_path: str, lease_id: str) -> str:
    return os.path.join(plans_dir(cache_path), f"{lease_id}.seqs.npy")


def part_path(cache_path: str, lease_id: str, part: int) -> str:
    return os.path.join(plans_dir(cache_path), f"{lease_id}.{part}.plan")


def write_seqs(cache_path: str, lease_id: str, seqs: np.ndarray) -> None:
    """Save a snapshot's sequence numbers (sorted) for its plan and its readers."""
    with atomic_write(seqs_path(cache_path, lease_id), suffix=".npy") as f:
        np.save(f, np.ascontiguousarray(seqs, dtype="<u8"))


def read_seqs(cache_path: str, lease_id: str) -> np.ndarray | None:
    """A snapshot's sorted sequence numbers (memory-mapped), or None without a plan."""
    try:
        with AST_LOCK:  # the header is parsed with ast.literal_eval (see limits.AST_LOCK)
            seqs: np.ndarray = np.load(seqs_path(cache_path, lease_id), mmap_mode="r")
    except (OSError, ValueError):
        return None
    return seqs


def write_part(cache_path: str, lease_id: str, part: int, lanes: Sequence[np.ndarray]) -> None:
    """Save one part of a plan: the lanes its readers read, all positions at 0. An existing
    part is kept as it is (its readers may have advanced; the lanes are the same)."""
    path = part_path(cache_path, lease_id, part)
    if os.path.exists(path):
        return
    sizes = [len(lane) for lane in lanes]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype("<u8")
    head = np.array([_MAGIC, len(lanes), int(offsets[-1])], dtype="<u8")
    positions = np.zeros(len(lanes), dtype="<u8")
    data = [np.ascontiguousarray(lane, dtype="<u8") for lane in lanes]
    with atomic_write(path) as f:
        for chunk in (head, offsets, positions, *data):
            f.write(chunk.tobytes())


class Part:
    """One part file, mapped: its lanes (read-only views) and their positions (shared).

    Args:
        path: the part file.
        writable: map it for writing positions (a reader of the plan); else read-only.

    Raises:
        OSError: the file is missing or unreadable.
        ValueError: the file is not a plan part (damaged, or of another version).
    """

    def __init__(self, path: str, *, writable: bool = False) -> None:
        with open(path, "r+b" if writable else "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0,
                                  access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        words = np.frombuffer(self._map, dtype="<u8")
        if len(words) < _HEAD or int(words[0]) != _MAGIC:
            raise ValueError(f"{path}: not a plan part")
        lanes, total = int(words[1]), int(words[2])
        if len(words) != _HEAD + (lanes + 1) + lanes + total:
            raise ValueError(f"{path}: plan part of the wrong size")
        self.offsets = words[_HEAD : _HEAD + lanes + 1]
        self.positions = words[_HEAD + lanes + 1 : _HEAD + 2 * lanes + 1]
        self.data = words[_HEAD + 2 * lanes + 1 :]
        self.lanes = lanes

    def lane(self, index: int) -> np.ndarray:
        return self.data[int(self.offsets[index]) : int(self.offsets[index + 1])]


class Releaser:
    """What a reader of a plan holds: its part, mapped for writing, and its lane.

    Opening is lazy and failures are quiet (logged once): a plan that cannot be opened only
    means the samples stay protected until the lease ends.

    Args:
        cache_path: the cache directory.
        lease_id: the lease whose plan this is.
        part: the reader's part (its rank's slot on the node).
        lane: the reader's lane in the part.
    """

    def __init__(self, cache_path: str, lease_id: str, part: int, lane: int) -> None:
        self.path = part_path(cache_path, lease_id, part)
        self.lane = lane
        self._part: Part | None = None
        self._failed = False
        # This lane's position word (a view into the mapping) and length: a release, once per
        # batch on the training thread, is a comparison and an 8-byte store.
        self._word: memoryview | None = None
        self._length = 0
        self._released = 0

    def _open(self) -> bool:
        if self._failed:
            return False
        try:
            part = Part(self.path, writable=True)
        except (OSError, ValueError) as exc:
            self._failed = True
            log.warning("%s: cannot release samples progressively (%s); they stay protected "
                        "until the epoch ends", self.path, exc)
            return False
        self._part = part
        self._length = int(part.offsets[self.lane + 1] - part.offsets[self.lane])
        self._word = part.positions[self.lane : self.lane + 1].data.cast("B").cast("Q")
        self._released = int(self._word[0])
        return True

    def release(self, position: int) -> None:
        """The first ``position`` samples of this reader's lane are read: release them."""
        if self._word is None and not self._open():
            return
        if position > self._released:
            self._released = min(position, self._length)
            self._word[0] = self._released  # type: ignore[index]

    def __getstate__(self) -> dict[str, object]:
        return {"path": self.path, "lane": self.lane, "_part": None, "_failed": False,
                "_word": None, "_length": 0, "_released": 0}


def remove_plan(cache_path: str, lease_id: str) -> None:
    """Delete a lease's plan files (its lease is gone)."""
    directory = plans_dir(cache_path)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(lease_id + "."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def sweep_plans(cache_path: str, live: set[str]) -> list[str]:
    """Delete plan files of leases not in ``live``; return the lease ids swept."""
    directory = plans_dir(cache_path)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    swept: set[str] = set()
    for name in names:
        lease_id = name.split(".", 1)[0]
        if lease_id and lease_id not in live and not name.startswith(".tmp-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
            swept.add(lease_id)
    return sorted(swept)
