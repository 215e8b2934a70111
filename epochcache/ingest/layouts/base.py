"""The Source interface: enumerate the sample references of a remote dataset and fetch them.

A source never raises for one bad object: `Source.fetch_many` returns one
``(ref, payload or exception)`` per result, where the exception is a [`SourceError`][epochcache.SourceError]
(``CorruptSample``, ``PermanentRemoteError``, ``RemoteTimeout``, ``SourceUnavailable``) so that the
sampler can quarantine, count, retry or skip it. Payloads:

* ``bytes``: the whole object (``files``);
* ``dict[str, bytes]``: a sample of fields, field -> bytes, e.g. ``{"npy": ..., "cls": ...}``
  (``tar``: a member's extension after the first dot, lowercased; other layouts say theirs).

The *unit of fetching* differs by layout: a ``files`` source lists one ref per object; a ``tar``
source lists one ref per shard (listing every member would mean reading every shard), and fetching a
shard ref yields one result per sample in it, each with its own ref (``shard`` and ``members`` set).
Sampling without replacement over shards still covers every sample once per pass.

A source is someone else's bucket, so what it lists is not trusted (`Source.refusal`):

* a key that leaves the source root (an absolute path, a ``..`` segment, or on a local
  filesystem a path that resolves outside the root, through a symlink) is never read: it
  becomes a ``CorruptSample`` that says why, which the sampler quarantines (counted, logged with
  its key) while the daemon goes on with the other keys;
* a ``files`` object listed larger than ``spec.max_sample_bytes`` is refused the same way before
  it is downloaded, and of an object whose size is not listed at most that many bytes (plus
  one) are read, so that one larger is refused without being held whole. Tar shards are
  streamed, never held whole (a shard holds many samples); their members are bounded (see
  ``tar`` and ``shards``).
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import fsspec

from ...errors import CorruptSample, PermanentRemoteError, SourceError, Throttled
from ...redact import redact_url
from ...units import format_size
from ..bodies import BodyReader, Opener, open_body, read_span
from ..concurrency import FixedConcurrency, Outcome
from ..keytable import KeyTable
from ..localfiles import LocalFiles
from ..manifest import read_manifest
from ..paging import Pager, list_all, make_pager
from ..remote import (
    TRANSIENT_ERRORS,
    call,
    fetch_many,
    open_fs,
    outcome_of,
    reached_remote,
    retry,
    translate_error,
    translate_errors,
)
from ..requests import BandwidthLimiter, RequestGate, backoff_delays
from ..s3 import (
    bucket_region,
    obstore_filesystem,
    obstore_refuses_key,
    obstore_store,
    resolve_client,
)
from ..types import FetchResult, SampleRef, SourceSpec

log = logging.getLogger(__name__)

T = TypeVar("T")

class Source:
    """A remote dataset reachable through fsspec.

    Args:
        spec: where the dataset is and how to read it.
        concurrency: requests in flight at most (``sampler.concurrency``; its `gate` may be
            replaced by one with an ``auto`` concurrency, a request budget and shared
            counters: the sampler's feed does).
        checks: content checks to run (``size``, ``checksum``, ``format``); defaults to
            ``spec.checks``; ``()`` turns them off.
        bandwidth_limit: bytes per second this source may read on average (this process
            only; None: unlimited).
    """

    #: what one listed ref stands for: a single sample or a shard of samples
    unit: Literal["sample", "shard"]

    def __init__(
        self,
        spec: SourceSpec,
        *,
        concurrency: int = 16,
        checks: Sequence[str] | None = None,
        bandwidth_limit: float | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: must be at least 1, got {concurrency}")
        self.spec = spec
        #: every object read passes through it (requests in flight, pace, budget, counting)
        self.gate = RequestGate(FixedConcurrency(concurrency))
        #: how long a throttled object is asked for again before it counts as failed
        self.throttled_for_s = spec.timeout_s * 4
        self.checks = frozenset(spec.checks if checks is None else checks)
        self.limiter = BandwidthLimiter(bandwidth_limit) if bandwidth_limit else None
        # What messages, logs and the cache show: credentials in the URL masked. fsspec gets
        # the real one (spec.url) below.
        self.url = redact_url(spec.url)
        self.fs, self.root = open_fs(
            spec.url,
            spec.storage_options,
            timeout_s=spec.timeout_s,
            connect_timeout_s=spec.connect_timeout_s,
        )
        # Who reads the objects (listing stays with self.fs): obstore's settings, or None.
        self._obstore = resolve_client(spec.client, spec.url, spec.storage_options,
                                       field=f"source.client of {self.url}",
                                       timeout_s=spec.timeout_s,
                                       connect_timeout_s=spec.connect_timeout_s)
        self._fetch_fs: fsspec.AbstractFileSystem | None = None
        self._said_s3fs_keys = False  # the log line of `_fetch_remote`, once
        self.max_sample_bytes = spec.max_sample_bytes
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        # Local paths are resolved (symlinks) before reading: a link may lead out of the root.
        local = "file" in protocols or "local" in protocols
        self._local_root = os.path.realpath(self.root or "/") if local else None
        self._root_prefix = (self._local_root or "/").rstrip("/") + "/"
        # ...and read with the OS's calls, not through fsspec and a thread per file (see there).
        self._local_files = LocalFiles(concurrency) if local else None

    @property
    def concurrency(self) -> int:
        """Requests in flight at most, now."""
        return self.gate.slots

    @property
    def client(self) -> str:
        """Who reads the objects: ``obstore``, or the filesystem's protocol (s3fs: ``s3``)."""
        if self._obstore is not None:
            return "obstore"
        protocol = self.fs.protocol
        return protocol if isinstance(protocol, str) else protocol[0]

    @property
    def fetch_fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem objects are read with (made at the first read: a daemon that only
        lists never builds it)."""
        if self._fetch_fs is None:
            settings = self._obstore
            if settings is not None and not settings.region_given:
                # A HEAD of the bucket, charged and counted like any request of the source.
                started = self.gate.enter_sync()
                region = bucket_region(self.fs, self.root.split("/", 1)[0], self.spec.timeout_s)
                self.gate.leave_sync(started, Outcome.OK, kind="heads", sent=region is not None)
                settings = settings.in_region(region) if region else settings
                self._obstore = settings
            self._fetch_fs = self.fs if settings is None else obstore_filesystem(settings)
        return self._fetch_fs

    def obstore_store(self, bucket: str) -> Any:
        """obstore's store of ``bucket`` for streamed bodies (`s3.obstore_store`), made
        once; the source must read with obstore."""
        self.fetch_fs  # noqa: B018 - the settings in the bucket's region
        assert self._obstore is not None
        stores: dict[str, Any] = self.__dict__.setdefault("_obstore_stores", {})
        if bucket not in stores:
            stores[bucket] = obstore_store(self._obstore, bucket)
        return stores[bucket]

    # -- listing ---------------------------------------------------------------------------------

    def list_table(self) -> KeyTable:
        """Enumerate the refs to sample from, sorted by key, from the manifest or a listing
        (page by page, see `paging`), as a compact `KeyTable`.

        Raises:
            SourceUnavailable: the endpoint, bucket or prefix is unreachable or nothing matches;
                raised within a few seconds, the message names the URL and the pattern.
        """
        return self._read_manifest() if self.spec.manifest is not None else list_all(self)

    def list_keys(self) -> list[SampleRef]:
        """`list_table` as a list of refs (small sources and tests)."""
        return self.list_table().refs()

    @property
    def paged(self) -> bool:
        """Whether this source is listed page by page (no manifest, no shard pattern): such a
        listing may be saved as it goes, resumed, and sampled before it ends."""
        return self.spec.manifest is None and self.spec.shards is None

    def pager(self, state: dict[str, Any] | None = None) -> Pager:
        """The pages of this source's listing, resumed at ``state`` (see `paging`)."""
        return make_pager(self.fs, self.root, self._local_root is not None, state)

    # -- fetching --------------------------------------------------------------------------------

    def fetch_grouped(self, refs: Sequence[SampleRef], on_piece: Any = None,
                      piece_bytes: int = 0) -> list[list[FetchResult]]:
        """Like `fetch_many`, but one list of results per input ref (a shard gives many).
        ``on_piece`` and ``piece_bytes`` are for layouts that stream a ref's samples (``tar``);
        whole objects ignore them."""
        resolved: dict[str, str] = {}  # per call: most keys of a batch share a directory
        return self._unless_refused(refs, resolved, lambda todo: self._fetch_objects(
            todo, resolved))

    def _unless_refused(self, refs: Sequence[SampleRef], resolved: dict[str, str],
                        fetch: Callable[[list[SampleRef]], list[list[FetchResult]]]
                        ) -> list[list[FetchResult]]:
        """``fetch`` of the refs `refusal` lets through, each refused one as its refusal, in
        the order of ``refs``."""
        refused = {i: error for i, ref in enumerate(refs)
                   if (error := self.refusal(ref, resolved))}
        done = iter(fetch([ref for i, ref in enumerate(refs) if i not in refused]))
        return [[(ref, refused[i])] if i in refused else next(done) for i, ref in enumerate(refs)]

    def _each(self, refs: Sequence[SampleRef], one: Callable[[SampleRef], list[FetchResult]],
              name: str) -> list[list[FetchResult]]:
        """``one(ref)`` of each ref, up to `concurrency` at once (threads named ``name``)."""
        if len(refs) < 2:
            return [one(ref) for ref in refs]
        with ThreadPoolExecutor(max_workers=min(len(refs), self.concurrency),
                                thread_name_prefix=name) as pool:
            return list(pool.map(one, refs))

    def _fetch_objects(self, todo: list[SampleRef], resolved: dict[str, str]
                       ) -> list[list[FetchResult]]:
        """Whole objects, read and unpacked (`fetch_grouped` of the refs not refused)."""
        paths = [self.object_path(ref.key) for ref in todo]
        urls = [self.object_url(ref.key) for ref in todo]
        # files: one byte more than accepted when the size is not listed (see the module doc)
        limits = [self.max_sample_bytes + 1 if self.unit == "sample" and ref.size is None
                  else None for ref in todo]
        fetched: list[bytes | SourceError]
        if self._local_files is not None:
            fetched = self._read_local(todo, [resolved.get(p, p) for p in paths], limits, urls)
            self.gate.stats.add(gets=len(todo), bytes=sum(
                len(value) for value in fetched if isinstance(value, bytes)))
        else:
            fetched = self._fetch_remote(paths, urls, limits)
        self._throttle(sum(len(value) for value in fetched if isinstance(value, bytes)))
        return [[(ref, value)] if isinstance(value, SourceError) else self._unpack(ref, url, value)
                for ref, url, value in zip(todo, urls, fetched)]

    def _fetch_remote(self, paths: list[str], urls: list[str], limits: list[int | None]
                      ) -> list[bytes | SourceError]:
        """Read objects with the source's client. Keys obstore cannot name are read with s3fs
        under ``client: auto`` and refused (quarantined, the key named) under ``obstore``."""
        url_of = dict(zip(paths, urls)).__getitem__

        def fetch(fs: fsspec.AbstractFileSystem, indices: list[int]
                  ) -> list[bytes | SourceError]:
            return fetch_many(fs, [paths[i] for i in indices], timeout_s=self.spec.timeout_s,
                              url_of=url_of, limits=[limits[i] for i in indices],
                              gate=self.gate, throttled_for_s=self.throttled_for_s)

        unnamed = ({} if self._obstore is None else
                   {i: why for i, path in enumerate(paths) if (why := obstore_refuses_key(path))})
        if not unnamed:
            return fetch(self.fetch_fs, list(range(len(paths))))
        results: dict[int, bytes | SourceError] = {}
        named = [i for i in range(len(paths)) if i not in unnamed]
        results.update(zip(named, fetch(self.fetch_fs, named)))
        if self.spec.client == "auto":
            if not self._said_s3fs_keys:
                self._said_s3fs_keys = True
                log.info("%s: keys obstore cannot name (%s: %s) are read with s3fs "
                         "(source.client: auto)", self.url, urls[next(iter(unnamed))],
                         next(iter(unnamed.values())))
            results.update(zip(unnamed, fetch(self.fs, list(unnamed))))
        else:
            results.update((i, self._unnamed(urls[i], why)) for i, why in unnamed.items())
        return [results[i] for i in range(len(paths))]

    @staticmethod
    def _unnamed(url: str, why: str) -> PermanentRemoteError:
        """The refusal of a key obstore cannot name, under ``client: obstore``."""
        return PermanentRemoteError(f"{url}: obstore cannot name this key ({why}); it is not "
                                    "read (source.client: auto or s3fs reads it)", url)

    def _read_local(self, refs: Sequence[SampleRef], paths: list[str],
                    limits: list[int | None], urls: list[str]) -> list[bytes | SourceError]:
        """Read local files at the paths the root check resolved. The reads follow no link
        (localfiles): a file that is a link is resolved here, refused if it leads out of the
        root, else read at its target (an ``lstat`` of every file first cost 10% of a
        one-thread fetch, frame and put loop at 64 KiB; links are rare)."""
        assert self._local_files is not None
        timeout_s = self.spec.timeout_s
        values = self._local_files.read_many(paths, limits, timeout_s)
        for i, value in enumerate(values):
            if isinstance(value, OSError) and value.errno == errno.ELOOP:
                real = os.path.realpath(paths[i])
                if self._outside_root(real):
                    values[i] = self._leaves_root(refs[i].key, f"it resolves to {real}")
                else:
                    values[i] = self._local_files.read_many([real], [limits[i]], timeout_s)[0]
        return [translate_error(value, url) if isinstance(value, BaseException) else value
                for value, url in zip(values, urls)]

    # -- ranged reads: a layout that reads an object in pieces (Parquet row groups) -------------

    def body_opener(self, ref: SampleRef) -> Opener | None:
        """How ``ref``'s remote body is opened from a byte (`bodies.open_body`), or None for a
        synchronous filesystem. A key obstore cannot name is read with s3fs (``client: auto``;
        obstore would read another key: `s3.obstore_refuses_key`)."""
        path = self.object_path(ref.key)
        if self._obstore is None or obstore_refuses_key(path):
            return open_body(self.fs if self._obstore is not None else self.fetch_fs, path)
        return open_body(self.fetch_fs, path, self.obstore_store(path.split("/", 1)[0]))

    def object_size(self, ref: SampleRef) -> int:
        """The size of ``ref``'s object in bytes: as listed, else the filesystem's (a remote's
        ``HEAD``, through the gate and counted as one, retried as a fetch is).

        Raises:
            SourceError: the size cannot be had (translated, the URL named); a
                ``CorruptSample`` for a key that leaves the source root.
        """
        if ref.size is not None:
            return ref.size
        path, url = self._range_path(ref), self.object_url(ref.key)
        if self._local_root is not None:
            with translate_errors(url):
                return os.stat(path).st_size

        def head() -> int:
            info = self._request(lambda: call(self.fs, "info", path,
                                              timeout_s=self.spec.timeout_s), url, "heads")
            return int(info["size"])

        return retry(head, url=url, attempts=self.spec.retries)

    def _request(self, fn: Callable[[], T], url: str, kind: str = "gets") -> T:
        """``fn()`` as one request through the gate (its slot, pace and budget), counted
        under ``kind`` with the bytes it returned when it reached the remote."""
        started = self.gate.enter_sync()
        try:
            value = fn()
        except BaseException as exc:
            self.gate.leave_sync(started, outcome_of(translate_error(exc, url)), kind=kind,
                                 sent=reached_remote(exc))
            raise
        self.gate.leave_sync(started, Outcome.OK, len(value) if isinstance(value, bytes) else 0,
                             kind=kind)
        return value

    def read_range(self, ref: SampleRef, start: int, end: int) -> bytes | bytearray:
        """Bytes ``start`` to ``end`` (exclusive) of ``ref``'s object, fewer when it ends
        first (a ``bytearray`` when read from a remote: filled in place, not copied), without
        reading the rest of it: one ranged request through the gate (its slot,
        pace and budget; counted as a GET, its bytes as received) with a deadline on silence
        (`bodies`), retried with backoff while it fails transiently (``source.retries``);
        a local file is read with ``pread``, bounded in time as a whole read is.

        Raises:
            SourceError: the range cannot be read (translated, the URL named); a
                ``CorruptSample`` for a key that leaves the source root or a range larger
                than ``spec.max_range_bytes``.
        """
        if not 0 <= start <= end:
            raise ValueError(f"read_range: bad range [{start}, {end})")
        path, url = self._range_path(ref), self.object_url(ref.key)
        if end - start > self.spec.max_range_bytes:
            raise CorruptSample(
                f"{ref.key}: refused: a range of {format_size(end - start)} at byte {start:,}, "
                f"more than the {format_size(self.spec.max_range_bytes)} a sampler holds in "
                "flight (sampler.max_bytes_in_flight); not downloaded", url, ref.key)
        if start == end:
            return b""
        value: bytes | bytearray
        if self._local_root is not None:
            assert self._local_files is not None
            read = self._local_files.read_many([path], [end], self.spec.timeout_s, [start])[0]
            if isinstance(read, BaseException):
                raise translate_error(read, url) from read
            value = read
            self.gate.stats.add(gets=1, bytes=len(value))
        else:
            opener = self.body_opener(ref)
            value = retry(lambda: self._read_remote_range(opener, path, url, start, end),
                          url=url, attempts=self.spec.retries)
        self._throttle(len(value))
        return value

    def _read_remote_range(self, opener: Opener | None, path: str, url: str, start: int,
                           end: int) -> bytes | bytearray:
        """One try of `read_range` on a remote (or a synchronous filesystem's) object."""
        if opener is None:  # memory:// and the like: one call, as a request
            return self._request(lambda: bytes(self.fs.cat_file(path, start=start, end=end)),
                                 url)
        return read_span(BodyReader(opener, self.gate, self.fetch_fs.loop, url=url,
                                    timeout_s=self.spec.timeout_s, offset=start, end=end,
                                    throttled_for_s=self.throttled_for_s))

    def _range_path(self, ref: SampleRef) -> str:
        """The path ``ref`` is read at by a ranged read, once its key is checked (see
        `refusal`; a local file that is a link is resolved and checked as well)."""
        resolved: dict[str, str] = {}
        refused = self.refusal(ref, resolved)
        if refused is not None:
            raise refused
        path = self.object_path(ref.key)
        path = resolved.get(path, path)
        if self._local_root is not None and os.path.islink(path):
            real = os.path.realpath(path)
            if self._outside_root(real):
                raise self._leaves_root(ref.key, f"it resolves to {real}")
            path = real
        return path

    def held_bytes(self, ref: SampleRef, size: int, piece_bytes: int) -> int:
        """What fetching ``ref`` (of ``size`` bytes, listed or estimated) holds at once, when
        pieces of ``piece_bytes`` are handed over as they are read (see ``tar``): the whole
        object, for layouts that fetch whole objects."""
        return size

    def refusal(self, ref: SampleRef,
                resolved: dict[str, str] | None = None) -> CorruptSample | None:
        """Why ``ref`` must not be read (None: it may): a key that leaves the source root, or a
        ``files`` object listed larger than ``max_sample_bytes``. On a local filesystem,
        ``resolved`` collects the real paths of the directories met and of the files to read
        (kept for one batch, so that a link swapped in later is not missed for long)."""
        key = ref.key
        escape = self._escape(key, {} if resolved is None else resolved)
        if escape:
            return self._leaves_root(key, escape)
        if self.unit == "sample" and ref.size is not None and ref.size > self.max_sample_bytes:
            return self.too_large(key, ref.size, self.object_url(key), "listed as")
        return None

    def _leaves_root(self, key: str, how: str) -> CorruptSample:
        return CorruptSample(
            f"{key}: refused: the key leaves the source root {self.url} ({how}); it is never "
            "read (fix the manifest or listing that names it)", self.object_url(key), key)

    def _outside_root(self, real: str) -> bool:
        return real != self._local_root and not real.startswith(self._root_prefix)

    def too_large(self, key: str, size: int, url: str, how: str) -> CorruptSample:
        """The refusal of a sample larger than ``max_sample_bytes``."""
        return CorruptSample(
            f"{key}: refused: {how} {format_size(size)}, larger than the "
            f"{format_size(self.max_sample_bytes)} a sample may be (loader.max_sample_bytes, or "
            "cache.capacity when smaller); not downloaded or cached", url, key)

    def _escape(self, key: str, resolved: dict[str, str]) -> str:
        """How ``key`` leaves the root ("" when it does not); see `refusal`."""
        # A remote root's listing may give a key that starts with '/' (the object a//b under
        # the root a/): it is joined to the root, never read as an absolute path. A manifest
        # or a local root may not.
        listed = self._local_root is None and self.spec.manifest is None
        if not listed and (key.startswith(("/", "\\")) or posixpath.isabs(key)):
            return "an absolute path"
        if ".." in key and ".." in key.replace("\\", "/").split("/"):
            return "a '..' segment"
        if self._local_root is not None:
            # realpath walks every component (~20 us): resolve the directory once per batch.
            # The file itself may be a link: the read follows none, and resolves and checks
            # one when it meets it (_read_local).
            path = self.object_path(key)
            directory, name = os.path.split(path)
            real_dir = resolved.get(directory)
            if real_dir is None:
                real_dir = resolved[directory] = os.path.realpath(directory)
            real = resolved[path] = os.path.join(real_dir, name)  # read there, as checked
            if self._outside_root(real):
                return f"it resolves to {real}"
        return ""

    def _unpack(self, ref: SampleRef, url: str, data: bytes) -> list[FetchResult]:
        """Check one fetched object and turn it into the results of the samples it holds
        (layouts that fetch whole objects; ``tar`` streams its shards instead)."""
        raise NotImplementedError

    def fetch_many(self, refs: Sequence[SampleRef]) -> list[FetchResult]:
        """Fetch and check ``refs`` concurrently; one result per sample, errors returned, not raised.

        A failed fetch gives ``(ref, error)`` for the listed ref itself; a content check failure
        gives ``(sample ref, CorruptSample)``. Results follow the order of ``refs``.
        """
        return [result for group in self.fetch_grouped(refs) for result in group]

    def fetch_with_retries(
        self,
        refs: Sequence[SampleRef],
        *,
        attempts: int | None = None,
        deadline_s: float | None = None,
        base_s: float = 0.2,
        max_s: float = 10.0,
        on_piece: Any = None,
        piece_bytes: int = 0,
    ) -> list[FetchResult]:
        """`fetch_many`, re-fetching refs that failed transiently (``SourceUnavailable``,
        ``RemoteTimeout``) with exponential backoff and full jitter, until ``attempts``
        (default ``spec.retries``) or ``deadline_s`` run out. Permanent and corrupt results are
        final at once, and so is a ref still throttled after its own retries (the request gate
        asked for it again for `throttled_for_s`). Whatever still fails is returned as
        its last error. ``on_piece`` and ``piece_bytes``: see `fetch_grouped` (a shard
        that failed after handing pieces over is streamed again from its start; the cache
        skips what it has).
        """
        attempts = self.spec.retries if attempts is None else attempts
        groups: list[list[FetchResult]] = [[] for _ in refs]
        pending = list(range(len(refs)))
        delays = backoff_delays(attempts, base_s=base_s, max_s=max_s, deadline_s=deadline_s)
        while pending:
            fetched = self.fetch_grouped([refs[i] for i in pending], on_piece, piece_bytes)
            retry_next: list[int] = []
            for index, group in zip(pending, fetched):
                groups[index] = group
                if (  # the ref itself failed (a streamed shard: after the pieces it handed over)
                    group
                    and group[-1][0] is refs[index]
                    and isinstance(group[-1][1], TRANSIENT_ERRORS)
                    and not (isinstance(group[-1][1], Throttled) and self.throttled_for_s)
                ):
                    retry_next.append(index)
            pending = retry_next
            if not pending:
                break
            delay = next(delays, None)
            if delay is None:
                break
            log.info(
                "%s: %d transient failures; retrying in %.2fs", self.url, len(pending), delay
            )
            self.gate.stats.add(retries=len(pending))
            time.sleep(delay)
        return [result for group in groups for result in group]

    def _throttle(self, num_bytes: int) -> None:
        if self.limiter is not None and num_bytes:
            self.limiter.consume(num_bytes)

    # -- helpers shared by the layouts -----------------------------------------------------------

    def object_url(self, key: str) -> str:
        """The full URL of a key (for messages and logs)."""
        return self.url.rstrip("/") + "/" + key

    def object_path(self, key: str) -> str:
        """The filesystem path of a key."""
        return self.root.rstrip("/") + "/" + key if self.root else key

    def _read_manifest(self) -> KeyTable:
        manifest = self.spec.manifest
        if manifest is None:
            raise ValueError("no manifest configured")
        if "://" in manifest or manifest.startswith("/"):
            fs, path = open_fs(
                manifest,
                self.spec.storage_options,
                timeout_s=self.spec.timeout_s,
                connect_timeout_s=self.spec.connect_timeout_s,
            )
            url = redact_url(manifest)
        else:
            fs, path, url = self.fs, self.object_path(manifest), self.object_url(manifest)
        opener = open_body(fs, path)

        def open_stream() -> BodyReader:
            # its requests through the gate: counted, and charged where the gate has a budget
            assert opener is not None
            return BodyReader(opener, self.gate, fs.loop, url=url,
                              timeout_s=self.spec.timeout_s)

        table = read_manifest(
            fs,
            path,
            url=url,
            fmt=self.spec.manifest_format,
            deadline_s=self.spec.list_deadline_s,
            max_bytes=self.spec.manifest_max_bytes,
            max_lines=self.spec.manifest_max_lines,
            open_stream=open_stream if opener is not None else None,
        )
        return table.sorted()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r})"
