"""Listing a large bucket page by page: a timeout and retries per page, progress in the log,
saved as it goes and resumed after a restart.

A bucket of a million objects takes 30-100 s to list at ordinary page latency; under one
timeout for the whole listing it could never finish. Here every page is one remote call with
``source.timeout_s`` and ``source.retries`` of its own:

* ``s3://``: ``list_objects_v2`` pages of `PAGE_KEYS` keys, in key order, each asked
  ``StartAfter`` the last key listed (so a listing resumes from its last key, with no
  continuation token to expire);
* any other filesystem: one directory per page (``ls``), walked depth first; local
  directories with ``os.scandir``.

`PagedListing` drives a pager for the daemon: it logs progress every `PROGRESS_S`
("listed 2,300,000 keys in 45 s"), and saves the listing as it goes (`listing`: not
complete, with where to go on): first once `START_KEYS` keys are listed, then whenever
the keys listed doubled or `CHECKPOINT_S` passed. A restarted daemon goes on from the
last save instead of from the first page, and samplers may start from the keys saved so far.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

from ..errors import RemoteTimeout, SourceError, SourceUnavailable
from ..redact import redact_options
from .health import RequestStats
from .keytable import KeyTable, KeyTableBuilder
from .listing import Listing, new_generation, read_listing, save_listing, source_fingerprint
from .remote import call, retry, translate_errors

log = logging.getLogger(__name__)

#: Keys per S3 page (the most S3 returns).
PAGE_KEYS = 1000
#: Seconds between progress lines while a listing runs.
PROGRESS_S = 10.0
#: A listing under way is saved at least this often (and whenever its keys doubled)...
CHECKPOINT_S = 60.0
#: ... first once this many keys are listed: samplers may start from them (the same first
#: keys on every node, whose daemons list the same pages: they are the key order's base).
START_KEYS = 1000

#: One listed object: its key relative to the root, and its size when known.
Entry = tuple[str, "int | None"]


class Pager(abc.ABC):
    """One remote listing, a page at a time. `page` changes nothing when it raises, so a
    failed page is asked again; `state` says where the listing goes on."""

    done: bool = False
    pages: int = 0

    @abc.abstractmethod
    def page(self, timeout_s: float) -> list[Entry]:
        """The next page's objects (relative keys, sizes); sets `done` after the last."""

    @property
    @abc.abstractmethod
    def state(self) -> dict[str, Any]:
        """JSON-able: pass it back to `make_pager` to go on from here."""


class S3Pager(Pager):
    """Pages of ``list_objects_v2`` under the root's prefix, in key order."""

    def __init__(self, fs: Any, root: str, after: str | None = None) -> None:
        self.fs = fs
        self.bucket, _, prefix = root.strip("/").partition("/")
        self.prefix = prefix.rstrip("/") + "/" if prefix else ""
        self.after = after

    def page(self, timeout_s: float) -> list[Entry]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix,
                                  "MaxKeys": PAGE_KEYS, **getattr(self.fs, "req_kw", {})}
        if self.after:
            kwargs["StartAfter"] = self.after
        answer = sync(self.fs.loop, self.fs._call_s3, "list_objects_v2", timeout=timeout_s,
                      **kwargs)
        contents = answer.get("Contents") or []
        start = len(self.prefix)
        entries: list[Entry] = [(item["Key"][start:], item.get("Size")) for item in contents
                                if not item["Key"].endswith("/")]  # folder markers
        if contents:
            self.after = contents[-1]["Key"]
        self.done = not answer.get("IsTruncated") or not contents
        self.pages += 1
        return entries

    @property
    def state(self) -> dict[str, Any]:
        return {"kind": "s3", "after": self.after, "pages": self.pages}


class WalkPager(Pager):
    """One directory per page, depth first. Directories still to list are the state, saved
    relative to the root: the root of an HTTP source is its URL, whose userinfo is a
    credential (states saved before held full paths; they are still read)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, local: bool,
                 dirs: list[str] | None = None) -> None:
        self.fs, self.local = fs, local
        self.root = root.rstrip("/") or "/"
        self.prefix = self.root.rstrip("/") + "/"
        # a stack: last is next
        self.dirs = [self.root] if dirs is None else [self._absolute(d) for d in dirs]
        self.done = not self.dirs
        self._visited: set[tuple[int, int]] = set()  # local directories: links may loop

    def page(self, timeout_s: float) -> list[Entry]:
        directory = self.dirs[-1]
        files, subdirs = (self._scan_local(directory) if self.local
                          else self._ls(directory, timeout_s))
        self.dirs.pop()
        self.dirs.extend(sorted(subdirs, reverse=True))  # the smallest name is listed next
        self.done = not self.dirs
        self.pages += 1
        start = len(self.prefix)
        return [(path[start:], size) for path, size in sorted(files)]

    def _ls(self, directory: str, timeout_s: float) -> tuple[list[Entry], list[str]]:
        infos = call(self.fs, "ls", directory, detail=True, timeout_s=timeout_s)
        files: list[Entry] = []
        subdirs: list[str] = []
        here = directory.rstrip("/")
        for info in infos:
            name = str(info["name"]).rstrip("/")
            if info.get("type") == "directory":
                if name != here:
                    subdirs.append(name)
            elif name != here:
                size = info.get("size")
                files.append((name, int(size) if size is not None else None))
        return files, subdirs

    def _scan_local(self, directory: str) -> tuple[list[Entry], list[str]]:
        files: list[Entry] = []
        subdirs: list[str] = []
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_dir():  # follows links, as fsspec's find does...
                        info = entry.stat()
                        if (info.st_dev, info.st_ino) not in self._visited:  # ...once
                            self._visited.add((info.st_dev, info.st_ino))
                            subdirs.append(entry.path)
                    elif entry.is_file():
                        files.append((entry.path, entry.stat().st_size))
                except OSError:
                    continue  # vanished meanwhile, or a dangling link: not an object
        return files, subdirs

    def _absolute(self, directory: str) -> str:
        if directory in ("", "."):
            return self.root
        if directory == self.root or directory.startswith(self.prefix):
            return directory  # saved whole by an earlier version
        return self.prefix + directory

    def _relative(self, directory: str) -> str:
        if directory == self.root:
            return ""
        return directory[len(self.prefix):] if directory.startswith(self.prefix) else directory

    @property
    def state(self) -> dict[str, Any]:
        return {"kind": "walk", "dirs": [self._relative(d) for d in self.dirs],
                "pages": self.pages}


def make_pager(fs: fsspec.AbstractFileSystem, root: str, local: bool,
               state: dict[str, Any] | None = None) -> Pager:
    """The pager for ``fs`` (S3 pages, else a directory walk), resumed at ``state``."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a") and isinstance(fs, AsyncFileSystem):
        pager: Pager = S3Pager(fs, root, (state or {}).get("after"))
    else:
        dirs = (state or {}).get("dirs")
        pager = WalkPager(fs, root, local, None if state is None else list(dirs or []))
    pager.pages = int((state or {}).get("pages", 0))
    return pager


def fetch_page(pager: Pager, url: str, spec: Any, first: bool,
               stats: RequestStats | None = None) -> list[Entry]:
    """One page with ``source.timeout_s`` and retries. The first page of a listing must fail
    fast (invariant 5: an unreachable remote fails the start within seconds): two attempts
    within ``list_deadline_s``; later pages get ``source.retries`` attempts. Each remote
    request is counted in ``stats`` (``lists``; a local directory is not a request)."""
    remote = stats is not None and not getattr(pager, "local", False)
    attempts = 0

    def once() -> list[Entry]:
        nonlocal attempts
        if remote:
            assert stats is not None
            stats.add(lists=1, retries=int(attempts > 0))
        attempts += 1
        with translate_errors(url):
            return pager.page(spec.timeout_s)

    if first:
        return retry(once, url=url, attempts=2, deadline_s=spec.list_deadline_s, base_s=0.2)
    return retry(once, url=url, attempts=spec.retries, base_s=0.5, max_s=10.0)


def listing_error(url: str, pattern: str, exc: SourceError, spec: Any, keys: int,
                  pages: int) -> SourceUnavailable:
    """The error of a listing that failed (after its retries), saying what to do."""
    local = url.removeprefix("file://") if "://" not in url or url.startswith("file://") else None
    if pages == 0 and local is not None and not os.path.isdir(local):
        # no endpoint nor credentials to check: a path, in words (not FileNotFoundError's)
        return SourceUnavailable(
            f"{url}: no such directory ({os.path.abspath(local)}); check source.url (a "
            "relative path is read from the working directory)", url)
    if pages == 0 and not isinstance(exc, RemoteTimeout):
        return SourceUnavailable(
            f"{url}: cannot list objects matching {pattern!r} ({exc}); check source.url, the "
            f"endpoint and credentials in storage_options {redact_options(spec.storage_options)}",
            url)
    if isinstance(exc, RemoteTimeout):
        return SourceUnavailable(
            f"{url}: listing page {pages + 1} timed out after {keys:,} keys ({exc}); each page "
            f"has source.timeout_s ({spec.timeout_s:g}s) and source.retries ({spec.retries}): "
            "raise them for a slow endpoint", url)
    return SourceUnavailable(
        f"{url}: listing page {pages + 1} failed after {keys:,} keys ({exc}); check the "
        "endpoint and network", url)


_UNREAD = object()  # PagedListing(saved=...) not given: read the saved listing


class PagedListing:
    """Lists one source page by page into its saved listing (see the module docstring).

    Args:
        source: the source (its ``pager()`` gives the pages).
        cache_dir: where the listing is saved; None lists without saving anything.
        stop: set to end `run` at the next page (what was listed is saved).
        saved: the saved listing (or None) where the caller has already read it: an
            unfinished one is gone on with. Read from ``cache_dir`` when not given.
    """

    def __init__(self, source: Any, cache_dir: str | os.PathLike[str] | None,
                 stop: threading.Event | None = None, saved: Any = _UNREAD) -> None:
        self.source, self.cache_dir = source, cache_dir
        self.stop = stop or threading.Event()
        self.fingerprint = source_fingerprint(source.spec)
        self.pattern = source.spec.effective_pattern
        self._match: Callable[[str], Any] = _matcher(self.pattern)
        self.builder = KeyTableBuilder()
        self.blocks: list[int] = []
        self.generation = new_generation()
        self.seen = 0  # objects under the prefix, matching or not
        if cache_dir is None:
            saved = None
        elif saved is _UNREAD:
            saved = read_listing(cache_dir, self.fingerprint)
        state = None
        if saved is not None and not saved.complete and saved.resume is not None:
            self.builder.extend(saved.table)
            self.blocks, self.generation = list(saved.blocks), saved.generation
            self.seen = int(saved.resume.get("seen", len(saved.table)))
            state = saved.resume
            log.info("%s: going on with the listing saved at %s keys (%s pages)",
                     source.url, f"{len(saved.table):,}", state.get("pages", "?"))
        self.pager = source.pager(state)
        self.started = time.monotonic()
        self._progress_at = self.started + PROGRESS_S
        self._saved_at, self._saved_keys = self.started, len(self.builder)

    @property
    def done(self) -> bool:
        return bool(self.pager.done)

    def run(self, *, until_started: bool = False) -> Listing:
        """List until the end, or with ``until_started`` until a first part is saved (samplers
        can start from it); return what is saved. A stop set meanwhile saves and returns.

        Raises:
            SourceUnavailable: a page failed after its retries (what was listed is saved), or
                nothing matches the pattern.
        """
        while not self.pager.done:
            if self.stop.is_set():
                return self._save_partial()
            first = self.pager.pages == 0
            try:
                entries = fetch_page(self.pager, self.source.url, self.source.spec, first,
                                     self.source.gate.stats)
            except SourceError as exc:
                if self.blocks or len(self.builder) > self._saved_keys:
                    self._save_partial()
                raise listing_error(self.source.url, self.pattern, exc, self.source.spec,
                                    len(self.builder), self.pager.pages) from exc
            self.seen += len(entries)
            for key, size in entries:
                if self._match(key):
                    self.builder.add(key, size)
            now = time.monotonic()
            if now >= self._progress_at and not self.pager.done:
                self._progress_at = now + PROGRESS_S
                log.info("%s: listed %s keys in %.0f s (%d pages); listing goes on",
                         self.source.url, f"{len(self.builder):,}", now - self.started,
                         self.pager.pages)
            if not self.pager.done and self._checkpoint_due(now):
                partial = self._save_partial()
                if until_started:
                    return partial
        return self._finish()

    def _checkpoint_due(self, now: float) -> bool:
        if self.cache_dir is None:
            return False
        if not self.blocks:
            return len(self.builder) >= START_KEYS  # samplers can start from these
        return (len(self.builder) >= 2 * self._saved_keys
                or now - self._saved_at >= CHECKPOINT_S)

    def _save_partial(self) -> Listing:
        count = len(self.builder)
        if not self.blocks or count > self.blocks[-1]:
            self.blocks.append(count)
        listing = Listing(self.builder.build(), list(self.blocks), set(), time.time(),
                          self.generation, complete=False,
                          resume={**self.pager.state, "seen": self.seen})
        if self.cache_dir is not None:
            save_listing(self.cache_dir, self.fingerprint, listing)
        self._saved_at, self._saved_keys = time.monotonic(), count
        return listing

    def _finish(self) -> Listing:
        table = self.builder.build()
        if not len(table):
            raise SourceUnavailable(
                f"{self.source.url}: no keys match {self.pattern!r} ({self.seen} objects under "
                "the prefix); check source.url (bucket and prefix exist) and source.pattern",
                self.source.url)
        # Saved sorted, as one block, under a new generation: the key order starts afresh
        # over every key (see .listing).
        listing = Listing(table.sorted(), [], set(), time.time(), new_generation())
        if self.cache_dir is not None:
            save_listing(self.cache_dir, self.fingerprint, listing)
        log.info("%s: listed %s keys matching %r in %.1f s (%d pages)", self.source.url,
                 f"{len(table):,}", self.pattern, time.monotonic() - self.started,
                 self.pager.pages)
        return listing


def list_all(source: Any) -> KeyTable:
    """Every key of ``source`` matching its pattern, sorted, page by page (nothing saved).

    Raises:
        SourceUnavailable: a page failed after its retries, or nothing matches.
    """
    return PagedListing(source, None).run().table


def _matcher(pattern: str) -> Callable[[str], Any]:
    from .manifest import glob_to_regex

    if pattern in ("**", "**/*"):
        return bool  # every non-empty key
    regex: re.Pattern[str] = glob_to_regex(pattern)
    return regex.match

