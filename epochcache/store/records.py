"""The on-disk layout of a cache: LMDB sub-databases, key encodings and the record header.

Every sample is one record in ``samples`` keyed by its insertion sequence number, big-endian so
that LMDB's byte order is insertion order: the oldest sample is the cursor's first key, and
batch writes can use ``putmulti(append=True)``.

Record layout (little-endian header, then the source key, then the payload)::

    u8  format version        u8  codec (Codec)      u16 flags (RecordFlags)
    u32 crc32 of the payload  u64 raw (uncompressed) size
    u64 time added, ns        u16 length of the source key
    source key (utf-8)        payload (stored bytes)

The ``keys`` index maps a source key to its sequence number. LMDB keys are at most 511 bytes
and never empty, while S3 keys go to 1024 bytes: such keys are indexed under
`index_key`, a fixed-length digest key; the record itself keeps the full source key.
"""

from __future__ import annotations

import enum
import hashlib
import struct

FORMAT_VERSION = 1

#: Sub-database names. ``meta`` holds counters and settings, ``keys`` maps a source key to its
#: sequence number, ``leases`` the live snapshot leases, ``state`` JSON documents written by the
#: daemon (heartbeat, sampler positions), ``history`` time-keyed stats rows, ``quarantine`` the
#: most recent rejected remote objects, ``origins`` where each sample came from (its source key,
#: listing and index, one row per commit: `epochcache.store.origins`).
DB_SAMPLES = b"samples"
DB_KEYS = b"keys"
DB_META = b"meta"
DB_LEASES = b"leases"
DB_STATE = b"state"
DB_HISTORY = b"history"
DB_QUARANTINE = b"quarantine"
DB_ORIGINS = b"origins"
ALL_DBS = (DB_SAMPLES, DB_KEYS, DB_META, DB_LEASES, DB_STATE, DB_HISTORY, DB_QUARANTINE,
           DB_ORIGINS)
#: Sub-databases a cache written by an older version may lack: opened read-only without write
#: access to its directory, such a cache opens without them (their readers treat them as empty).
OPTIONAL_DBS = (DB_ORIGINS,)

#: Counters kept in ``meta``; each changes in the same transaction as the data it counts.
C_SAMPLES = b"samples"
C_BYTES = b"bytes"
C_NEXT_SEQ = b"next_seq"
C_EVICTED = b"evicted"
C_EVICTED_BYTES = b"evicted_bytes"
C_INSERTED = b"inserted"
C_QUARANTINED = b"quarantined"
C_FORMAT = b"format_version"
#: A lowered capacity stored by earlier versions; now a runtime back-off, so this key is ignored
#: and deleted when a cache is opened for writing (`epochcache.store.lowered_capacity`).
C_EFFECTIVE_CAPACITY = b"effective_capacity"
#: The cache's eviction policy, by its registered name (`epochcache.registry`); missing: the
#: default (`epochcache.store.eviction.DEFAULT_POLICY`).
M_EVICTION = b"eviction"
#: Bumped each time reads are recorded (`epochcache.store.reads`): a policy that orders by
#: reads loads the read log again when it changed.
C_READ_GENERATION = b"read_generation"

HISTORY_MAX_ROWS = 20_000
QUARANTINE_MAX_ROWS = 10_000
#: The quarantine's rows take at most this many bytes (a row holds a cut key: a few KiB at
#: most), the oldest dropped first: a remote's names never fill the map samples need.
QUARANTINE_MAX_BYTES = 1024 * 1024
#: In ``meta``: the bytes the quarantine rows take, and how many rows were dropped for room.
C_QUARANTINE_BYTES = b"quarantine_bytes"
C_QUARANTINE_DROPPED = b"quarantine_dropped"

#: LMDB's longest key (MDB_MAXKEYSIZE of the library py-lmdb bundles).
MAX_KEY_BYTES = 511
#: Marks a digest key. 0xFF never occurs in UTF-8, so a digest key cannot equal a plain one.
_DIGEST_MARK = b"\xff"
#: Bytes of the source key kept in front of its digest (so prefix scans still find most).
_DIGEST_HEAD = MAX_KEY_BYTES - len(_DIGEST_MARK) - hashlib.sha256().digest_size

_SEQ = struct.Struct(">Q")
_U64 = struct.Struct(">Q")
HEADER = struct.Struct("<BBHIQQH")


class Codec(enum.IntEnum):
    """How a record's payload is stored."""

    RAW = 0
    ZSTD = 1


class RecordFlags(enum.IntFlag):
    """Per-record flags."""

    NONE = 0
    #: The raw payload is a field container (a tar sample: ``{"jpg": ..., "cls": ...}``).
    FIELDS = 1


def index_key(key: bytes) -> bytes:
    """The ``keys`` index entry of a source key given as UTF-8 bytes.

    A key LMDB can store is its own entry. One it cannot (empty, or longer than
    `MAX_KEY_BYTES`) becomes its first 478 bytes, 0xFF and its SHA-256: 511 bytes,
    unique, and still found by a prefix scan for a prefix of up to 478 bytes (the empty key
    is 0xFF and its digest).
    """
    if 0 < len(key) <= MAX_KEY_BYTES:
        return key
    return key[:_DIGEST_HEAD] + _DIGEST_MARK + hashlib.sha256(key).digest()


def seq_key(seq: int) -> bytes:
    """Encode a sequence number as an LMDB key (big-endian, so byte order is age order)."""
    return _SEQ.pack(seq)


def seq_keys(seqs: object) -> list[bytes]:
    """Encode many sequence numbers at once (vectorised: the batched read path calls this)."""
    import numpy as np

    if not isinstance(seqs, np.ndarray):
        pack = _SEQ.pack
        return [pack(seq) for seq in seqs]  # type: ignore[attr-defined]
    # The 8-byte void view turns into bytes objects in one C loop: 3x faster than slicing a
    # packed buffer in Python (0.05 us a key; it is per sample on the loader's hot path).
    keys: list[bytes] = seqs.astype(">u8", copy=False).view("V8").tolist()
    return keys


def seq_of(key: bytes) -> int:
    return int(_SEQ.unpack(key)[0])


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(raw: bytes | memoryview | None, default: int = 0) -> int:
    return default if raw is None else int(_U64.unpack(raw)[0])
