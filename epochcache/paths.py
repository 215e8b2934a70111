"""Paths epochcache writes: written whole, and one error naming the path, never an ``OSError``
traceback.

A cache directory, a run directory, a copy's destination or an output file can sit where
nothing can be written: on a read-only mount, under a file, under ``/proc``, in a directory
of another user. Each place that writes one goes through `writing` (``OSError`` becomes
[`PathNotWritable`][epochcache.PathNotWritable] naming the path, what it is for and the cause)
or, where it can be known before anything starts, `check_writable`, which creates and removes
a probe and leaves nothing behind.

A file is written whole by `atomic_write`: a temporary file in the target's directory, renamed
into place, so a reader (or a crash) sees the old file or the new one, never half of one.

Stall records, files beside a cache (`record_stall`, `read_stalls`): the trainers reading it
that a stall watchdog caught. A process whose batch stalled (see `epochcache.data.stall`)
writes ``stalls/<pid>.json`` -- what stalled, since when, the sample key and worker, and the action taken -- and removes it
when the batch finishes after all. ``epochcache status`` shows the records of processes that
still run: a trainer stuck on a batch (action ``warn``), or one ending with its StallError.
Files, not LMDB: the process writing one may be stuck inside the store.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

from .boot import process_record, recorded_alive
from .errors import PathNotWritable


def _cause(path: str, exc: OSError) -> str:
    """What stops ``path`` being written and what to do, in words (no errno, no class)."""
    if exc.errno == errno.EROFS:
        return "the filesystem is mounted read-only; choose a path on a writable filesystem"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(path)
        if blocker is not None:
            return f"{blocker} is a file, not a directory; choose another path"
    if exc.errno == errno.EISDIR:
        return "it is a directory, not a file; name a file"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied; choose a path you can write, or change its permissions"
    if exc.errno == errno.ENOENT:
        existing = _existing_ancestor(path)
        if existing is not None and os.path.isdir(existing):
            # /proc, /sys: the directory exists and refuses new entries
            return (f"{existing} does not allow creating files or directories in it; choose a "
                    "path on a writable filesystem")
    if exc.errno == errno.ENOSPC:
        return "no space left on the device; free some or choose another disk"
    return f"{(exc.strerror or str(exc)).lower()}; choose another path"


def _existing_ancestor(path: str) -> str | None:
    """The nearest of ``path`` and its parents that exists."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return current


def first_missing(path: str | os.PathLike[str]) -> str | None:
    """The top directory that creating ``path`` would create (None: ``path`` exists): what
    to remove to leave nothing behind after a failed start."""
    target = os.path.abspath(os.fspath(path))
    existing = _existing_ancestor(target)
    if existing == target:
        return None
    if existing is None:
        return target
    rest = os.path.relpath(target, existing).split(os.sep)
    return os.path.join(existing, rest[0])


def _file_in_the_way(path: str) -> str | None:
    """``path`` or the parent of it that exists and is not a directory, if one is."""
    existing = _existing_ancestor(path)
    if existing is not None and not os.path.isdir(existing):
        return existing
    return None


def not_writable(path: str | os.PathLike[str], what: str, exc: OSError) -> PathNotWritable:
    """The error for ``path`` (``what`` it is: "the cache directory", "--output") failing
    with ``exc``."""
    where = os.fspath(path)
    return PathNotWritable(
        f"{where}: cannot write {what} there: {_cause(where, exc)}", where)


@contextlib.contextmanager
def writing(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Translate an ``OSError`` of the block, which writes ``path``, into `PathNotWritable`."""
    try:
        yield
    except PathNotWritable:
        raise
    except OSError as exc:
        raise not_writable(path, what, exc) from exc


def check_writable(path: str | os.PathLike[str], what: str, *, directory: bool = True) -> None:
    """Raise `PathNotWritable` unless ``path`` (a directory, or a file with ``directory``
    False) can be created or written; change nothing.

    The check makes and removes a probe in ``path`` if it is a directory, else in the nearest
    directory that exists above it: a read-only mount, a file in the way and ``/proc`` each
    fail there, before anything starts.
    """
    where = os.fspath(path)
    with writing(where, what):
        blocker = _file_in_the_way(where)
        if blocker is not None and (directory or blocker != os.path.abspath(where)):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", where)
        if os.path.isdir(where):
            if not directory:
                raise IsADirectoryError(errno.EISDIR, "Is a directory", where)
            probe_in = where
        else:
            probe_in = _existing_ancestor(os.path.dirname(os.path.abspath(where))) or "/"
        probe = tempfile.mkdtemp(prefix=".epochcache-probe-", dir=probe_in)
        os.rmdir(probe)


def require_writable_dir(path: str | os.PathLike[str], what: str) -> None:
    """Raise `PathNotWritable` unless this process may write in the existing directory
    ``path`` (a read-only mount, another user's directory); cheap: no probe."""
    if os.access(path, os.W_OK | os.X_OK):
        return
    code = errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errno.EACCES
    raise not_writable(path, what, OSError(code, os.strerror(code), os.fspath(path)))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, prefix: str = ".tmp-", suffix: str = "",
                 durable: bool = False) -> Iterator[BinaryIO]:
    """Write ``path`` through the yielded file; it replaces ``path`` only if the block ends
    without an exception (the temporary file is removed otherwise). The directory is created
    private to the user when missing. ``durable`` flushes the data to disk before the rename,
    so a power loss cannot leave the new name on an empty file."""
    directory = os.path.dirname(os.fspath(path)) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


STALLS_DIR = "stalls"


def _path(cache_path: str, pid: int) -> str:
    return os.path.join(cache_path, STALLS_DIR, f"{pid}.json")


def record_stall(cache_path: str, doc: dict[str, Any]) -> None:
    """Record this process's stall (``doc``); raises OSError when it cannot."""
    path = _path(cache_path, os.getpid())
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps({**doc, **process_record()}).encode())


def forget_stall(cache_path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(_path(cache_path, os.getpid()))


def read_stalls(cache_path: str) -> list[dict[str, Any]]:
    """The stall records of processes that still run, oldest first."""
    directory = os.path.join(cache_path, STALLS_DIR)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                doc = dict(json.load(f))
        except (OSError, ValueError):
            continue
        if recorded_alive(doc):
            found.append(doc)
    return sorted(found, key=lambda doc: float(doc.get("since", 0)))
