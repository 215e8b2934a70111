"""The listing cache: a source's refs saved in the cache directory so a restart does not re-list.

One gzip'd JSON-lines file per source fingerprint under ``<cache_dir>/listings/``: a header line
(format version, fingerprint, count, creation time, blocks, gone), then one compact row per ref
(``[key, size, weight, checksum]``). Files are written atomically (temp file in the same directory,
then ``os.replace``), so a crash leaves the old listing or the new one, never half of one.

A listing only grows: re-listing a source (``source.listing_ttl_s``) appends the keys it did not
hold as a new *block* (sorted within it) and keeps every earlier ref at its index, so that
positions in the key order stay valid. ``blocks`` are the cumulative counts at the end of each
block (the first is the original listing); ``gone`` the indices of keys the last re-list did
not find (samplers skip them; they come back if the key does).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import SampleRef, SourceSpec

log = logging.getLogger(__name__)

LISTING_VERSION = 1
LISTING_DIR = "listings"


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
    return Path(cache_dir) / LISTING_DIR / f"{fingerprint}.jsonl.gz"


@dataclass
class Listing:
    """A saved listing: its refs in block order, where each block ends, which keys are gone.

    Attributes:
        refs: every ref ever listed, earlier blocks first.
        blocks: cumulative ref counts at the end of each block (``blocks[-1] == len(refs)``).
        gone: indices of refs the last listing did not find.
        created: when the source was last listed (seconds since the epoch).
    """

    refs: list[SampleRef]
    blocks: list[int] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    created: float = 0.0

    def __post_init__(self) -> None:
        if not self.blocks:
            self.blocks = [len(self.refs)]


def merge_listing(old: Listing, fresh: Sequence[SampleRef]) -> tuple[Listing, int]:
    """``old`` extended by a new listing of the same source, and how many keys are new.

    Refs already listed keep their index (their size and checksum are updated); new keys are
    appended as one block, sorted; keys missing from ``fresh`` are marked gone.
    """
    index = {ref.key: i for i, ref in enumerate(old.refs)}
    refs = list(old.refs)
    seen: set[int] = set()
    added = sorted((ref for ref in fresh if ref.key not in index), key=lambda r: r.key)
    for ref in fresh:
        i = index.get(ref.key)
        if i is not None:
            refs[i] = ref
            seen.add(i)
    refs.extend(added)
    blocks = list(old.blocks) + ([len(refs)] if added else [])
    gone = set(range(len(old.refs))) - seen
    return Listing(refs, blocks, gone, time.time()), len(added)


def save_listing(
    cache_dir: str | os.PathLike[str],
    fingerprint: str,
    refs: Sequence[SampleRef],
    *,
    blocks: Sequence[int] | None = None,
    gone: set[int] | None = None,
) -> Path:
    """Write ``refs`` (with their blocks and gone keys) atomically; return the file written."""
    path = listing_path(cache_dir, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "version": LISTING_VERSION,
        "fingerprint": fingerprint,
        "count": len(refs),
        "created": time.time(),
        "blocks": list(blocks) if blocks else [len(refs)],
        "gone": sorted(gone or ()),
    }
    fd, tmp = tempfile.mkstemp(prefix=".listing-", suffix=".tmp", dir=path.parent)
    try:
        with (
            os.fdopen(fd, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=5) as out,
        ):
            out.write(json.dumps(header).encode() + b"\n")
            for ref in refs:
                out.write(json.dumps(ref.to_row(), separators=(",", ":")).encode() + b"\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    log.info("saved listing of %d refs to %s", len(refs), path)
    return path


def load_listing(
    cache_dir: str | os.PathLike[str], fingerprint: str, *, max_age_s: float | None = None
) -> list[SampleRef] | None:
    """Return the saved refs, or None when there is no usable listing (missing, stale, damaged)."""
    listing = read_listing(cache_dir, fingerprint, max_age_s=max_age_s)
    return None if listing is None else listing.refs


def read_listing(
    cache_dir: str | os.PathLike[str], fingerprint: str, *, max_age_s: float | None = None
) -> Listing | None:
    """The saved :class:`Listing`, or None when there is none usable (missing, stale, damaged)."""
    path = listing_path(cache_dir, fingerprint)
    try:
        with gzip.open(path, "rb") as handle:
            header: dict[str, Any] = json.loads(handle.readline())
            if header.get("version") != LISTING_VERSION or header.get("fingerprint") != fingerprint:
                log.info("%s: listing from another version or source; re-listing", path)
                return None
            if max_age_s is not None and time.time() - float(header.get("created", 0)) > max_age_s:
                log.info("%s: listing older than %.0fs; re-listing", path, max_age_s)
                return None
            refs = [SampleRef.from_row(json.loads(line)) for line in handle if line.strip()]
    except FileNotFoundError:
        return None
    except (OSError, EOFError, ValueError, TypeError) as exc:
        log.warning("%s: unreadable listing (%s); re-listing", path, exc)
        return None
    if len(refs) != header.get("count"):
        log.warning(
            "%s: listing holds %d of %s refs; re-listing", path, len(refs), header.get("count")
        )
        return None
    blocks = [int(b) for b in header.get("blocks") or [len(refs)]]
    if not blocks or blocks[-1] != len(refs) or blocks != sorted(blocks):
        log.warning("%s: listing blocks %s do not match its %d refs; re-listing", path, blocks,
                    len(refs))
        return None
    gone = {int(i) for i in header.get("gone") or ()}
    return Listing(refs, blocks, gone, float(header.get("created", 0)))
