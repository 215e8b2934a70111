"""The ``tar`` layout: WebDataset-style shards, a sample being the members that share a prefix.

Members are grouped as webdataset does: the prefix is the member path up to the first dot of its
basename (``a/b/000123.seg.png`` -> prefix ``a/b/000123``, field ``seg.png``), consecutive members with
the same prefix form one sample, and field names are lowercased. The sample key is
``"<shard key>/<prefix>"`` so keys stay unique across shards.

Shards are listed (or brace-expanded) but not opened at listing time; fetching a shard ref reads the
shard once and yields every sample in it. Damage is contained: a sample with a truncated or invalid
member becomes a :class:`~epochcache.errors.CorruptSample`, and a shard whose header stream breaks
yields the samples before the break plus one ``CorruptSample`` for the rest.
"""

from __future__ import annotations

import io
import logging
import tarfile
from collections.abc import Iterator, Sequence

from epochcache.errors import CorruptSample, SourceError, SourceUnavailable
from epochcache.remote import call, fetch_many, retry
from epochcache.sources.base import FetchResult, SampleRef, Source
from epochcache.sources.check import check_checksum, check_format, check_size
from epochcache.sources.manifest import expand_braces

logger = logging.getLogger(__name__)


def split_member(name: str) -> tuple[str, str] | None:
    """``(prefix, field)`` of a member name as webdataset splits it, or None for names without a
    field (no dot in the basename) or hidden files."""
    directory, _, base = name.rpartition("/")
    if not base or base.startswith(".") or "." not in base:
        return None
    stem, _, field = base.partition(".")
    prefix = f"{directory}/{stem}" if directory else stem
    return prefix, field.lower()


def iter_shard(
    shard_key: str, data: bytes, *, check_formats: bool = True, url: str = ""
) -> Iterator[tuple[SampleRef, dict[str, bytes] | CorruptSample]]:
    """Yield ``(ref, fields or CorruptSample)`` for every sample of an in-memory tar shard."""
    current: str | None = None
    fields: dict[str, bytes] = {}
    members: list[str] = []
    error: str | None = None
    count = 0

    def finish() -> tuple[SampleRef, dict[str, bytes] | CorruptSample]:
        key = f"{shard_key}/{current}"
        ref = SampleRef(key, shard=shard_key, members=tuple(members))
        if error is not None:
            return ref, CorruptSample(f"{key}: {error} (in shard {shard_key})", url, key)
        if check_formats:
            try:
                for name, value in fields.items():
                    check_format(key, name, value, url)
            except CorruptSample as exc:
                return ref, exc
        return ref, dict(fields)

    try:
        # Not a `with`: the generator yields between open and close; `finally` below closes it.
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield (
            SampleRef(shard_key, shard=shard_key),
            CorruptSample(f"{shard_key}: not a readable tar shard ({exc})", url, shard_key),
        )
        return
    try:
        while True:
            member = archive.next()
            if member is None:
                break
            if not member.isfile():
                continue
            split = split_member(member.name)
            if split is None:
                continue
            prefix, field = split
            if prefix != current:
                if current is not None:
                    count += 1
                    yield finish()
                current, fields, members, error = prefix, {}, [], None
            members.append(member.name)
            handle = archive.extractfile(member)
            value = handle.read() if handle is not None else b""
            if len(value) != member.size:
                error = f"member {member.name!r} is truncated ({len(value)} of {member.size} bytes)"
            elif field in fields:
                error = f"duplicate field {field!r} (member {member.name!r})"
            else:
                fields[field] = value
    except (tarfile.TarError, EOFError, OSError) as exc:
        # The header stream is broken: the sample in progress cannot be trusted, and nothing
        # after it can be found. Earlier samples were yielded and stay valid.
        reason = (
            f"shard is truncated or damaged after {count} samples ({type(exc).__name__}: {exc})"
        )
        if current is not None:
            error = error or reason
            yield finish()
        else:
            yield (
                SampleRef(shard_key, shard=shard_key),
                CorruptSample(f"{shard_key}: {reason}", url, shard_key),
            )
        return
    finally:
        archive.close()
    # tarfile reads a truncated or garbled header after the first member as a normal end of
    # archive, so check that what follows the last member is the zero end-of-archive marker.
    tail = data[archive.offset :]
    if len(tail) < 512 or tail.strip(b"\0"):
        reason = (
            f"shard is truncated or damaged after {count} samples (no end-of-archive marker at "
            f"byte {archive.offset} of {len(data)})"
        )
        if current is None:
            yield (
                SampleRef(shard_key, shard=shard_key),
                CorruptSample(f"{shard_key}: {reason}", url, shard_key),
            )
            return
        error = error or reason
    if current is not None:
        yield finish()


class TarSource(Source):
    """WebDataset-style shards under ``source.url``.

    Shards come from ``source.manifest`` (one shard per row), else from ``source.shards`` (a brace
    pattern such as ``train-{000000..000554}.tar``), else from a listing matching ``source.pattern``
    (default ``**/*.tar``). ``list_keys`` returns one ref per shard; ``fetch_many`` returns one result
    per sample.
    """

    layout = "tar"
    unit = "shard"

    def list_keys(self) -> list[SampleRef]:
        cfg = self.config
        if cfg.manifest is not None:
            return self._read_manifest()
        if cfg.shards is None:
            return self._list_files(cfg.effective_pattern)
        keys = sorted(set(expand_braces(cfg.shards)))
        first = self.object_path(keys[0])
        try:
            # Brace patterns are for buckets too big to list: probe one shard, cheaply, to fail fast.
            retry(
                lambda: call(self.fs, "info", first, timeout_s=cfg.timeout_s),
                url=self.object_url(keys[0]),
                attempts=2,
                deadline_s=cfg.list_deadline_s,
            )
        except SourceError as exc:
            raise SourceUnavailable(
                f"{self.url}: the first shard of {cfg.shards!r} is not readable ({exc}); check "
                "source.url, source.shards and the endpoint",
                self.url,
            ) from exc
        return [SampleRef(key) for key in keys]

    def fetch_grouped(self, refs: Sequence[SampleRef]) -> list[list[FetchResult]]:
        """Read each shard once; one group per shard holding every sample in it.

        Shards are read whole: ``source.timeout_s`` bounds one shard's download, and a call holds
        up to ``len(refs)`` shards in memory, so pass few shard refs per call.
        """
        paths = [self.object_path(ref.key) for ref in refs]
        urls = {path: self.object_url(ref.key) for path, ref in zip(paths, refs)}
        fetched = fetch_many(
            self.fs,
            paths,
            concurrency=self.concurrency,
            timeout_s=self.config.timeout_s,
            url_of=urls.__getitem__,
        )
        self._throttle(sum(len(v) for _, v in fetched if isinstance(v, bytes)))
        groups: list[list[FetchResult]] = []
        for ref, (path, value) in zip(refs, fetched):
            url = urls[path]
            if isinstance(value, BaseException):
                error = (
                    value if isinstance(value, SourceError) else SourceError(f"{url}: {value}", url)
                )
                groups.append([(ref, error)])
                continue
            try:
                if "size" in self.checks:
                    check_size(ref.key, value, ref.size, url)
                if "checksum" in self.checks:
                    check_checksum(ref.key, value, ref.checksum, url)
            except CorruptSample as exc:
                logger.warning("%s: corrupt shard: %s", url, exc)
                groups.append([(ref, exc)])
                continue
            group: list[FetchResult] = []
            for sample_ref, payload in iter_shard(
                ref.key, value, check_formats="format" in self.checks, url=url
            ):
                if isinstance(payload, CorruptSample):
                    logger.warning("%s: corrupt sample: %s", url, payload)
                group.append((sample_ref, payload))
            groups.append(group)
        return groups
