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

The payload is framed here too: zstandard, but only when that pays (a trial compression of
the first block keeps incompressible data, such as encoded images or float noise, raw without
a full pass over it), a crc32, and a tar sample's fields in one container. The codec is in the
header, so reading never guesses.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import zstandard

from ..errors import CacheCorrupted, SampleRejected

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
#: and deleted when a cache is opened for writing (`epochcache.store.capacity`).
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


try:
    # ISA-L computes zlib's CRC-32 with carry-less multiplication: the same checksums, ~15x
    # faster (1 MiB: 0.08 ms vs 1.2 ms), which was the largest cost of framing a large sample.
    from isal.isal_zlib import crc32
except ImportError:  # no isal wheel for this platform
    from zlib import crc32


#: A sample's value: the object's bytes, or a tar sample's fields by extension.
Value = bytes | Mapping[str, bytes]

#: Only compress when it saves at least this fraction of the bytes.
MIN_SAVING = 0.05
_PROBE_BYTES = 64 * 1024

_FIELDS_MAGIC = b"ECF1"
_FIELD_COUNT = struct.Struct("<I")
_FIELD_ENTRY = struct.Struct("<HQ")

_local = threading.local()
_unpack_header = HEADER.unpack_from
_pack_header = HEADER.pack
_HEADER_SIZE = HEADER.size
_RAW, _ZSTD, _FIELDS = int(Codec.RAW), int(Codec.ZSTD), int(RecordFlags.FIELDS)
if (HEADER.size, struct.calcsize("<BBHIQQ")) != (26, 24):
    raise ImportError("record header layout changed: update decode_payload's and record_key's "
                      "fast paths")


def _compressor(level: int) -> zstandard.ZstdCompressor:
    try:
        return _local.compressors[level]  # type: ignore[no-any-return]
    except (AttributeError, KeyError):
        cache = _local.__dict__.setdefault("compressors", {})
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
        return cache[level]  # type: ignore[no-any-return]


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "decompressor", None)
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    return dctx


def pack_fields(fields: Mapping[str, bytes]) -> bytes:
    """Serialise a tar sample's fields (``{"jpg": b"...", "cls": b"3"}``) into one payload."""
    names = [name.encode("utf-8") for name in fields]
    parts = [_FIELDS_MAGIC, _FIELD_COUNT.pack(len(names))]
    values = list(fields.values())
    for name, value in zip(names, values):
        parts.append(_FIELD_ENTRY.pack(len(name), len(value)))
        parts.append(name)
    parts.extend(bytes(v) for v in values)
    return b"".join(parts)


def field_spans(payload: bytes | memoryview) -> tuple[list[tuple[str, int, int]], int]:
    """Where each field of a `pack_fields` payload lies: ``([(name, start, length)],
    end of the table)``, offsets into ``payload``.

    Raises:
        CacheCorrupted: the container's magic number or lengths are wrong.
    """
    view = memoryview(payload)
    if bytes(view[:4]) != _FIELDS_MAGIC:
        raise CacheCorrupted("field container has a bad magic number")
    (count,) = _FIELD_COUNT.unpack_from(view, 4)
    offset = 4 + _FIELD_COUNT.size
    entries: list[tuple[str, int]] = []
    for _ in range(count):
        name_len, value_len = _FIELD_ENTRY.unpack_from(view, offset)
        offset += _FIELD_ENTRY.size
        entries.append((bytes(view[offset : offset + name_len]).decode("utf-8"), value_len))
        offset += name_len
    table_end = offset
    spans: list[tuple[str, int, int]] = []
    for name, value_len in entries:
        spans.append((name, offset, value_len))
        offset += value_len
    if offset != len(view):
        raise CacheCorrupted("field container length does not match its entries")
    return spans, table_end


def unpack_fields(payload: bytes | memoryview) -> dict[str, bytes]:
    """Inverse of `pack_fields`."""
    view = memoryview(payload)
    return {name: bytes(view[start : start + length])
            for name, start, length in field_spans(view)[0]}


class CompressionTrial:
    """Remembers, per kind of sample (the key's extension), whether compression pays.

    Incompressible samples (images, float noise from instruments) are common; probing each
    one costs a compression pass over 64 KiB (~13% of a sampler's main thread at 1 MiB per
    sample). After `TRIAL_MISSES` incompressible samples of a kind in a row, only one in
    `TRIAL_EVERY` of that kind is probed, so a change of content is still noticed; one
    that compresses ends the trial: every sample of the kind is tried again. One per writer
    (per sampler process).
    """

    __slots__ = ("_misses", "_skipped")

    def __init__(self) -> None:
        self._misses: dict[str, int] = {}
        self._skipped: dict[str, int] = {}

    @staticmethod
    def kind(key: str) -> str:
        """The extension of the key's last path segment (``""`` without one)."""
        base = key[key.rfind("/") + 1:]
        dot = base.rfind(".")
        return base[dot + 1:][:16] if dot >= 0 else ""

    def should_try(self, kind: str) -> bool:
        if self._misses.get(kind, 0) < TRIAL_MISSES:
            return True
        skipped = self._skipped.get(kind, 0) + 1
        if skipped >= TRIAL_EVERY:
            self._skipped[kind] = 0
            return True
        self._skipped[kind] = skipped
        return False

    def saw(self, kind: str, compressed: bool) -> None:
        if compressed:
            self._misses.pop(kind, None)
        elif len(self._misses) < 256 or kind in self._misses:  # bounded: keys without a kind
            self._misses[kind] = self._misses.get(kind, 0) + 1


#: Incompressible samples of a kind in a row before only some are tried, and how often one then
#: is anyway.
TRIAL_MISSES = 8
TRIAL_EVERY = 32


def encode_record(key: str, value: Value, *, level: int = 3, compress: bool = True,
                  trial: CompressionTrial | None = None) -> bytes:
    """Frame one sample as a record: header, source key, payload (zstd or raw).

    ``trial`` (optional) skips the compression attempt for kinds of samples that have not
    compressed lately (see `CompressionTrial`).
    """
    # Plain ints and a bytes check first: ABC isinstance checks and enum arithmetic cost
    # microseconds, as much as compressing a small sample.
    flags = 0
    if type(value) is bytes:
        raw = value
    elif isinstance(value, Mapping):
        raw = pack_fields(value)
        flags = _FIELDS
    else:
        raw = bytes(value)
    codec, payload = _RAW, raw
    kind = "" if trial is None else CompressionTrial.kind(key)
    if compress and len(raw) >= 128 and (trial is None or trial.should_try(kind)):
        cctx = _compressor(level)
        # Trial-compress a prefix first (a view: no copy): incompressible data is common and a
        # full pass over it would cost the sampler most of its CPU for nothing.
        worth_trying = True
        if len(raw) > 2 * _PROBE_BYTES:
            probe = cctx.compress(memoryview(raw)[:_PROBE_BYTES])
            worth_trying = len(probe) <= _PROBE_BYTES * (1 - MIN_SAVING)
        if worth_trying:
            packed = cctx.compress(raw)
            if len(packed) <= len(raw) * (1 - MIN_SAVING):
                codec, payload = _ZSTD, packed
        if trial is not None:
            trial.saw(kind, codec == _ZSTD)
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > 0xFFFF:
        raise SampleRejected(
            f"sample key {key[:80]!r}... is {len(key_bytes)} bytes long; a record holds keys of "
            "up to 65535 bytes (shorten the object's path)", key=key,
        )
    header = _pack_header(
        FORMAT_VERSION,
        codec,
        flags,
        crc32(payload),
        len(raw),
        time.time_ns(),
        len(key_bytes),
    )
    return b"".join((header, key_bytes, payload))


@dataclass(frozen=True)
class RecordInfo:
    """A record's metadata, without its payload."""

    key: str
    codec: Codec
    flags: RecordFlags
    crc32: int
    raw_size: int
    stored_size: int
    added_ns: int


def record_key(record: bytes | memoryview) -> bytes:
    """The key index entry of a record's source key (see `index_key`)."""
    return index_key(record_source_key(record))


def record_source_key(record: bytes | memoryview) -> bytes:
    """The source key stored in a record, as its UTF-8 bytes."""
    return bytes(record[_HEADER_SIZE : _HEADER_SIZE + (record[24] | record[25] << 8)])


def source_key(record: bytes | memoryview) -> str:
    """The source key stored in a record (``s/000123.npy``): for messages and reports."""
    return str(record_source_key(record), "utf-8", "replace")


def read_info(record: bytes | memoryview) -> RecordInfo:
    version, codec, flags, crc, raw_size, added_ns, _key_len = HEADER.unpack_from(record, 0)
    if version != FORMAT_VERSION:
        raise CacheCorrupted(f"record has format version {version}, expected {FORMAT_VERSION}")
    return RecordInfo(
        key=source_key(record),
        codec=Codec(codec),
        flags=RecordFlags(flags),
        crc32=crc,
        raw_size=raw_size,
        stored_size=len(record),
        added_ns=added_ns,
    )


def decode_payload(record: bytes | memoryview) -> bytes | dict[str, bytes]:
    """Return a record's raw payload: ``bytes``, or a dict of fields for tar samples.

    This is the read hot path: one header unpack, then one copy (raw) or one decompression.
    Plain ints, not the enums: an IntFlag ``&`` costs more than copying a 1 KiB sample.
    """
    # Fast path, a raw sample without fields: read the codec, flags and key length bytes
    # directly (offsets 1, 2 and 24 of the header) instead of unpacking all seven fields.
    if record[1] == _RAW and not record[2] & _FIELDS:
        return bytes(record[_HEADER_SIZE + (record[24] | record[25] << 8) :])
    _version, codec, flags, _crc, raw_size, _ns, key_len = _unpack_header(record)
    if codec == _RAW:
        raw = bytes(record[_HEADER_SIZE + key_len :])
    elif codec == _ZSTD:
        raw = _decompressor().decompress(record[_HEADER_SIZE + key_len :], max_output_size=raw_size)
    else:
        raise CacheCorrupted(f"record has unknown codec {codec}")
    if flags & _FIELDS:
        return unpack_fields(raw)
    return raw


def check_record(record: bytes | memoryview) -> RecordInfo:
    """Verify a record's checksum and sizes; raise [`CacheCorrupted`][epochcache.CacheCorrupted] if it is damaged."""
    if len(record) < HEADER.size:
        raise CacheCorrupted("record is shorter than its header")
    info = read_info(record)
    body = memoryview(record)[HEADER.size + (record[24] | record[25] << 8) :]
    if crc32(body) != info.crc32:
        raise CacheCorrupted(f"record {info.key!r}: checksum mismatch")
    try:
        raw = decode_payload(record)
    except zstandard.ZstdError as exc:
        raise CacheCorrupted(f"record {info.key!r}: cannot decompress: {exc}") from exc
    size = len(pack_fields(raw)) if isinstance(raw, dict) else len(raw)
    if size != info.raw_size:
        raise CacheCorrupted(f"record {info.key!r}: raw size {size} != header {info.raw_size}")
    return info
