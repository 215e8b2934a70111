"""Reading a WebDataset shard as a stream, member by member: what a shard costs in memory is one
member (and the sample it belongs to), whatever the shard's size.

Members are grouped as webdataset does: the prefix is the member path up to the first dot of
its basename (``a/b/000123.seg.png`` -> prefix ``a/b/000123``, field ``seg.png``), consecutive
members with the same prefix form one sample, and field names are lowercased. The sample key
is ``"<shard key>/<prefix>"`` so keys stay unique across shards.

Damage is contained: a sample with a truncated or invalid member becomes a
[`CorruptSample`][epochcache.CorruptSample], and a shard whose header stream breaks yields the
samples before the break plus one ``CorruptSample`` for the rest. A shard is someone else's
file, so what tarfile would hold whole is bounded too: a member larger than ``max_bytes`` is
skipped unread (its sample refused), and an extended header (a GNU long name, a PAX record)
larger than `MAX_HEADER_BYTES` ends the shard as damaged.

A failure of the stream itself (the network) is not damage: it is raised as
`ReadFailed`, for the caller to retry the shard.
"""

from __future__ import annotations

import collections
import io
import tarfile
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ...errors import CorruptSample
from ...limits import DEFAULT_MAX_SAMPLE_BYTES
from ...units import format_size
from ..bodies import RawReader
from ..types import Payload, SampleRef
from .check import check_format

#: The longest field name a record holds (its length is stored in 16 bits): a member whose
#: name would need more is quarantined with its sample, never handed to the encoder.
MAX_FIELD_BYTES = 0xFFFF
#: The largest extended header (GNU long name or link, PAX records) read: tarfile holds one
#: whole, and a name no filesystem could hold (4 KiB) fits many times over.
MAX_HEADER_BYTES = 1024 * 1024
#: Member names are cut to this many characters in messages (a name may be megabytes long).
_NAME_SHOWN = 120
#: What tarfile reads from the stream at a time (its default: its buffer is sliced on every
#: read, so a larger one costs more than the calls it saves; the stream is buffered below).
_READ_BYTES = tarfile.RECORDSIZE


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


class ReadFailed(Exception):
    """Reading the shard's stream failed (the original error is ``__cause__``): the shard is
    not damaged, its fetch failed."""


class Readable(Protocol):
    """What a shard is read from: a file object of the remote, or a `Tail` around one."""

    def read(self, size: int = -1, /) -> bytes: ...


class Tail(RawReader):
    """The shard's stream as tarfile reads it: counts the bytes, feeds ``on_bytes`` (a
    digest, a bandwidth limit), remembers what tarfile may have read past a header (its last
    reads, `_READ_BYTES` and two blocks), and turns a failed read into
    `ReadFailed` (tarfile would take an ``OSError`` for damage)."""

    def __init__(self, raw: Readable, on_bytes: Callable[[bytes], None] | None = None) -> None:
        super().__init__()
        self._raw, self._on_bytes = raw, on_bytes
        self.count = 0
        self._recent: collections.deque[tuple[int, bytes]] = collections.deque()  # (at, bytes)
        self._recent_bytes = 0

    def read(self, size: int = -1) -> bytes:
        try:
            data: bytes = self._raw.read(size)
        except Exception as exc:
            raise ReadFailed(f"{type(exc).__name__}: {exc}") from exc
        if data:
            if self._on_bytes is not None:
                self._on_bytes(data)
            self._recent.append((self.count, data))
            self._recent_bytes += len(data)
            while self._recent_bytes - len(self._recent[0][1]) >= _READ_BYTES + 2 * 512:
                self._recent_bytes -= len(self._recent.popleft()[1])
            self.count += len(data)
        return data

    def zeros_at(self, offset: int, size: int) -> bool:
        """Whether the ``size`` bytes at ``offset`` were read and are all zero (tarfile takes a
        truncated or garbled header after the first member for a normal end of archive, so
        what follows the last member must be the zero end-of-archive marker)."""
        if offset + size > self.count or not self._recent or offset < self._recent[0][0]:
            return False
        start = self._recent[0][0]
        seen = b"".join(data for _, data in self._recent)
        return not seen[offset - start : offset - start + size].strip(b"\0")

    def drain(self) -> None:
        """Read the rest of the stream (what follows the archive counts for its size and
        digest), a MiB at a time."""
        while self.read(1024 * 1024):
            pass


class _BoundedInfo(tarfile.TarInfo):
    """A tar header that refuses extended headers larger than `MAX_HEADER_BYTES`."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        extended = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                    tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
        if self.type in extended and self.size > MAX_HEADER_BYTES:
            raise tarfile.HeaderError(
                f"an extended header (a long name or PAX records) of {format_size(self.size)}, "
                f"more than the {format_size(MAX_HEADER_BYTES)} read")
        result: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return result


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


def shard_failure(shard_key: str, reason: str, url: str) -> tuple[SampleRef, CorruptSample]:
    """The result of a shard refused whole (its ref is the shard's)."""
    return SampleRef(shard_key, shard=shard_key), CorruptSample(f"{shard_key}: {reason}", url,
                                                                shard_key)


def _members(archive: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """``(member, prefix, field)`` of every file member that names a field, in order."""
    while (member := archive.next()) is not None:
        split = split_member(member.name) if member.isfile() else None
        if split is not None:
            yield member, split[0], split[1]


def iter_shard_ends(
    shard_key: str, data: bytes | Readable, *, check_formats: bool = True, url: str = "",
    max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES,
) -> Iterator[tuple[SampleRef, Payload | CorruptSample, int | None]]:
    """Yield ``(ref, fields or CorruptSample, end)`` for every sample of a tar shard, reading it
    as a stream (``data``: its bytes, or a file object read in order, never sought, or a `Tail`
    around one, to read its count afterwards). ``end`` is
    where the rest of the shard starts after the sample: the offset in the stream of the next
    sample's first header (a read resumed there goes on with the next sample), or None for the
    last sample and for damage.

    A member larger than ``max_bytes`` is not read: its sample becomes a CorruptSample.

    Raises:
        ReadFailed: the stream failed (not the shard): fetch it again.
    """
    tail = data if isinstance(data, Tail) else Tail(
        io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data)
    try:
        # Not a `with`: the generator yields between open and close; `finally` below closes it.
        archive = tarfile.open(fileobj=tail, mode="r|", bufsize=_READ_BYTES,  # noqa: SIM115
                               tarinfo=_BoundedInfo)
    except (tarfile.TarError, EOFError, OSError) as exc:
        yield (*shard_failure(shard_key, f"not a readable tar shard ({exc})", url), None)
        return
    sample: _Sample | None = None
    count = 0
    try:
        for member, prefix, field in _members(archive):
            if sample is None or prefix != sample.prefix:
                if sample is not None:
                    count += 1
                    # It is whole; what follows it starts at this member's header (unless a
                    # global PAX header came before: a read resumed there would miss it).
                    yield (*sample.result(check_formats, url, max_bytes),
                           None if archive.pax_headers else member.offset)
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
            yield (*shard_failure(shard_key, reason, url), None)
        else:
            sample.fail(reason)
            yield (*sample.result(check_formats, url, max_bytes), None)
        return
    finally:
        archive.close()
    if not tail.zeros_at(archive.offset, tarfile.BLOCKSIZE):
        reason = (f"shard is truncated or damaged after {count} samples (no end-of-archive marker "
                  f"at byte {archive.offset})")
        if sample is None:
            yield (*shard_failure(shard_key, reason, url), None)
            return
        sample.fail(reason)
    if sample is not None:
        yield (*sample.result(check_formats, url, max_bytes), None)


def sample_bytes(ref: SampleRef, payload: Any) -> int:
    """What one result holds in memory: its fields, key and member names."""
    held = len(ref.key) + sum(len(m) for m in ref.members)
    if isinstance(payload, dict):
        held += sum(len(v) for v in payload.values())
    return held
