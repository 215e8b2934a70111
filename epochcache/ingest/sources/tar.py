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
from collections.abc import Iterator

from ...errors import CorruptSample, SourceError, SourceUnavailable
from ...limits import DEFAULT_MAX_SAMPLE_BYTES, cut_text
from ...units import format_size
from ..remote import call, retry
from .base import FetchResult, Payload, SampleRef, Source
from .check import check_checksum, check_format, check_size
from .keytable import KeyTable, KeyTableBuilder
from .manifest import expand_braces

log = logging.getLogger(__name__)

#: The longest field name a record holds (its length is stored in 16 bits): a member whose
#: name would need more is quarantined with its sample, never handed to the encoder.
MAX_FIELD_BYTES = 0xFFFF
#: Member names are cut to this many characters in messages (a name may be megabytes long).
_NAME_SHOWN = 120


def _shown(name: str) -> str:
    if len(name) <= _NAME_SHOWN:
        return repr(name)
    return f"{name[:_NAME_SHOWN]!r}... ({len(name):,} characters)"


def split_member(name: str) -> tuple[str, str] | None:
    """``(prefix, field)`` of a member name as webdataset splits it, or None for names without a
    field (no dot in the basename) or hidden files."""
    directory, _, base = name.rpartition("/")
    if not base or base.startswith(".") or "." not in base:
        return None
    stem, _, field = base.partition(".")
    prefix = f"{directory}/{stem}" if directory else stem
    return prefix, field.lower()


class _Sample:
    """The members of one sample, as they are read from a shard."""

    def __init__(self, shard_key: str, prefix: str) -> None:
        self.shard_key, self.prefix = shard_key, prefix
        self.key = f"{shard_key}/{prefix}"
        self.fields: dict[str, bytes] = {}
        self.members: list[str] = []
        self.error: str | None = None

    def add(self, member: tarfile.TarInfo, field: str, value: bytes) -> None:
        self.members.append(member.name)
        if len(value) != member.size:
            self.fail(f"member {_shown(member.name)} is truncated ({len(value)} of "
                      f"{member.size} bytes)")
        elif field in self.fields:
            self.fail(f"duplicate field {_shown(field)} (member {_shown(member.name)})")
        else:
            self.fields[field] = value

    def fail(self, reason: str) -> None:
        self.error = self.error or reason  # the first problem is the one worth reporting

    def result(self, check_formats: bool, url: str,
               max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> tuple[SampleRef, Payload | CorruptSample]:
        ref = SampleRef(self.key, shard=self.shard_key, members=tuple(self.members))
        if self.error is not None:
            return ref, CorruptSample(f"{self.key}: {self.error} (in shard {self.shard_key})", url,
                                      self.key)
        if check_formats:
            try:
                for name, value in self.fields.items():
                    check_format(self.key, name, value, url, max_bytes)
            except CorruptSample as exc:
                return ref, exc
        return ref, self.fields


def _shard_failure(shard_key: str, reason: str, url: str) -> tuple[SampleRef, CorruptSample]:
    return SampleRef(shard_key, shard=shard_key), CorruptSample(f"{shard_key}: {reason}", url,
                                                                shard_key)


def _members(archive: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """``(member, prefix, field)`` of every file member that names a field, in order."""
    while (member := archive.next()) is not None:
        split = split_member(member.name) if member.isfile() else None
        if split is not None:
            yield member, split[0], split[1]


def _ends_cleanly(data: bytes, offset: int) -> bool:
    # tarfile reads a truncated or garbled header after the first member as a normal end of
    # archive, so what follows the last member must be the zero end-of-archive marker.
    tail = data[offset:]
    return len(tail) >= 512 and not tail.strip(b"\0")


def iter_shard(
    shard_key: str, data: bytes, *, check_formats: bool = True, url: str = "",
    max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES,
) -> Iterator[tuple[SampleRef, Payload | CorruptSample]]:
    """Yield ``(ref, fields or CorruptSample)`` for every sample of an in-memory tar shard.

    A member larger than ``max_bytes`` is not read: its sample becomes a CorruptSample.
    """
    try:
        # Not a `with`: the generator yields between open and close; `finally` below closes it.
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield _shard_failure(shard_key, f"not a readable tar shard ({exc})", url)
        return
    sample: _Sample | None = None
    count = 0
    try:
        for member, prefix, field in _members(archive):
            if sample is None or prefix != sample.prefix:
                if sample is not None:
                    count += 1
                    yield sample.result(check_formats, url, max_bytes)  # it is whole
                sample = _Sample(shard_key, prefix)
            if member.size > max_bytes:
                sample.members.append(member.name)
                sample.fail(f"member {_shown(member.name)} is {format_size(member.size)}, larger "
                            f"than the {format_size(max_bytes)} a sample may be "
                            "(loader.max_sample_bytes, or cache.capacity when smaller)")
                continue
            if len(field.encode("utf-8", "surrogateescape")) > MAX_FIELD_BYTES:
                sample.members.append(member.name)
                sample.fail(f"member {_shown(member.name)} has a field name of "
                            f"{len(field.encode('utf-8', 'surrogateescape')):,} bytes; a record "
                            f"holds field names of up to {MAX_FIELD_BYTES:,} bytes")
                continue
            handle = archive.extractfile(member)
            sample.add(member, field, handle.read() if handle is not None else b"")
    except (tarfile.TarError, EOFError, OSError) as exc:
        # The header stream is broken: the sample in progress cannot be trusted, and nothing
        # after it can be found. Earlier samples were yielded and stay valid.
        reason = f"shard is truncated or damaged after {count} samples ({type(exc).__name__}: {exc})"
        if sample is None:
            yield _shard_failure(shard_key, reason, url)
        else:
            sample.fail(reason)
            yield sample.result(check_formats, url, max_bytes)
        return
    finally:
        archive.close()
    if not _ends_cleanly(data, archive.offset):
        reason = (f"shard is truncated or damaged after {count} samples (no end-of-archive marker "
                  f"at byte {archive.offset} of {len(data)})")
        if sample is None:
            yield _shard_failure(shard_key, reason, url)
            return
        sample.fail(reason)
    if sample is not None:
        yield sample.result(check_formats, url, max_bytes)


class TarSource(Source):
    """WebDataset-style shards under ``source.url``.

    Shards come from ``source.manifest`` (one shard per row), else from ``source.shards`` (a brace
    pattern such as ``train-{000000..000554}.tar``), else from a listing matching ``source.pattern``
    (default ``**/*.tar``). ``list_table`` holds one ref per shard; ``fetch_many`` returns one result
    per sample.
    """

    layout = "tar"
    unit = "shard"

    def list_table(self) -> KeyTable:
        cfg = self.spec
        if cfg.manifest is not None:
            return self._read_manifest()
        if cfg.shards is None:
            return self._list_files()
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
        builder = KeyTableBuilder()
        for key in keys:
            builder.add(key)
        return builder.build()

    def _unpack(self, ref: SampleRef, url: str, data: bytes) -> list[FetchResult]:
        """Every sample of one shard. Shards are read whole: ``timeout_s`` bounds one shard's
        download, and a fetch holds its shards in memory, so samplers fetch few at a time."""
        try:
            if "size" in self.checks:
                check_size(ref.key, data, ref.size, url)
            if "checksum" in self.checks:
                check_checksum(ref.key, data, ref.checksum, url)
        except CorruptSample as exc:
            log.warning("%s", cut_text(f"{url}: corrupt shard: {exc}", keys=(ref.key,)))
            return [(ref, exc)]
        group: list[FetchResult] = []
        for sample_ref, payload in iter_shard(ref.key, data, check_formats="format" in self.checks,
                                              url=url, max_bytes=self.max_sample_bytes):
            if isinstance(payload, CorruptSample):
                log.warning("%s: corrupt sample: %s", url, cut_text(str(payload)))
            group.append((sample_ref, payload))
        return group
