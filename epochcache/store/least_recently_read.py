"""Least recently read first (``cache.eviction: least-recently-read``): eviction keeps what
training reads.

A sample's *stamp* is the generation of its newest read in the read log
(`epochcache.store.reads`: one generation each time an epoch's lease ends); a sample never
read has the generation current when it was inserted, so a fresh sample is not taken before
the ones read just before it arrived. Eviction takes the lowest ``(stamp, seq)`` that no lease
protects (`Protection.protects`, the frontier included), through `take`; when everything left
is protected it stops and names a lease (writers wait: back-pressure). So after epochs that
read only part of the cache (``samples_per_epoch`` below the snapshot, an epoch stopped early),
the samples they did not read go first, oldest first among them; with every epoch reading
everything it is oldest-first.

The order is pieces of sequence numbers, lowest stamp first: the never-read samples inserted
before the first generation (a range of seqs), then for each generation ``g`` the samples whose
newest read is ``g`` (from the log, sorted) followed by the never-read samples inserted while
``g`` was current (a range, walked with a cursor: the log's bounds are where ranges end). That
holds because a sample read at ``g`` was inserted before ``g`` was recorded.

Cost per writer process: the log is loaded again only when a generation is recorded (O(n log n)
numpy, once per epoch: about 0.4 s for a million samples read on a busy 2-core machine; 16
bytes per read sample kept in memory plus a byte for "gone"). A pass walks each piece from
where the last one left it (what lies before holds no candidate: read, taken or gone), in
chunks growing from 64 to 4096 checked against the protection at once: a commit that evicts
64 samples costs about what it costs oldest-first (``scripts/bench_eviction.py``; figures in
docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import lmdb
import numpy as np

from .eviction import Eviction, EvictionPolicy, prune_origins, take
from .leases import Lease
from .reads import ReadLog, Reads
from .records import DB_KEYS, DB_SAMPLES, seq_key, seq_of
from .release import Protection
from .tables import Counters

_CHUNK = 4096
_END = 1 << 64


class LeastRecentlyRead(EvictionPolicy):
    """The sample read longest ago (or, never read, inserted longest ago) that no lease
    protects (see the module docstring)."""

    name = "least-recently-read"
    uses_reads = True

    def __init__(self) -> None:
        self._log: ReadLog | None = None
        self._order = np.empty(0, np.uint64)  # read samples by (stamp, seq)
        self._read = np.empty(0, np.uint64)  # the same, sorted by seq
        self._gone = np.empty(0, bool)  # by position in _order: taken or found gone
        self._segments: list[tuple[int, int]] = []  # [lo, hi) of _order, per generation
        self._ranges: list[tuple[int, int]] = []  # never-read seqs, per stamp 0..G
        self._first = 0  # pieces before this one hold no cached sample
        #: Per piece, where its walk starts: a seq (never-read ranges), a position in _order
        #: (segments). What lies before holds no candidate for this log: read, taken or gone.
        self._starts: list[int] = []

    def _load(self, log: ReadLog) -> None:
        self._log = log
        order = np.lexsort((log.seqs, log.stamps))
        self._order = log.seqs[order]
        self._read = log.seqs
        self._gone = np.zeros(len(order), bool)
        generations = len(log.bounds)
        stamps = log.stamps[order]
        edges = np.searchsorted(stamps, np.arange(1, generations + 2), side="left")
        self._segments = [(int(edges[g]), int(edges[g + 1])) for g in range(generations)]
        starts = [0, *(int(b) for b in log.bounds)]
        self._ranges = [(starts[g], starts[g + 1] if g < generations else _END)
                        for g in range(generations + 1)]
        self._first = 0
        self._starts = [self._ranges[p // 2][0] if p % 2 == 0 else self._segments[p // 2][0]
                        for p in range(self._pieces())]

    def _pieces(self) -> int:
        return len(self._ranges) + len(self._segments)

    def evict(self, txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
              counters: Counters, limit_bytes: int, leases: Sequence[Lease],
              protection: Protection, reads: Reads) -> Eviction:
        result = Eviction()
        if counters.bytes <= limit_bytes:
            return result
        protection.sync(leases)
        log = reads.current(txn, dbs)
        if log is not self._log:
            self._load(log)
        cursor = txn.cursor(db=dbs[DB_SAMPLES])
        keys_db = dbs[DB_KEYS]
        # What this pass marks gone stands once the transaction commits (else those samples
        # are still cached, and must stay candidates).
        marked: list[int] = []
        order, first, starts = self._order, self._first, list(self._starts)
        protection.on_rollback(lambda: self._restore(order, marked, first, starts))
        blocker: int | None = None  # the first protected candidate seen
        exhausted = True  # every piece so far holds no cached candidate
        for piece in range(self._first, self._pieces()):
            held = False
            for seqs, where in self._candidates(piece, cursor, protection.frontier):
                held = held or bool(len(seqs))
                kept = protection.protects(seqs)
                if blocker is None and kept.any():
                    blocker = int(seqs[int(np.argmax(kept))])
                for i in np.flatnonzero(~kept):
                    if where is not None:
                        self._gone[where[i]] = True
                        marked.append(int(where[i]))
                    if not cursor.set_key(seq_key(int(seqs[i]))):
                        continue  # another process took it
                    take(txn, cursor, keys_db, counters, result)
                    if counters.bytes <= limit_bytes:
                        break
                if counters.bytes <= limit_bytes:
                    break
            open_ended = piece == self._pieces() - 1
            if exhausted and not held and not open_ended:
                self._first = piece + 1
            exhausted = exhausted and not held
            if counters.bytes <= limit_bytes:
                break
        else:
            result.blocked_by = protection.blocker(blocker)
        if result.count:
            prune_origins(txn, dbs, leases)
        return result

    def _restore(self, order: np.ndarray, marked: list[int], first: int,
                 starts: list[int]) -> None:
        """Undo a pass whose transaction did not commit."""
        if order is self._order:  # (not loaded again since)
            self._gone[marked] = False
            self._first, self._starts = first, starts

    def _candidates(self, piece: int, cursor: lmdb.Cursor, frontier: int | None,
                    ) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Chunks of a piece's candidates, from its start (moved past what holds none):
        ``(seqs, their positions in _order)`` for a generation's read samples (those not
        gone), ``(seqs, None)`` for a range of never-read ones (those cached, below the
        frontier). Chunks grow from 64 to 4096: a pass usually needs a few victims."""
        stamp, segment = divmod(piece, 2)
        size = 64
        if segment:
            lo, hi = self._starts[piece], self._segments[stamp][1]
            while lo < hi:
                where = np.flatnonzero(~self._gone[lo : lo + size]) + lo
                if lo == self._starts[piece]:
                    self._starts[piece] = int(where[0]) if len(where) else min(lo + size, hi)
                lo, size = lo + size, min(2 * size, _CHUNK)
                if len(where):
                    yield self._order[where], where
            return
        lo, hi = self._starts[piece], self._ranges[stamp][1]
        if frontier is not None:
            hi = min(hi, frontier)
        while lo < hi and cursor.set_range(seq_key(lo)):
            found: list[int] = []
            for key in cursor.iternext(keys=True, values=False):
                seq = seq_of(bytes(key))
                if seq >= hi or len(found) == size:
                    break
                found.append(seq)
            if not found:
                return
            seqs = np.array(found, np.uint64)
            if len(self._read):  # read ones are in their generation's segment
                at = np.minimum(np.searchsorted(self._read, seqs), len(self._read) - 1)
                seqs = seqs[self._read[at] != seqs]
            if lo == self._starts[piece]:
                self._starts[piece] = int(seqs[0]) if len(seqs) else found[-1] + 1
            lo, size = found[-1] + 1, min(2 * size, _CHUNK)
            yield seqs, None

