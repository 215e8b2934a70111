"""The ``tar`` layout: WebDataset-style shards, a sample being the members that share a prefix.

Shards are listed (or brace-expanded) but not opened at listing time; fetching a shard ref reads
the shard as a stream, member by member (`shards`: grouping, damage, bounds), and yields
every sample in it. A shard is never held whole: with ``on_piece`` (the sampler's), its samples
are handed over a piece of ``piece_bytes`` at a time as they are read, so what a shard of any
size costs is a piece, one member and the read-ahead of its stream (`bodies.READ_AHEAD_BYTES`), and
``sampler.max_bytes_in_flight`` bounds the pieces waiting for the cache. A shard whose manifest
names a checksum is the exception: it cannot be trusted before its last byte is read, so its
samples are held (as much as the shard, and reserved so) until the checksum matches; the
listed size is checked at the end of the stream (a shard that is shorter than listed keeps the
samples read before the break; the rest is refused as damaged).

A remote shard is read as one streamed GET (`bodies`: each request through the source's
request gate and counted there, a deadline on silence, not on the shard's length). A failed
read of the stream (the network) fails the shard's fetch, to be retried; samples already handed
over are not lost, and are not read again: the next fetch of the shard resumes it from the
byte after the last sample handed over (a ranged GET), its results led by stand-ins for the
samples handed before. A shard held whole until its checksum matches is read again from its
start, and so is one whose size changed in between.

A manifest may name single samples as well as shards (``train-000.tar/000123``, as
``epochcache manifest`` prints an epoch's keys): their shards are listed, and fetching one
yields only the samples the manifest names (`SampleFilter`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ...errors import CorruptSample, PermanentRemoteError, SourceError, SourceUnavailable
from ...limits import cut_text
from ..bodies import BodyReader, ObjectChanged
from ..concurrency import Outcome
from ..keytable import KeyTable, KeyTableBuilder, head_width, key_heads
from ..localfiles import OPEN_FLAGS
from ..manifest import expand_braces
from ..remote import call, outcome_of, reached_remote, retry, translate_error, translate_errors
from ..s3 import obstore_refuses_key
from ..types import PIECE_BYTES, STREAMED, FetchResult, OnPiece, Piece, SampleRef
from .base import Source
from .check import StreamDigest
from .shards import ReadFailed, Tail, iter_shard_ends, sample_bytes

log = logging.getLogger(__name__)

#: Shards whose read failed after handing pieces over, kept to resume them (the oldest go first).
MAX_RESUMES = 1024

@dataclass(frozen=True)
class _Resume:
    """Where the read of a shard goes on after it failed.

    Attributes:
        offset: the byte after the last sample handed over (the next sample's header).
        ordinal: the shard ordinal of the next sample.
        handed: samples handed over before (their stand-ins lead the results).
        size: the shard's size the failed read was told (a shard that changed since is read
            from its start).
    """

    offset: int
    ordinal: int
    handed: int
    size: int | None


#: What separates a shard's key from a sample's name in a sample key (``<shard>.tar/<name>``).
_SHARD_END = ".tar/"


def split_sample_key(key: str) -> tuple[str, str] | None:
    """``(shard key, sample name)`` of a sample key (``a/train-000.tar/000123``), or None for
    a shard key."""
    at = key.find(_SHARD_END)
    if at < 0 or at + len(_SHARD_END) == len(key):
        return None
    return key[: at + 4], key[at + len(_SHARD_END):]


class SampleFilter:
    """The samples a manifest names inside shards: a shard it names whole yields every
    sample; one it names samples of yields those only. The sample keys are held as sorted
    fixed-width heads of the usual key's width plus the few longer keys as they are
    (`head_width`): memory follows the keys' bytes, never their count times
    the longest (a manifest is someone else's input).

    Args:
        table: the manifest's refs.
    """

    def __init__(self, table: KeyTable) -> None:
        whole: set[str] = set()
        samples = KeyTableBuilder()
        shards: set[str] = set()
        for key in table.keys():
            split = split_sample_key(key)
            if split is None:
                whole.add(key)
            else:
                samples.add(key)
                shards.add(split[0])
        self.whole = whole
        self.shards = sorted(whole | shards)
        named = samples.build()
        lengths = named.lengths()
        self._width = head_width(lengths)
        short = np.flatnonzero(lengths <= self._width)
        self._heads = np.sort(key_heads(named.blob, named.offsets, short, self._width))
        self._long = {named.blob[int(named.offsets[i]) : int(named.offsets[i + 1])]
                      for i in np.flatnonzero(lengths > self._width).tolist()}

    @property
    def filters(self) -> bool:
        """Whether the manifest names any single sample."""
        return bool(len(self._heads) or self._long)

    def wants(self, shard: str, sample_key: str) -> bool:
        if shard in self.whole:
            return True
        raw = sample_key.encode("utf-8")
        if len(raw) > self._width:
            return raw in self._long
        at = int(np.searchsorted(self._heads, raw))
        return at < len(self._heads) and bytes(self._heads[at]) == raw


class TarSource(Source):
    """WebDataset-style shards under ``source.url``.

    Shards come from ``source.manifest`` (one shard per row), else from ``source.shards`` (a brace
    pattern such as ``train-{000000..000554}.tar``), else from a listing matching ``source.pattern``
    (default ``**/*.tar``). ``list_table`` holds one ref per shard; ``fetch_many`` returns one result
    per sample.
    """

    unit = "shard"
    _filter: SampleFilter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: shards whose read failed after handing pieces over: where to go on (by shard key)
        self._resumes: dict[str, _Resume] = {}

    def list_table(self) -> KeyTable:
        cfg = self.spec
        if cfg.manifest is not None:
            table = self._read_manifest()
            self._filter = SampleFilter(table)
            if not self._filter.filters:
                return table
            return KeyTable.from_refs(map(SampleRef, self._filter.shards))
        if cfg.shards is None:
            return super().list_table()
        keys = sorted(set(expand_braces(cfg.shards)))
        first = self.object_path(keys[0])
        try:
            # Brace patterns are for buckets too big to list: probe one shard, cheaply, to fail fast.
            retry(
                lambda: self._probe(first),
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
        return KeyTable.from_refs(map(SampleRef, keys))

    def _probe(self, path: str) -> Any:
        """The metadata of one shard (a HEAD), counted when a remote received it."""
        remote = self._local_root is None
        try:
            info = call(self.fs, "info", path, timeout_s=self.spec.timeout_s)
        except BaseException as exc:
            self.gate.stats.add(heads=int(remote and reached_remote(exc)))
            raise
        self.gate.stats.add(heads=int(remote))
        return info

    def sample_filter(self) -> SampleFilter | None:
        """The samples a manifest names in shards (read again in a sampler process, which
        samples the saved listing of shards), or None without a manifest."""
        if self.spec.manifest is None:
            return None
        if self._filter is None:
            self._filter = SampleFilter(self._read_manifest())
        return self._filter

    def fetch_grouped(self, refs: Sequence[SampleRef], on_piece: OnPiece | None = None,
                      piece_bytes: int = PIECE_BYTES) -> list[list[FetchResult]]:
        """Every sample of each shard in ``refs``, one list per shard, the shards streamed at
        once (up to ``concurrency``). With ``on_piece``, a shard's samples go to it a piece of
        ``piece_bytes`` at a time as they are read, and stand in the list as ``STREAMED``
        (see the module docstring)."""
        resolved: dict[str, str] = {}  # see Source.refusal
        return self._unless_refused(refs, resolved, lambda todo: self._each(
            todo, lambda ref: self._stream_shard(ref, resolved, on_piece, piece_bytes),
            "epochcache-shard"))

    def held_bytes(self, ref: SampleRef, size: int, piece_bytes: int) -> int:
        """Nothing up front: each piece takes its bytes when it is handed over (a reservation
        could fill the budget that the shard's own pieces wait for). A shard whose checksum
        must be verified first is held whole: all of it."""
        return size if self._verified_first(ref) else 0

    def _verified_first(self, ref: SampleRef) -> bool:
        return bool(ref.checksum) and "checksum" in self.checks

    def _stream_shard(self, ref: SampleRef, resolved: dict[str, str], on_piece: OnPiece | None,
                      piece_bytes: int) -> list[FetchResult]:
        """One shard's samples (see `fetch_grouped`), resumed where its last read failed.

        A remote shard's requests pass the source's request gate one by one (its slots, its
        pace after throttling, the daemon's request budget) and are counted there (`bodies`),
        as the files layout's reads are; a filesystem without a stream to offer (``memory://``)
        is read as a file, as one request."""
        refused = self._obstore_refuses(ref)
        if refused is not None:
            return [(ref, refused)]
        resume = self._resumes.pop(ref.key, None)
        if resume is not None and self._verified_first(ref):
            resume = None
        received = [0]
        if self._local_root is not None:
            self.gate.stats.add(gets=1)
            return self._read_shard(ref, resolved, on_piece, piece_bytes, received, resume)
        if self.body_opener(ref) is not None:
            try:
                return self._read_shard(ref, resolved, on_piece, piece_bytes, received, resume)
            except ObjectChanged:
                return self._read_shard(ref, resolved, on_piece, piece_bytes, received, None)
        started = self.gate.enter_sync()
        outcome, sent = Outcome.ERROR, True
        try:
            results = self._read_shard(ref, resolved, on_piece, piece_bytes, received, resume)
            failed = results[-1][1] if results and results[-1][0] is ref else None
            outcome = (outcome_of(failed) if isinstance(failed, SourceError)
                       and not isinstance(failed, CorruptSample) else Outcome.OK)
            sent = reached_remote(failed)
            return results
        finally:
            self.gate.leave_sync(started, outcome, received[0], streamed=True, sent=sent)

    def _obstore_refuses(self, ref: SampleRef) -> PermanentRemoteError | None:
        """The refusal of a shard obstore cannot name, under ``client: obstore`` (as the files
        layout refuses such an object: `Source._fetch_remote`)."""
        if self._obstore is None or self.spec.client == "auto":
            return None
        why = obstore_refuses_key(self.object_path(ref.key))
        return self._unnamed(self.object_url(ref.key), why) if why else None

    def _read_shard(self, ref: SampleRef, resolved: dict[str, str], on_piece: OnPiece | None,
                    piece_bytes: int, received: list[int],
                    resume: _Resume | None = None) -> list[FetchResult]:
        url = self.object_url(ref.key)
        digest = None
        if self._verified_first(ref):
            assert ref.checksum is not None
            try:
                digest = StreamDigest(ref.key, ref.checksum, url)
            except CorruptSample as exc:
                return [(ref, exc)]
        # A checksum is known only at the end: such a shard is held until then.
        streams = on_piece is not None and digest is None
        wanted = self.sample_filter()
        if wanted is not None and wanted.filters and ref.key not in wanted.whole:
            def wants(key: str) -> bool:
                return key == ref.key or wanted.wants(ref.key, key)
        else:
            def wants(key: str) -> bool:
                return True
        base = resume.offset if resume is not None else 0
        try:
            raw = self._open_shard(ref, resolved, base, None if resume is None else resume.size)
        except SourceError as exc:
            return [(ref, exc)]

        def on_bytes(data: bytes) -> None:
            received[0] += len(data)
            self.gate.received(len(data))
            if digest is not None:
                digest.update(data)
            self._throttle(len(data))

        tail = Tail(raw, on_bytes)
        stand_in = SampleRef(ref.key, shard=ref.key)  # one for all: no key or names kept
        # stand-ins of the samples on_piece has (those of an earlier read first)
        handed: list[FetchResult] = [(stand_in, STREAMED)] * (resume.handed if resume else 0)
        pending: list[FetchResult] = []
        ordinal = resume.ordinal if resume is not None else 0  # of the first sample in pending
        held = 0
        pending_end: int | None = None  # where the shard goes on after pending's last sample
        resume_at: int | None = None  # ... after the last sample handed over
        try:
            with raw:
                for sample_ref, payload, end in iter_shard_ends(
                        ref.key, tail, check_formats="format" in self.checks, url=url,
                        max_bytes=self.max_sample_bytes):
                    if isinstance(payload, CorruptSample):
                        log.warning("%s: corrupt sample: %s", url, cut_text(str(payload)))
                    elif not wants(sample_ref.key):
                        continue  # a manifest names other samples of this shard
                    size = sample_bytes(sample_ref, payload)
                    # A piece goes when the next sample would take it past piece_bytes, so the
                    # shard's last piece is always handed after its end, with the count.
                    if streams and pending and held + size > piece_bytes:
                        assert on_piece is not None
                        on_piece(Piece(ref, pending, ordinal))
                        handed.extend((stand_in, STREAMED) for _ in pending)
                        ordinal += len(pending)
                        pending, held = [], 0
                        resume_at = None if pending_end is None else base + pending_end
                    pending.append((sample_ref, payload))
                    held += size
                    pending_end = end
                if ("size" in self.checks and ref.size is not None) or digest is not None:
                    tail.drain()  # what follows the archive counts too
        except ReadFailed as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, ObjectChanged):
                raise cause from None
            if streams and resume_at is not None:
                self._keep_resume(ref.key, _Resume(resume_at, ordinal, len(handed),
                                                   getattr(raw, "size", None)))
            error = translate_error(cause, url)
            return [*handed, (ref, error)] if handed else [(ref, error)]
        problem = None
        if "size" in self.checks and ref.size is not None and base + tail.count != ref.size:
            problem = CorruptSample(
                f"{ref.key}: size mismatch: got {base + tail.count} bytes, the listing says "
                f"{ref.size} (truncated or changed object)", url, ref.key)
        elif digest is not None:
            problem = digest.mismatch()
        if problem is not None:
            log.warning("%s", cut_text(f"{url}: corrupt shard: {problem}", keys=(ref.key,)))
            return [*handed, (ref, problem)]  # what was not handed over is dropped
        if streams and pending:
            assert on_piece is not None
            on_piece(Piece(ref, pending, ordinal, ordinal + len(pending)))
            handed.extend((stand_in, STREAMED) for _ in pending)
            pending = []
        return handed + pending

    def _keep_resume(self, key: str, resume: _Resume) -> None:
        self._resumes[key] = resume
        while len(self._resumes) > MAX_RESUMES:
            del self._resumes[next(iter(self._resumes))]

    def _open_shard(self, ref: SampleRef, resolved: dict[str, str], offset: int = 0,
                    size: int | None = None) -> BinaryIO:
        """The shard as a stream from byte ``offset``: a local file opened at the path its
        root check resolved (a link met here is checked like one met by a read: see
        Source._read_local), else the remote object's body (`bodies`; ``size``: the size it
        must still have, else `ObjectChanged`), or a file of a synchronous filesystem.

        Raises:
            SourceError: it cannot be opened (translated, URL named); a ``CorruptSample`` when
                a link leads out of the root.
        """
        path = self.object_path(ref.key)
        url = self.object_url(ref.key)
        if self._local_root is not None:
            path = resolved.get(path, path)
            try:
                try:
                    fd = os.open(path, OPEN_FLAGS)
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    real = os.path.realpath(path)
                    if self._outside_root(real):
                        raise self._leaves_root(ref.key, f"it resolves to {real}") from None
                    fd = os.open(real, OPEN_FLAGS)
                if offset:
                    os.lseek(fd, offset, os.SEEK_SET)
                return os.fdopen(fd, "rb", buffering=1024 * 1024)
            except OSError as exc:
                raise translate_error(exc, url) from exc
        opener = self.body_opener(ref)
        if opener is not None:
            loop = self.fetch_fs.loop
            return BodyReader(opener, self.gate, loop, url=url,  # type: ignore[return-value]
                              timeout_s=self.spec.timeout_s, offset=offset, expect_size=size,
                              throttled_for_s=self.throttled_for_s)
        with translate_errors(url):
            handle: BinaryIO = self.fs.open(path, "rb")
            if offset:
                handle.seek(offset)
        return handle
