"""The Source interface: enumerate the sample references of a remote dataset and fetch them.

A source never raises for one bad object: :meth:`Source.fetch_many` returns one
``(ref, payload or exception)`` per result, where the exception is a :class:`~epochcache.errors.SourceError`
(``CorruptSample``, ``PermanentRemoteError``, ``RemoteTimeout``, ``SourceUnavailable``) so that the
sampler can quarantine, count, retry or skip it. Payloads:

* ``files`` layout: ``bytes``, the whole object;
* ``tar`` layout: ``dict[str, bytes]``, field (extension after the first dot, lowercased) -> bytes,
  e.g. ``{"npy": ..., "cls": ...}``.

The *unit of fetching* differs by layout: a ``files`` source lists one ref per object; a ``tar``
source lists one ref per shard (listing every member would mean reading every shard), and fetching a
shard ref yields one result per sample in it, each with its own ref (``shard`` and ``members`` set).
Sampling without replacement over shards still covers every sample once per pass.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

from epochcache.errors import SourceError, SourceUnavailable
from epochcache.remote import call, open_fs, redact_options, retry

if TYPE_CHECKING:
    from epochcache.config import SourceConfig

logger = logging.getLogger(__name__)

Payload = Union[bytes, dict[str, bytes]]
FetchResult = tuple["SampleRef", Union[Payload, SourceError]]


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
        """Inverse of :meth:`to_row`."""
        key, size, weight, checksum = (list(row) + [None, None, None])[:4]
        return cls(str(key), size, weight, checksum)


class Source(abc.ABC):
    """A remote dataset reachable through fsspec.

    Args:
        config: the validated ``source`` section of the config.
        concurrency: requests in flight in one :meth:`fetch_many` call.
    """

    layout: Literal["files", "tar"]
    #: what one listed ref stands for: a single sample or a shard of samples
    unit: Literal["sample", "shard"]

    def __init__(self, config: SourceConfig, *, concurrency: int = 16) -> None:
        self.config = config
        self.concurrency = concurrency
        self.url = config.url
        self.fs, self.root = open_fs(
            config.url,
            config.storage_options,
            timeout_s=config.timeout_s,
            connect_timeout_s=config.connect_timeout_s,
        )

    # -- listing ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def list_keys(self) -> list[SampleRef]:
        """Enumerate the refs to sample from, sorted by key, from the manifest or a listing.

        Raises:
            SourceUnavailable: the endpoint, bucket or prefix is unreachable or nothing matches;
                raised within a few seconds, the message names the URL and the pattern.
        """

    @abc.abstractmethod
    def fetch_many(self, refs: Sequence[SampleRef]) -> list[FetchResult]:
        """Fetch and check ``refs`` concurrently; one result per sample, errors returned not raised."""

    # -- helpers shared by the layouts -----------------------------------------------------------

    def object_url(self, key: str) -> str:
        """The full URL of a key (for messages and logs)."""
        return self.url.rstrip("/") + "/" + key

    def object_path(self, key: str) -> str:
        """The filesystem path of a key."""
        return self.root.rstrip("/") + "/" + key if self.root else key

    def _list_files(self, pattern: str) -> list[SampleRef]:
        """List objects under the root whose relative path matches ``pattern``; fail fast if none."""
        from epochcache.sources.manifest import glob_to_regex

        regex = glob_to_regex(pattern)
        cfg = self.config

        def find() -> dict[str, Any]:
            found: dict[str, Any] = call(self.fs, "find", self.root, detail=True, timeout_s=cfg.timeout_s)
            return found

        try:
            # Listing at start must fail fast (invariant 5): two attempts within a short deadline.
            infos = retry(find, url=self.url, attempts=2, deadline_s=cfg.list_deadline_s, base_s=0.2)
        except SourceError as exc:
            raise SourceUnavailable(
                f"{self.url}: cannot list objects matching {pattern!r} ({exc}); check source.url, "
                f"the endpoint and credentials in storage_options {redact_options(cfg.storage_options)}",
                self.url,
            ) from exc
        prefix = self.root.rstrip("/") + "/" if self.root else ""
        refs: list[SampleRef] = []
        for path, info in infos.items():
            if info.get("type", "file") != "file":
                continue
            rel = path[len(prefix) :] if prefix and path.startswith(prefix) else path
            if regex.match(rel):
                size = info.get("size")
                refs.append(SampleRef(rel, int(size) if size is not None else None))
        if not refs:
            raise SourceUnavailable(
                f"{self.url}: no keys match {pattern!r} ({len(infos)} objects under the prefix); "
                "check source.url (bucket and prefix exist) and source.pattern",
                self.url,
            )
        refs.sort(key=lambda r: r.key)
        logger.info("%s: listed %d keys matching %r", self.url, len(refs), pattern)
        return refs

    def _read_manifest(self) -> list[SampleRef]:
        from epochcache.sources.manifest import read_manifest

        manifest = self.config.manifest
        if manifest is None:
            raise ValueError("no manifest configured")
        if "://" in manifest or manifest.startswith("/"):
            fs, path = open_fs(
                manifest,
                self.config.storage_options,
                timeout_s=self.config.timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
            )
            url = manifest
        else:
            fs, path, url = self.fs, self.object_path(manifest), self.object_url(manifest)
        refs = read_manifest(
            fs,
            path,
            url=url,
            fmt=self.config.manifest_format,
            deadline_s=self.config.list_deadline_s,
            timeout_s=self.config.timeout_s,
        )
        refs.sort(key=lambda r: r.key)
        return refs

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"
