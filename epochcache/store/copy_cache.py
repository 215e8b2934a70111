"""``epochcache copy SRC DST`` / ``cache.copy_to(dst)``: a consistent copy to start a node warm.

The copy is LMDB's own (``mdb_env_copy2`` with compaction): it reads the source in one read
transaction, so it is consistent while the source's daemon and trainers go on writing, and it
leaves free pages behind (the copy's data file holds what is stored, no more). The source is
never written to. What the copy keeps and leaves behind:

* kept: the samples, their key index, counters and limits (capacity, headroom), the stats
  history, the quarantine rows, the per-source counters, the origin rows, the saved listings
  (``listings/``: a daemon on the copy with the same source config does not list again) and
  the coverage ledgers (``coverage/``);
* left behind: the leases (a lease names a process of the source's machine: the copy's samples
  are all free for eviction), release plans, owner and lock files, and every state document
  (the daemon's heartbeat, samplers' positions and health, streams' tickets, jobs).

All or nothing: the copy is written into a temporary directory beside the destination
(``.<name>.partial-copy-<id>``, on the same filesystem), made durable (fsync), and renamed into
place whole at the end, so a copy killed part-way (SIGKILL, a full disk, a node lost) leaves no
cache at the destination, never one cut short (LMDB maps its data file: a cut one crashed every
tool with SIGBUS). While it runs the copy holds an exclusive ``flock`` on ``.<name>.partial-
copy-<id>.lock``; the next copy to the same destination removes the leftovers of dead copies
(and refuses while a live one writes there), and the tools name a leftover when they find no
cache at the destination. Ctrl-C (or an error) removes the partial copy before the copy ends.

The destination must be new or an empty directory that is not a mount point (the copy is
renamed into place from beside it); it is created private to the user (0700, files 0600), as
caches are. On a live source the read transaction of the copy pins the pages writers free
meanwhile, so the source's data file may grow by what is written during the copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import lmdb

from ..errors import CacheError
from ..paths import check_writable
from ..units import format_size
from .datafile import COVERAGE_DIR, LOCK_FILE, ledger_lock, partial_copies, partial_prefix
from .env import make_private_dir
from .owners import lock_held
from .records import DB_LEASES, DB_STATE

if TYPE_CHECKING:
    from .sample_store import SampleStore

log = logging.getLogger("epochcache.cache")

#: Directories of a cache copied along with its LMDB environment.
LISTINGS_DIR = "listings"
def clear_leftovers(dst: str) -> list[str]:
    """Remove what dead copies to ``dst`` left beside it; return what was removed.

    Raises:
        CacheError: another copy to ``dst`` is running now.
    """
    removed = []
    for lock_path in glob.glob(glob.escape(partial_prefix(dst)) + "*.lock"):
        partial = lock_path[: -len(".lock")]
        if lock_held(lock_path):
            raise CacheError(f"{dst}: another `epochcache copy` is writing it now (into "
                             f"{partial}); wait for it, or copy somewhere else")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
    for partial in partial_copies(dst):
        if lock_held(partial + ".lock"):
            continue  # a copy that took its lock after the loop above: it is live
        shutil.rmtree(partial, ignore_errors=True)
        log.warning("%s: removed %s, the partial copy a killed `epochcache copy` left",
                    dst, partial)
        removed.append(partial)
    return removed


def check_destination(dst: str) -> None:
    """Raise [`CacheError`][epochcache.CacheError] unless ``dst`` is a new or empty directory
    the copy can be renamed into (see the module docstring),
    [`PathNotWritable`][epochcache.PathNotWritable] unless it can be written."""
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise CacheError(f"{dst}: exists and is not a directory; `epochcache copy` writes a new "
                         "cache into a new or empty directory")
    if os.path.isdir(dst) and os.listdir(dst):
        raise CacheError(f"{dst}: the directory is not empty; `epochcache copy` writes a new "
                         "cache: give it a new or empty directory (it never merges into, or "
                         "overwrites, another)")
    if os.path.isdir(dst) and os.path.ismount(dst):
        raise CacheError(f"{dst}: a mount point; the copy is written beside its destination "
                         "and renamed into place, so give a directory inside it (e.g. "
                         f"{os.path.join(dst, 'epochcache')})")
    check_writable(dst, "the copy")
    if os.path.isdir(dst):  # written beside it, then renamed into place: its parent is written
        check_writable(os.path.dirname(os.path.abspath(dst)),
                       "the directory of the copy (written beside it, then renamed into place)")


def _copy_files(src_dir: str, dst_dir: str, skip: tuple[str, ...] = ()) -> int:
    """Copy the plain files of ``src_dir`` (not hidden temporaries) into ``dst_dir``, private."""
    try:
        names = sorted(os.listdir(src_dir))
    except FileNotFoundError:
        return 0
    make_private_dir(dst_dir)
    copied = 0
    for name in names:
        path = os.path.join(src_dir, name)
        if name.startswith(".") or name in skip or not os.path.isfile(path):
            continue
        target = os.path.join(dst_dir, name)
        shutil.copyfile(path, target)  # a listing replaced meanwhile: the old or the new, whole
        os.chmod(target, 0o600)
        copied += 1
    return copied


def _fsync_tree(root: str) -> None:
    """Make every file and directory under ``root`` durable (before it is renamed into place:
    after a power loss the destination holds the whole copy or nothing)."""
    for directory, _dirs, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def _fsync(path: str) -> None:
    """Make a file or a directory (its entries) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _env_copy(source: SampleStore, into: str) -> None:
    """LMDB's compacting copy, in a thread: the caller waits for it in short steps, so a Ctrl-C
    is acted on at once (LMDB's copy cannot be interrupted: on Ctrl-C its thread goes on into
    the partial copy, which is deleted, until the process exits)."""
    failure: list[BaseException] = []

    def copy() -> None:
        try:
            source.env.lmdb_env.copy(into, compact=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)

    thread = threading.Thread(target=copy, name="epochcache-copy", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if failure:
        raise failure[0]


def copy_cache(source: SampleStore, dst: str | os.PathLike[str]) -> dict[str, Any]:
    """Copy ``source`` to ``dst`` (see the module docstring); return what was copied.

    Raises:
        CacheError: ``dst`` is not a new or empty directory, or it is the source, or another
            copy writes there now; or the copy failed (a full disk): nothing is left at ``dst``.
    """
    dst = os.path.realpath(os.fspath(dst))
    if dst == source.path or dst.startswith(source.path + os.sep):
        raise CacheError(f"{dst}: the copy cannot go into the cache it copies ({source.path})")
    check_destination(dst)
    clear_leftovers(dst)
    started = time.monotonic()
    partial = partial_prefix(dst) + uuid.uuid4().hex[:8]
    lock_fd = os.open(partial + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        os.write(lock_fd, json.dumps({"source": source.path, "pid": os.getpid(),
                                      "host": socket.gethostname()}).encode())
        try:
            report = _copy_into(source, partial)
            _fsync_tree(partial)
            os.rename(partial, dst)  # all at once; over an empty directory too
            _fsync(os.path.dirname(dst))
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, (OSError, lmdb.Error)):
                raise CacheError(
                    f"{dst}: the copy failed ({exc}; {_free_text(dst)}, the copy needs about "
                    f"{format_size(source.counters().bytes)}); nothing was left there and the "
                    "source is unchanged") from exc
            raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial + ".lock")  # while still locked: never taken for a dead copy's
        os.close(lock_fd)
    return {**report, "path": dst, "seconds": round(time.monotonic() - started, 3)}


def _copy_into(source: SampleStore, into: str) -> dict[str, Any]:
    """The copy itself, into the directory ``into``; what was copied."""
    from .sample_store import SampleStore

    make_private_dir(into)
    _env_copy(source, into)
    for name in os.listdir(into):
        os.chmod(os.path.join(into, name), 0o600)
    listings = _copy_files(os.path.join(source.path, LISTINGS_DIR),
                           os.path.join(into, LISTINGS_DIR))
    with ledger_lock(source.path):  # whole ledgers: no update is half-way
        ledgers = _copy_files(os.path.join(source.path, COVERAGE_DIR),
                              os.path.join(into, COVERAGE_DIR), skip=(LOCK_FILE,))
    copy = SampleStore(into)
    try:
        def leave_behind(txn: Any) -> list[int]:
            """Empty the leases and state tables; how many entries each held."""
            left = []
            for db_name in (DB_LEASES, DB_STATE):
                left.append(int(txn.stat(copy.env.dbs[db_name])["entries"]))
                txn.drop(copy.env.dbs[db_name], delete=False)
            return left

        leases, states = copy.env.write(leave_behind)
        counters = copy.counters()
        return {"source": source.path, "samples": counters.samples,
                "bytes": counters.bytes, "file_bytes": copy.file_bytes(),
                "listings": listings,
                "ledgers": sum(name.endswith(".ledger") for name in
                               os.listdir(os.path.join(into, COVERAGE_DIR))) if ledgers else 0,
                "leases_left_behind": leases, "states_left_behind": states}
    finally:
        copy.close()


def _free_text(dst: str) -> str:
    try:
        return f"{format_size(shutil.disk_usage(os.path.dirname(dst)).free)} free on its disk"
    except OSError:
        return "free space unknown"
