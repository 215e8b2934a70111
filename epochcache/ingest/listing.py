"""The listing cache: a source's refs saved in the cache directory so a restart does not re-list.

One file per source fingerprint, ``<cache_dir>/listings/<fingerprint>.keys``: a magic line, a
JSON header (format version, fingerprint, generation, count, creation time, blocks, whether
the listing is complete and where an unfinished one goes on), then the columns of its
`KeyTable` (key bytes, key lengths, sizes; weights and checksums from
manifests; the indices of gone keys), each compressed with zstandard. Loading 1M keys takes
tens of milliseconds and no object per key (the gzip'd JSON lines of version 1 took seconds
and ~250 bytes a key); version 1 files are still read. Files are written atomically (temp
file in the same directory, then ``os.replace``), so a crash leaves the old listing or the new
one, never half of one.

A listing only grows: re-listing a source (``source.listing_ttl_s``) appends the keys it did not
hold as a new *block* (sorted within it) and keeps every earlier ref at its index, so that
positions in the key order stay valid. ``blocks`` are the cumulative counts at the end of each
block (the first is the original listing); ``gone`` the indices of keys the last re-list did
not find (samplers skip them; they come back if the key does).

A listing under way (a large bucket, `paging`) is saved as it goes: ``complete`` is
false, ``resume`` says where to go on, and each save adds the keys listed since as a block, so
samplers can start from them. The finished listing is saved sorted, as one block, under a new
``generation``: the key order starts afresh over all keys then (a saved sampler position names
the generation it belongs to).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from ..paths import atomic_write
from .keytable import KeyTable, KeyTableBuilder, compact_sizes, find_keys, offsets_of
from .types import SampleRef, SourceSpec

log = logging.getLogger(__name__)

LISTING_VERSION = 2
LISTING_DIR = "listings"
_MAGIC = b"EPOCHCACHE-LISTING\n"
#: Longest header accepted (the header names columns and blocks, never keys).
_MAX_HEADER = 64 * 1024 * 1024


def source_fingerprint(spec: SourceSpec) -> str:
    """A hash of what decides the listing: URL, layout, pattern, shards, manifest and endpoint.

    Credentials never enter it (they do not change what is listed, and the hash is written to disk).
    """
    options = spec.storage_options or {}
    client_kwargs = options.get("client_kwargs") or {}
    identity = {
        "url": spec.url,
        "layout": spec.layout,
        "pattern": spec.effective_pattern,
        "shards": spec.shards,
        "manifest": spec.manifest,
        "endpoint": options.get("endpoint_url") or client_kwargs.get("endpoint_url"),
    }
    encoded = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def listing_path(cache_dir: str | os.PathLike[str], fingerprint: str) -> Path:
    """Where the listing of a source with this fingerprint is kept."""
    return Path(cache_dir) / LISTING_DIR / f"{fingerprint}.keys"


def _v1_path(cache_dir: str | os.PathLike[str], fingerprint: str) -> Path:
    return Path(cache_dir) / LISTING_DIR / f"{fingerprint}.jsonl.gz"


def new_generation() -> str:
    """A fresh listing generation id (a listing made from scratch gets one)."""
    return uuid.uuid4().hex[:16]


@dataclass
class Listing:
    """A saved listing: its refs in block order, where each block ends, which keys are gone.

    Attributes:
        table: every ref ever listed, earlier blocks first.
        blocks: cumulative ref counts at the end of each block (``blocks[-1] == len(table)``).
        gone: indices of refs the last listing did not find.
        created: when the source was last listed (seconds since the epoch).
        generation: the id of the listing this one grew from; a sampler's saved position is
            valid only in the generation it was taken in.
        complete: False while a large bucket is still being listed.
        resume: where an unfinished listing goes on (see `paging`).
    """

    table: KeyTable
    blocks: list[int] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    created: float = 0.0
    generation: str = field(default_factory=new_generation)
    complete: bool = True
    resume: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.table, list):  # a list of refs (tests, small listings)
            self.table = KeyTable.from_refs(self.table)
        if not self.blocks:
            self.blocks = [len(self.table)]

    @property
    def refs(self) -> list[SampleRef]:
        """Every ref as an object (small listings and tests; samplers use `table`)."""
        return self.table.refs()

    def __len__(self) -> int:
        return len(self.table)


def merge_listing(old: Listing, fresh: KeyTable | Sequence[SampleRef]) -> tuple[Listing, int]:
    """``old`` extended by a new listing of the same source, and how many keys are new.

    Refs already listed keep their index (their size and checksum are updated); new keys are
    appended as one block, sorted; keys missing from ``fresh`` are marked gone.
    """
    if not isinstance(fresh, KeyTable):
        fresh = KeyTable.from_refs(fresh)
    match = find_keys(old.table, fresh)  # memory follows the keys' bytes (see there)
    found = match >= 0
    old_index = match[found]  # the old index of each fresh key already listed
    del match
    seen = np.zeros(len(old.table), dtype=bool)
    seen[old_index] = True
    added_idx = np.flatnonzero(~found)
    added = fresh.take(added_idx).sorted() if len(added_idx) else None
    if (old.table.weights is None and old.table.checksums is None
            and fresh.weights is None and fresh.checksums is None):
        # keys and sizes only (a listing): arrays, no ref per key
        sizes = old.table.sizes.astype(np.int64)  # a fresh size may need more than int32
        sizes[old_index] = fresh.sizes[found]
        kept = KeyTable(old.table.blob, old.table.offsets, compact_sizes(sizes))
    else:  # a manifest read again: every field of a listed ref is the fresh one
        now_at = np.full(len(old.table), -1, dtype=np.int64)
        now_at[old_index] = np.flatnonzero(found)
        builder = KeyTableBuilder()
        for i, j in enumerate(now_at.tolist()):
            ref = fresh.ref(j) if j >= 0 else old.table.ref(i)
            builder.add(old.table.key(i), ref.size, ref.weight, ref.checksum)
        kept = builder.build()
    table = kept if added is None else KeyTable.concat([kept, added])
    blocks = list(old.blocks) + ([len(table)] if added is not None else [])
    gone = {int(i) for i in np.flatnonzero(~seen)}
    return (Listing(table, blocks, gone, time.time(), old.generation),
            0 if added is None else len(added))


# -- the file --------------------------------------------------------------------------------


def save_listing(
    cache_dir: str | os.PathLike[str],
    fingerprint: str,
    refs: Listing | KeyTable | Sequence[SampleRef],
    *,
    blocks: Sequence[int] | None = None,
    gone: set[int] | None = None,
) -> Path:
    """Write a listing atomically; return the file written. ``refs`` is a whole
    `Listing` (its blocks, gone keys, generation and state are saved), or a table or
    list of refs saved as a complete listing with ``blocks`` and ``gone``."""
    if isinstance(refs, Listing):
        listing = refs
    else:
        table = refs if isinstance(refs, KeyTable) else KeyTable.from_refs(refs)
        listing = Listing(table, list(blocks or []), set(gone or ()), time.time())
    path = listing_path(cache_dir, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = listing.table
    cctx = zstandard.ZstdCompressor(level=1)
    columns: list[tuple[str, str, bytes]] = [
        ("blob", "bytes", table.blob),
        ("lengths", "<u4", np.diff(table.offsets.astype(np.int64)).astype("<u4").tobytes()),
        ("sizes", table.sizes.dtype.newbyteorder("<").str,
         table.sizes.astype(table.sizes.dtype.newbyteorder("<")).tobytes()),
        ("gone", "<i8", np.array(sorted(listing.gone), dtype="<i8").tobytes()),
    ]
    if table.weights is not None:
        columns.append(("weights", "<f8", table.weights.astype("<f8").tobytes()))
    if table.checksums is not None:
        blob, offsets = table.checksums
        columns.append(("checksums", "bytes", blob))
        columns.append(("checksum_lengths", "<u4",
                        np.diff(offsets.astype(np.int64)).astype("<u4").tobytes()))
    header: dict[str, Any] = {
        "version": LISTING_VERSION,
        "fingerprint": fingerprint,
        "generation": listing.generation,
        "count": len(table),
        "created": listing.created or time.time(),
        "blocks": list(listing.blocks),
        "complete": listing.complete,
        "resume": listing.resume,
        "columns": [],
    }
    parts: list[bytes] = []
    for name, dtype, raw in columns:
        packed = cctx.compress(raw)
        header["columns"].append({"name": name, "dtype": dtype, "raw": len(raw),
                                  "stored": len(packed)})
        parts.append(packed)
    head = json.dumps(header, separators=(",", ":")).encode()
    with atomic_write(path, prefix=".listing-", suffix=".tmp") as out:
        out.write(_MAGIC + len(head).to_bytes(8, "little") + head)
        for part in parts:
            out.write(part)
    with contextlib.suppress(OSError):
        _v1_path(cache_dir, fingerprint).unlink()  # superseded
    log.debug("saved listing of %d refs to %s", len(table), path)
    return path


def read_listing_header(cache_dir: str | os.PathLike[str],
                        fingerprint: str) -> dict[str, Any] | None:
    """The header of the saved listing (count, blocks, generation, complete, ...) without its
    keys, or None when there is no version-2 file."""
    try:
        with open(listing_path(cache_dir, fingerprint), "rb") as handle:
            return _read_header(handle, fingerprint)
    except (OSError, ValueError):
        return None


def _read_header(handle: Any, fingerprint: str) -> dict[str, Any]:
    if handle.read(len(_MAGIC)) != _MAGIC:
        raise ValueError("not an epochcache listing")
    size = int.from_bytes(handle.read(8), "little")
    if not 0 < size <= _MAX_HEADER:
        raise ValueError(f"listing header of {size} bytes")
    header: dict[str, Any] = json.loads(handle.read(size))
    if header.get("version") != LISTING_VERSION or header.get("fingerprint") != fingerprint:
        raise LookupError("listing from another version or source")
    return header


def read_listing(cache_dir: str | os.PathLike[str], fingerprint: str) -> Listing | None:
    """The saved `Listing`, or None when there is none usable (missing, of another version or
    source, damaged)."""
    path = listing_path(cache_dir, fingerprint)
    try:
        with open(path, "rb") as handle:
            header = _read_header(handle, fingerprint)
            listing = _read_columns(handle, header)
    except FileNotFoundError:
        return _read_v1(cache_dir, fingerprint)
    except LookupError:
        log.info("%s: listing from another version or source; re-listing", path)
        return None
    except (OSError, EOFError, ValueError, TypeError, KeyError, zstandard.ZstdError) as exc:
        log.warning("%s: unreadable listing (%s); re-listing", path, exc)
        return None
    blocks = listing.blocks
    if not blocks or blocks[-1] != len(listing.table) or blocks != sorted(blocks):
        log.warning("%s: listing blocks %s do not match its %d refs; re-listing", path, blocks,
                    len(listing.table))
        return None
    return listing


def _read_columns(handle: Any, header: dict[str, Any]) -> Listing:
    """The columns after the header, decompressed one at a time; the arrays are views of the
    decompressed bytes, and nothing of 8 bytes a key is made on the way (a sampler's heap
    keeps its peak: see `process`)."""
    dctx = zstandard.ZstdDecompressor()
    count = int(header["count"])
    columns: dict[str, np.ndarray | bytes] = {}
    for column in header["columns"]:
        stored = handle.read(int(column["stored"]))
        if len(stored) != int(column["stored"]):
            raise EOFError(f"column {column['name']} is truncated")
        raw = dctx.decompress(stored, max_output_size=int(column["raw"]))
        del stored
        name, dtype = column["name"], column["dtype"]
        if dtype == "bytes":
            columns[name] = raw
        elif name.endswith("lengths"):  # offsets at once: the lengths go
            blob = columns["blob" if name == "lengths" else "checksums"]
            lengths = np.frombuffer(raw, dtype=dtype)
            if len(lengths) != count or int(lengths.sum()) != len(blob):
                raise ValueError(f"column {name} does not hold the {count} refs the header says")
            columns[name] = offsets_of(lengths, len(blob))
            del lengths, raw
        else:
            columns[name] = np.frombuffer(raw, dtype=dtype)
    blob, offsets, sizes = columns["blob"], columns["lengths"], columns["sizes"]
    assert isinstance(blob, bytes) and isinstance(offsets, np.ndarray)
    assert isinstance(sizes, np.ndarray)
    if len(sizes) != count:
        raise ValueError(f"columns do not hold the {count} refs the header says")
    weights = columns.get("weights")
    checksums = None
    if "checksums" in columns:
        checksums = (columns["checksums"], columns["checksum_lengths"])
    table = KeyTable(blob, offsets, sizes, weights,  # type: ignore[arg-type]
                     checksums)  # type: ignore[arg-type]
    gone_column = columns["gone"]
    assert isinstance(gone_column, np.ndarray)
    gone = {int(i) for i in gone_column}
    blocks = [int(b) for b in header.get("blocks") or [count]]
    return Listing(table, blocks, gone, float(header.get("created", 0)),
                   str(header.get("generation") or ""), bool(header.get("complete", True)),
                   header.get("resume"))


def _read_v1(cache_dir: str | os.PathLike[str], fingerprint: str) -> Listing | None:
    """A listing saved by epochcache before version 2 (gzip'd JSON lines)."""
    path = _v1_path(cache_dir, fingerprint)
    try:
        with gzip.open(path, "rb") as handle:
            header: dict[str, Any] = json.loads(handle.readline())
            if header.get("version") != 1 or header.get("fingerprint") != fingerprint:
                log.info("%s: listing from another version or source; re-listing", path)
                return None
            table = KeyTable.from_refs(SampleRef.from_row(json.loads(line))
                                       for line in handle if line.strip())
    except FileNotFoundError:
        return None
    except (OSError, EOFError, ValueError, TypeError) as exc:
        log.warning("%s: unreadable listing (%s); re-listing", path, exc)
        return None
    if len(table) != header.get("count"):
        log.warning("%s: listing holds %d of %s refs; re-listing", path, len(table),
                    header.get("count"))
        return None
    blocks = [int(b) for b in header.get("blocks") or [len(table)]]
    if not blocks or blocks[-1] != len(table) or blocks != sorted(blocks):
        log.warning("%s: listing blocks %s do not match its %d refs; re-listing", path, blocks,
                    len(table))
        return None
    gone = {int(i) for i in header.get("gone") or ()}
    # Positions saved with a version-1 listing carry no generation: they stay valid.
    return Listing(table, blocks, gone, float(header.get("created", 0)), "")
