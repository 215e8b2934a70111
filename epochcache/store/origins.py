"""Where each cached sample came from, by sequence number: the ``origins`` sub-database.

The training side knows samples by sequence number; an audit wants them by remote key and by
their place in the source's listing. The sampler knows both when it commits a sample, so the
writer records them in the same transaction as the samples: one row per commit, keyed by the
commit's first sequence number (big-endian, so rows are appended in order, ``append=True``),
holding for each sample of the commit, in sequence order:

* its source key (the cache key: ``<name>/<key>`` for an entry of ``sources:``), so that a
  manifest can name samples evicted since (progressive release frees them while the epoch
  still runs);
* its *origin*: the listing it was picked from (a small id: the listings registry below) and its
  index there, and for a ``tar`` sample its ordinal among the samples of its shard and how
  many samples the shard held. Samples put without an origin (the Python API, a cache written
  by an older version, which has no rows at all) are *unattributed*.

A row costs its keys plus 14 (files) or 22 (tar) bytes a sample and one ``put`` per commit,
nothing per sample on the write path beyond packing (``scripts/bench_ingest.py`` measures it).
Rows are deleted once nothing can ask for them: when eviction passes their last sample and no
lease holds a range that reaches back to them (`prune`). Reading the origins of an
epoch's samples (`read_origins`) walks the rows of its range: a few thousand rows and
numpy slicing for a million samples.

Row layout (little-endian): ``u8 version, u8 flags, u16 reserved, u32 n``, then ``u16 lid[n]``,
``u64 index[n]``, with ``FLAG_MEMBERS`` ``u32 member[n]`` and ``u32 members[n]``, then
``u32 key_length[n]`` and the keys' UTF-8 bytes.

**The listings registry.** A sampler registers the listing it samples (its source's
fingerprint and identity, which a run compares its sources with: `epochcache.ingest.lineage`,
and the listing's *generation*: indices into a listing keep their meaning only within one
generation, see ``ingest/listing.py``) before it commits a sample picked from it, and gets back
a listing id (a ``u16``). Each registration also records what coverage needs to know about the
listing as it stands: the source's name and URL, its layout's unit (``sample`` or ``shard``),
how many refs it holds and how many of them the last re-list did not find (``gone``), and the
node's share (``node_rank`` of ``num_nodes``). A listing that grows keeps its id; the document
is updated. The registry is one JSON document in ``meta`` (one entry per source and
generation), written in a write transaction, so concurrent samplers agree on ids.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import lmdb
import numpy as np

from .env import Env
from .records import DB_META, DB_ORIGINS, DB_SAMPLES, seq_key, seq_of

ROW_VERSION = 1
FLAG_MEMBERS = 1
_HEAD = struct.Struct("<BBHI")
#: The listing id of a sample whose origin is unknown.
UNKNOWN = 0xFFFF


class Origin(NamedTuple):
    """Where one sample came from (a tuple: samplers make one per sample).

    Attributes:
        lid: the listing's id in this cache (the listings registry); `UNKNOWN` for none.
        ref_index: the index of its listed ref (an object, or a tar shard) in that listing.
        member: a tar sample's ordinal among the samples of its shard (0 otherwise).
        members: how many samples its shard held when fetched (0: not a tar sample).
    """

    lid: int
    ref_index: int
    member: int = 0
    members: int = 0


_NONE = Origin(UNKNOWN, 0)


def pack_row(keys: Sequence[bytes | str], origins: Sequence[Origin | None]) -> bytes:
    """One row: the keys and origins of a commit's samples, in sequence order."""
    n = len(keys)
    given = [_NONE if origin is None else origin for origin in origins]
    lids = np.array([o[0] for o in given], dtype="<u2")
    index = np.array([o[1] for o in given], dtype="<u8")
    tar = any(o[3] for o in given)
    raw = [key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")
           for key in keys]
    lengths = np.array([len(key) for key in raw], dtype="<u4")
    parts = [_HEAD.pack(ROW_VERSION, FLAG_MEMBERS if tar else 0, 0, n), lids.tobytes(),
             index.tobytes()]
    if tar:
        parts += [np.array([o[2] for o in given], dtype="<u4").tobytes(),
                  np.array([o[3] for o in given], dtype="<u4").tobytes()]
    parts += [lengths.tobytes(), b"".join(raw)]
    return b"".join(parts)


@dataclass
class Rows:
    """The origins of some samples, as arrays (one entry per sample asked for).

    ``found`` is False where no row names the sample (its key is then unknown too). With keys
    asked for, ``blob`` holds them and ``key_start``/``key_len`` where each entry's is in it
    (no Python object per key: `joined` makes a manifest's payload in numpy).
    """

    lid: np.ndarray
    index: np.ndarray
    member: np.ndarray
    members: np.ndarray
    found: np.ndarray
    blob: bytes = b""
    key_start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    key_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def keys(self) -> list[bytes | None]:
        """Each entry's key (UTF-8 bytes), None where not found."""
        blob = self.blob
        return [blob[a: a + n] if found else None for a, n, found in
                zip(self.key_start.tolist(), self.key_len.tolist(), self.found.tolist())]

    def joined(self, separator: bytes) -> bytes:
        """Every entry's key, in order, ``separator`` (one byte) between them: the keys are
        gathered by numpy in chunks, never one Python object each (a manifest of a million
        keys in ~0.1 s where a list of them took ~1 s). Entries not found give empty keys."""
        if len(separator) != 1:
            raise ValueError("separator: one byte")
        source = np.frombuffer(self.blob + separator, dtype=np.uint8)
        sentinel = len(self.blob)
        lengths = np.where(self.found, self.key_len, 0).astype(np.int64)
        parts = []
        for lo in range(0, len(lengths), _GATHER):
            length = lengths[lo: lo + _GATHER] + 1  # each key and the separator after it
            start = self.key_start[lo: lo + _GATHER]
            placed = np.cumsum(length) - length  # where each key goes in this chunk's bytes
            index = (np.arange(int(length.sum()), dtype=np.int64)
                     - np.repeat(placed, length) + np.repeat(start, length))
            index[placed + length - 1] = sentinel
            parts.append(source[index].tobytes())
        return b"".join(parts)[:-1]


#: Keys gathered per numpy step by `Rows.joined`.
_GATHER = 65536


class _Row:
    """One decoded row (arrays are views of the row's bytes)."""

    def __init__(self, first: int, raw: bytes) -> None:
        version, flags, _, n = _HEAD.unpack_from(raw)
        if version != ROW_VERSION:
            raise ValueError(f"origins row of version {version}")
        self.first, self.n, self.raw = first, n, raw
        at = _HEAD.size
        self.lid = np.frombuffer(raw, "<u2", n, at)
        at += 2 * n
        self.index = np.frombuffer(raw, "<u8", n, at)
        at += 8 * n
        if flags & FLAG_MEMBERS:
            self.member = np.frombuffer(raw, "<u4", n, at)
            self.members = np.frombuffer(raw, "<u4", n, at + 4 * n)
            at += 8 * n
        else:
            self.member = self.members = np.zeros(n, dtype="<u4")
        self.lengths = np.frombuffer(raw, "<u4", n, at)
        self.keys_at = at + 4 * n  # where the keys' bytes begin


def write_row(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], first: int,
              keys: Sequence[bytes | str], origins: Sequence[Origin | None]) -> None:
    """Record the keys and origins of samples ``first, first + 1, ...`` (one commit's)."""
    db = dbs.get(DB_ORIGINS)
    if db is None or not keys:
        return
    # Rows are keyed by their first sequence number, which only grows: append is valid.
    txn.put(seq_key(first), pack_row(keys, origins), db=db, append=True)


def read_origins(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database], seqs: np.ndarray,
                 *, with_keys: bool = False) -> Rows:
    """The origins (and with ``with_keys`` the keys) of ``seqs``, in their order.

    The rows from the first sample's to the last one's are read, then every sample is looked
    up at once (numpy): a few microseconds a row, nothing per sample but with keys."""
    seqs = np.asarray(seqs, dtype=np.uint64)
    n = len(seqs)
    out = Rows(np.full(n, UNKNOWN, dtype=np.uint16), np.zeros(n, dtype=np.uint64),
               np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.uint32),
               np.zeros(n, dtype=bool), b"", np.zeros(n, dtype=np.int64),
               np.zeros(n, dtype=np.int64))
    db = dbs.get(DB_ORIGINS)
    if db is None or not n:
        return out
    ordered = bool(np.all(seqs[1:] > seqs[:-1])) if n > 1 else True
    order = np.arange(n) if ordered else np.argsort(seqs, kind="stable")
    wanted = seqs if ordered else seqs[order]
    low, high = int(wanted[0]), int(wanted[-1])
    cursor = txn.cursor(db=db)
    # The row holding the first wanted sample starts at or before it.
    if not cursor.set_range(seq_key(low)):
        if not cursor.last():
            return out
    elif seq_of(bytes(cursor.key())) > low and not cursor.prev():
        cursor.first()
    rows: list[_Row] = []
    for key, value in cursor.iternext():
        first = seq_of(bytes(key))
        if first > high:
            break
        row = _Row(first, bytes(value))
        if first + row.n > low:
            rows.append(row)
    if not rows:
        return out
    firsts = np.array([row.first for row in rows], dtype=np.uint64)
    counts = np.array([row.n for row in rows], dtype=np.uint64)
    base = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
    r = np.maximum(np.searchsorted(firsts, wanted, side="right").astype(np.int64) - 1, 0)
    inside = (wanted >= firsts[r]) & (wanted - np.minimum(wanted, firsts[r]) < counts[r])
    at = order[inside]
    g = base[r[inside]] + (wanted[inside] - firsts[r[inside]]).astype(np.int64)
    out.lid[at] = np.concatenate([row.lid for row in rows])[g]
    out.index[at] = np.concatenate([row.index for row in rows])[g]
    out.member[at] = np.concatenate([row.member for row in rows])[g]
    out.members[at] = np.concatenate([row.members for row in rows])[g]
    out.found[at] = True
    if with_keys:
        out.blob = b"".join(row.raw[row.keys_at:] for row in rows)
        lengths = np.concatenate([row.lengths for row in rows]).astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        out.key_start[at] = starts[g]
        out.key_len[at] = lengths[g]
    return out


def unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (a sort and a mask: numpy's hash-based ``unique`` took 5x
    as long on a million sequence numbers)."""
    ordered = np.sort(values)
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def prune(txn: lmdb.Transaction, dbs: dict[bytes, lmdb._Database],
          lease_los: Sequence[int]) -> int:
    """Delete the rows whose samples all lie below the oldest sample still cached and the
    lowest sequence number a live lease holds (``lease_los``); return how many."""
    db = dbs.get(DB_ORIGINS)
    if db is None:
        return 0
    samples = txn.cursor(db=dbs[DB_SAMPLES])
    bound = min([seq_of(bytes(samples.key())) if samples.first() else 2**63, *lease_los])
    cursor = txn.cursor(db=db)
    deleted = 0
    while cursor.first():
        first = seq_of(bytes(cursor.key()))
        n = _HEAD.unpack_from(bytes(cursor.value()[: _HEAD.size]))[3]
        if first + n > bound:
            break
        cursor.delete()
        deleted += 1
    return deleted


def cached_listing_counts(env: Env) -> dict[int, int]:
    """How many cached samples each listing id has (`UNKNOWN`: those with no origin),
    from the origin rows of the samples still cached: the lids of each row are read, never its
    keys (a million samples in 2,000 rows: 0.14 s on a busy 2-core machine)."""
    counts: dict[int, int] = {}
    with env.read() as txn:
        samples = txn.cursor(db=env.dbs[DB_SAMPLES])
        if not samples.first():
            return counts
        oldest = seq_of(bytes(samples.key()))
        total = int(txn.stat(env.dbs[DB_SAMPLES])["entries"])
        db = env.dbs.get(DB_ORIGINS)
        attributed = 0
        if db is not None:
            for key, value in txn.cursor(db=db):
                first = seq_of(bytes(key))
                n = _HEAD.unpack_from(value)[3]
                skip = max(0, min(n, oldest - first))  # evicted, the row kept for a lease
                lids = np.frombuffer(value, "<u2", n, _HEAD.size)[skip:]
                for lid, count in zip(*np.unique(lids, return_counts=True)):
                    counts[int(lid)] = counts.get(int(lid), 0) + int(count)
                attributed += n - skip
        if total > attributed:
            counts[UNKNOWN] = counts.get(UNKNOWN, 0) + total - attributed
    return counts


#: ``meta`` key of the registry.
M_LISTINGS = b"coverage_listings"
#: Fields of a registration (what the sampler knows about its listing).
FIELDS = ("source", "fingerprint", "generation", "url", "unit", "listed", "gone", "complete",
          "node_rank", "num_nodes", "identity")


def _load(txn: lmdb.Transaction, meta: lmdb._Database) -> dict[str, Any]:
    raw = txn.get(M_LISTINGS, db=meta)
    doc: dict[str, Any] = {"next": 0, "listings": {}} if raw is None else json.loads(bytes(raw))
    return doc


def register_listing(env: Env, info: dict[str, Any]) -> int:
    """The id of the listing ``info`` describes (its fingerprint and generation), registered
    now if it is new; its document is brought up to date either way.

    Raises:
        ValueError: the registry is full (65,535 listings; not expected in a cache's life).
    """
    meta = env.dbs[DB_META]

    def run(txn: lmdb.Transaction) -> int:
        doc = _load(txn, meta)
        listings: dict[str, dict[str, Any]] = doc["listings"]
        lid = next((int(k) for k, v in listings.items()
                    if v.get("fingerprint") == info["fingerprint"]
                    and v.get("generation") == info["generation"]), None)
        entry = {name: info.get(name) for name in FIELDS}
        if lid is None:
            lid = int(doc["next"])
            if lid >= UNKNOWN:
                raise ValueError(f"{env.path}: the cache has registered {lid} listings; "
                                 "no id is left for another")
            doc["next"] = lid + 1
            entry["registered"] = time.time()
        else:
            old = listings[str(lid)]
            if all(old.get(name) == entry[name] for name in FIELDS):
                return lid  # unchanged: nothing to write
            entry["registered"] = old.get("registered", time.time())
        entry["updated"] = time.time()
        listings[str(lid)] = entry
        txn.put(M_LISTINGS, json.dumps(doc, separators=(",", ":")).encode(), db=meta)
        return lid

    return env.write(run)


def listings(env: Env) -> dict[int, dict[str, Any]]:
    """Every registered listing, by id."""
    with env.read() as txn:
        doc = _load(txn, env.dbs[DB_META])
    return {int(k): v for k, v in doc["listings"].items()}
