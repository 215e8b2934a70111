"""The values every module of a source passes around: what a dataset is opened with
(`SourceSpec`), one fetchable unit (`SampleRef`), what its fetch gives (`FetchResult`), and
the `Piece`s a shard's samples are handed over in while it is read.

No layout (``layouts/``) and no listing module (`keytable`, `listing`, `paging`, `manifest`)
imports another to use these: they live here, below all of them, so that a new layout imports
them and nothing else of its siblings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SourceError
from ..limits import (
    DEFAULT_MANIFEST_MAX_BYTES,
    DEFAULT_MANIFEST_MAX_LINES,
    DEFAULT_MAX_BYTES_IN_FLIGHT,
    DEFAULT_MAX_SAMPLE_BYTES,
)
from ..redact import redact_options, redact_url
from ..registry import layout

#: what a fetch returns for one sample: whole-object bytes, or tar fields by extension
Payload = bytes | dict[str, bytes]


class Streamed:
    """The payload of a sample handed over already (a tar shard is streamed a piece at a time
    to the fetch's ``on_piece``): it stands in the fetch's results so that they still count
    every sample of the shard."""

    def __repr__(self) -> str:
        return "STREAMED"


STREAMED = Streamed()

CHECKS: tuple[str, ...] = ("size", "checksum", "format")


@dataclass(frozen=True)
class SourceSpec:
    """Where a remote dataset lives and how to read it: what a `Source` is opened with.

    The run config's ``source`` section converts to this at the edge
    (`epochcache.ingest.layouts.source_spec`); sources never see the config itself.

    Attributes:
        url: the dataset root, any fsspec URL or local path.
        layout: the name of its layout (`epochcache.registry.LAYOUTS`): ``files`` (one object
            per sample), ``tar`` (WebDataset shards)...
        pattern: glob under ``url``; None means the layout's (``**`` for files).
        shards: tar shards as a brace pattern (``train-{000..009}.tar``) instead of listing.
        manifest: URL, or path relative to ``url``, of a key manifest instead of listing.
        manifest_format: ``auto`` (by extension), ``txt``, ``csv``, ``jsonl`` or ``parquet``.
        storage_options: passed to fsspec; masked in ``repr``.
        timeout_s: per remote call.
        connect_timeout_s: per connection attempt.
        list_deadline_s: listing at start fails within this (an unreachable remote fails fast).
        retries: attempts per object for transient errors.
        checks: content checks on ingest, a subset of `CHECKS`.
        max_sample_bytes: the largest object (``files``) or tar member accepted, and the most a
            gzip or zip check decompresses; larger ones are quarantined, not downloaded.
        manifest_max_bytes: the most memory the keys of a manifest may take.
        manifest_max_lines: the most lines read from a manifest.
        client: who reads an ``s3://`` source's objects: ``auto``, ``s3fs`` or ``obstore``
            (`s3`).
        max_range_bytes: the largest range `Source.read_range` reads at once (a sampler's
            ``sampler.max_bytes_in_flight``): a layout's piece larger than that is refused.
    """

    url: str
    layout: str = "files"
    pattern: str | None = None
    shards: str | None = None
    manifest: str | None = None
    manifest_format: str = "auto"
    storage_options: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    list_deadline_s: float = 6.0
    retries: int = 5
    checks: Sequence[str] = CHECKS
    max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES
    manifest_max_bytes: int = DEFAULT_MANIFEST_MAX_BYTES
    manifest_max_lines: int = DEFAULT_MANIFEST_MAX_LINES
    client: str = "auto"
    max_range_bytes: int = DEFAULT_MAX_BYTES_IN_FLIGHT

    @property
    def effective_pattern(self) -> str:
        """The glob used for listing when no manifest or shard pattern is given (the
        layout's default, `epochcache.registry.Layout.pattern`)."""
        if self.pattern is not None:
            return self.pattern
        return layout(self.layout).pattern

    def __repr__(self) -> str:
        return (f"SourceSpec(url={redact_url(self.url)!r}, layout={self.layout!r}, "
                f"storage_options={redact_options(self.storage_options)!r})")


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One fetchable unit (an object, a tar shard, or a sample inside a shard).

    Attributes:
        key: path relative to the source root (a tar sample: ``"<shard>/<member prefix>"``).
        size: expected size in bytes of the fetched object, from a listing or manifest.
        weight: sampling weight from a manifest (``None`` reads as 1.0).
        checksum: expected digest of the fetched object, ``"algo:hex"`` or bare hex.
        shard: for a tar sample, the shard key it came from.
        members: for a tar sample, the member names that formed it.
    """

    key: str
    size: int | None = None
    weight: float | None = None
    checksum: str | None = None
    shard: str | None = None
    members: tuple[str, ...] = field(default=())

    def to_row(self) -> list[Any]:
        """Compact JSON-able form used by the listing cache."""
        return [self.key, self.size, self.weight, self.checksum]

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> SampleRef:
        """Inverse of `to_row`."""
        key, size, weight, checksum = (list(row) + [None, None, None])[:4]
        return cls(str(key), size, weight, checksum)


#: one fetched sample: its ref and its payload, or the error that replaced it (or STREAMED)
FetchResult = tuple[SampleRef, Payload | SourceError | Streamed]


#: Called with each piece of a shard, in the fetching thread: ``on_piece(piece)``, a
#: `Piece`. It may block (the sampler waits there for room in its in-flight budget).
OnPiece = Callable[["Piece"], None]
#: What a streaming layout's fetch hands over at a time, when the caller does not say.
PIECE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Piece:
    """A piece of a shard being read (of a tar shard's stream, or a Parquet file's row group):
    what the sampler needs to commit it and to say where each of its samples came from (its
    shard and ordinals, `origins`).

    Attributes:
        shard: the shard's listed ref.
        results: the piece's samples in shard order (corrupt ones as their errors).
        first: the shard ordinal of the first of them.
        members: how many samples the shard holds, on its last piece; before that, None (a tar
            shard is a stream: its count is known at its end).
    """

    shard: SampleRef
    results: list[FetchResult]
    first: int
    members: int | None = None
