"""Files epochcache writes: written whole, errors naming the path; per-boot values; clock files.

A cache directory, a run directory, a copy's destination or an output file can sit where
nothing can be written: on a read-only mount, under a file, under ``/proc``, in a directory
of another user. Each place that writes one goes through `writing` (``OSError`` becomes
[`PathNotWritable`][epochcache.PathNotWritable] naming the path, what it is for and the cause)
or, where it can be known before anything starts, `check_writable`, which creates and removes
a probe and leaves nothing behind.

A file is written whole by `atomic_write`: a temporary file in the target's directory, renamed
into place, so a reader (or a crash) sees the old file or the new one, never half of one.

Stall records (`record_stall`, `read_stalls`): the trainers reading a cache that a stall
watchdog caught. A process whose batch stalled (see `epochcache.data.stall`) writes
``stalls/<pid>.json`` -- what stalled, since when, the sample key and worker, and the action
taken -- and removes it when the batch finishes after all. ``epochcache status`` shows the
records of processes that still run: a trainer stuck on a batch (action ``warn``), or one ending
with its StallError. Files, not LMDB: the process writing one may be stuck inside the store.

**Per-boot values.** Some values mean something only on the boot that read them: an instant of
``time.monotonic()`` (``CLOCK_MONOTONIC`` starts again from zero at every boot, and runs from
another offset in another time namespace), a pid, a process's start time in clock ticks since
boot. A cache outlives its boot (a node reboots, a cache is copied or moved to another host),
so every such value written under ``cache.dir`` travels with the identity of its boot, and a
process that reads it under another one ignores it:

* `boot_id`: the kernel's random id of this boot (``/proc/sys/kernel/random/boot_id``), the
  same in every container of the machine, different after a reboot and on every other host;
* `clock_id`: the boot id and this process's time namespace offsets, hashed to 16 bytes:
  two processes read the same ``time.monotonic()`` exactly when their clock ids are equal.
* `process_record` and `recorded_alive`: the pid, start ticks and boot a document (a lease, a
  stall record, a lowered capacity) names, and whether that process still runs (`pid_alive`);
  `heartbeat_alive` for a document that may come from another host (the daemon's).

**Clock files** (`ClockFile`): a few ``time.monotonic()`` instants shared by the samplers of a
daemon. The request budget (`epochcache.ingest.requests.RequestBudget`) and each source's pace
(`epochcache.ingest.concurrency.Pace`) are kept in files in the cache directory that every
sampler process maps and changes under ``flock`` (the kernel releases it when the process
holding it dies: a sampler killed with ``kill -9`` in the middle cannot wedge the others). Their
cells are instants of the monotonic clock, which means nothing on another boot or host: after a
reboot the clock starts again from zero, so an instant the last boot wrote lies far ahead and
every request would wait for it (seen: up to an hour, nothing cached meanwhile). So the file
names its clock: it starts with a magic word and the `clock_id` its cells were read from. A
process that finds another clock's stamp (the node rebooted; the cache was copied or moved to
another host; a file an older version wrote, without a stamp) starts the cells afresh under its
own and says so in the log, once per file and process.

Why a stamp and not wall-clock instants with bounds: these files need a clock every process of
a host reads alike and that never jumps (the wall clock jumps with NTP and by hand, and a bound
on how far ahead an instant may be is a guess: a legitimate reservation may lie minutes ahead
at a low ``max_requests_per_s``). The stamp keeps the monotonic clock where it is right and
says exactly when it is not.

Layout: ``b"ECCLOCK1"``, the 16-byte clock id, then the cells as little-endian doubles.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import socket
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

from .errors import PathNotWritable

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
#: This process's time namespace offsets (Linux 5.6+; absent: no time namespaces).
TIMENS_FILE = "/proc/self/timens_offsets"
#: Where the kernel does not say (not Linux): instants are then believed on any boot.
UNKNOWN_BOOT = "unknown-boot"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def boot_id() -> str:
    """The kernel's id of this boot (the same for every process and container of the machine
    until it reboots), or `UNKNOWN_BOOT`."""
    return _read(BOOT_ID_FILE) or UNKNOWN_BOOT


@functools.cache
def clock_id() -> bytes:
    """16 bytes naming the ``time.monotonic()`` this process reads: its boot and its time
    namespace's offsets."""
    return hashlib.sha256(f"{boot_id()}\n{_read(TIMENS_FILE)}".encode()).digest()[:16]


def same_boot(boot: object) -> bool:
    """Whether a value recorded with ``boot`` (a `boot_id`; None or missing from a document of
    an older version: unknown) may be taken as of this boot. Unknown is believed, as before."""
    return boot is None or boot == boot_id()


def process_stat(pid: int) -> tuple[str, int | None] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields:
        return None
    try:
        ticks: int | None = int(fields[19])
    except (IndexError, ValueError):
        ticks = None
    return fields[0].decode("ascii", errors="replace"), ticks


_own_start: tuple[int, int] | None = None  # (pid, start ticks) of this process, once read


def process_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), or None if unknown."""
    global _own_start
    # This process's own is read once: every snapshot's lease records it, and reading /proc
    # was a third of a snapshot's time (a forked child has another pid, so reads its own).
    own = _own_start
    if own is not None and own[0] == pid == os.getpid():
        return own[1]
    stat = process_stat(pid)
    ticks = None if stat is None else stat[1]
    if ticks is not None and pid == os.getpid():
        _own_start = (pid, ticks)
    return ticks


def pid_alive(pid: int, start_ticks: int | None = None, boot: object = None) -> bool:
    """Whether process ``pid`` exists (and is the same process that had ``start_ticks``, on
    the boot ``boot`` names: after a reboot a pid and its start ticks name another process)."""
    if pid <= 0 or not same_boot(boot):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    if start_ticks is not None:
        stat = process_stat(pid)
        if stat is not None:
            state, ticks = stat
            if (ticks is not None and ticks != start_ticks) or state == "Z":
                return False  # a recycled pid, or a zombie: neither holds anything
    return True


def process_record(pid: int | None = None) -> dict[str, Any]:
    """What a document says of the process that wrote it (default: this one), for
    `recorded_alive`: its pid, host, start time in ticks since boot, and that boot."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "host": socket.gethostname(), "start_ticks": process_start_ticks(pid),
            "boot": boot_id()}


def recorded_alive(doc: Mapping[str, Any]) -> bool:
    """Whether the process a document names (`process_record`) still runs, by pid and start
    time on the boot it names (the caller knows it was written on this host)."""
    return pid_alive(int(doc.get("pid", -1)), doc.get("start_ticks"), doc.get("boot"))


#: A process on another host whose document's heartbeat is older than this is taken for gone.
HEARTBEAT_STALE_S = 60.0


def heartbeat_alive(doc: Mapping[str, Any], age_s: float) -> bool:
    """Whether the process a document with a ``heartbeat`` names still runs: on this host by
    `recorded_alive`, on another by a heartbeat (``age_s`` old) fresher than
    `HEARTBEAT_STALE_S`; never once the document says ``stopped``."""
    if doc.get("stopped"):
        return False
    if doc.get("host") == socket.gethostname():
        return recorded_alive(doc)
    return age_s < HEARTBEAT_STALE_S


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
    return existing if existing is not None and not os.path.isdir(existing) else None


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
    with atomic_write(_path(cache_path, os.getpid())) as f:  # makes stalls/ private
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


#: The name this logger had in ingest/clockfile.py, kept for log configurations that name it.
log = logging.getLogger("epochcache.ingest.clockfile")

MAGIC = b"ECCLOCK1"
_STAMP = struct.Struct("<8s16s")


class ClockFile:
    """``len(initial)`` cells of a file every sampler of a daemon maps (see the module docstring).

    Args:
        path: the file (created if missing).
        initial: the cells of a new file, or of one stamped by another clock.
    """

    def __init__(self, path: str | os.PathLike[str], initial: Sequence[float]) -> None:
        self.path = os.fspath(path)
        self._initial = [float(value) for value in initial]
        self._cells = struct.Struct(f"<{len(self._initial)}d")
        self._stamp = _STAMP.pack(MAGIC, clock_id())
        size = _STAMP.size + self._cells.size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # new, or an older version's (no stamp): grown
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[float]]:
        """The cells, to read and change (written back when the block ends without an error),
        with the file locked against the other processes."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self._map[: _STAMP.size] != self._stamp:
                self._restamp()
            cells = list(self._cells.unpack_from(self._map, _STAMP.size))
            yield cells
            self._cells.pack_into(self._map, _STAMP.size, *cells)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _restamp(self) -> None:
        if any(self._map[:]):  # a new file is all zeros: nothing to say
            log.info("%s: written under another boot or host%s; its clock instants mean "
                     "nothing here: starting it afresh", self.path,
                     "" if self._map[: len(MAGIC)] == MAGIC else
                     " (by an older version, which did not say which)")
        self._cells.pack_into(self._map, _STAMP.size, *self._initial)
        self._map[: _STAMP.size] = self._stamp

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
