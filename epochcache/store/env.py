"""Open the LMDB environment of a cache, and run transactions on it safely.

All process-level LMDB concerns live here:

* one ``lmdb.Environment`` per cache directory per process (LMDB forbids opening the same
  file twice in one process), shared by every `Env` on that path;
* fork: a forked child (a DataLoader worker) opens an environment of its own on first use and
  never touches the one it inherited (see ``_after_fork_in_child``); sampler processes are
  started with ``spawn`` and open their own;
* map size: set from the capacity, grown on ``MapFullError`` up to a bound, and re-read
  after another process grew it (``MapResizedError``);
* a private directory (0700) and private files (0600), since samples may be sensitive;
* who writes to the cache: every process with a writable handle (a *writer*) holds a shared
  ``flock`` on ``holders.lock`` (released by the kernel when it dies), so that a process may
  change the stored capacity only when it is alone (`Env.alone`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import lmdb

from ..errors import CacheError, CacheIOError, CacheUnusable, NodeLayoutError
from ..paths import boot_id, require_writable_dir, writing
from ..placement import read_placement
from . import remap_lock
from .datafile import check_data_file
from .records import ALL_DBS, OPTIONAL_DBS

log = logging.getLogger(__name__)

T = TypeVar("T")

MIN_MAP_SIZE = 64 * 1024 * 1024
#: Extra room above capacity + headroom: LMDB needs free pages for copy-on-write while old
#: readers still see freed pages, and large values round up to whole pages.
MAP_SLACK = 1.0
MAX_READERS = 1024
#: An EIO from a write with less free space than this is the short write of a full disk.
NEARLY_FULL_BYTES = 16 * 1024 * 1024

#: Held shared by every writer: a process with a writable handle on the cache (`Env.alone`).
WRITERS_FILE = "holders.lock"  # on-disk name
#: Serialises the processes that want to change a cache's limits.
LIMITS_FILE = "limits.lock"
#: How long `Env.alone` waits for another process changing the limits.
LIMITS_WAIT_S = 30.0

_lock = threading.Lock()
_envs: dict[str, tuple[lmdb.Environment, dict[bytes, lmdb._Database], int]] = {}
_refcounts: dict[str, int] = {}
#: path -> (fd of holders.lock with a shared flock, handles using it) in this process
_writers: dict[str, tuple[int, int]] = {}


#: ``PROCESS[0]`` is a new object in every forked child: a cheaper "is this still the process
#: that opened it?" test than ``os.getpid()`` (a system call) for per-sample paths.
PROCESS: list[object] = [object()]


#: Environments this process inherited through fork(): never used, closed or freed here.
_inherited: list[lmdb.Environment] = []
#: Cache paths whose environment this process inherited (opened afresh on first use).
_inherited_paths: set[str] = set()


def _after_fork_in_child() -> None:
    """Set a forked child up to open environments of its own.

    LMDB forbids using an environment across fork(), and py-lmdb never frees a read
    transaction a child begins on an inherited one: each read would keep one of the table's
    reader slots, under the parent's pid, for as long as the parent lives, until no process can
    read the cache. Closing the inherited environment is no way out either: it aborts the
    parent's transactions that were open at fork() (clearing their reader slots in the shared
    table, so the parent's snapshots would no longer be protected from page reuse) and may wait
    forever on state of the parent's other threads. So the child leaves the inherited handles
    alone for good (pinned: not even interpreter exit may free them) and opens its own on first
    use (`_open_lmdb`). That is safe: fcntl locks, the reason LMDB forbids a second open
    in one process, are not inherited by fork(), so only the child's own environment holds any.
    """
    global _lock
    PROCESS[0] = object()
    for path, (env, _dbs, _pid) in _envs.items():
        _pin(env)
        _inherited_paths.add(path)
    _envs.clear()
    _refcounts.clear()
    # The child shares the parent's holders.lock file description (and so its lock): it holds
    # the cache as long as it lives, and never closes the descriptor.
    for path, (fd, _count) in list(_writers.items()):
        _writers[path] = (fd, 1 << 30)
    _lock = threading.Lock()


def _pin(env: lmdb.Environment) -> None:
    # py-lmdb closes an environment when it is freed, in any process: keep one reference that
    # nothing ever drops, interpreter shutdown included.
    _inherited.append(env)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(env))


def _open_lmdb(path: str, **kwargs: Any) -> lmdb.Environment:
    """``lmdb.open``, also where this process inherited an environment on ``path``.

    py-lmdb refuses a second open of the same files in one process (it would share and then
    drop LMDB's fcntl locks) and identifies files by ``lmdb._envid.env_keys``. A forked child's
    inherited environment holds no locks in the child (see `_after_fork_in_child`), so
    for it the child's own open is told apart from the inherited one by the child's pid.
    """
    if path not in _inherited_paths:
        return lmdb.open(path, **kwargs)
    from lmdb import _envid  # py-lmdb 3 (pyproject pins it)

    file_keys: Callable[..., tuple[Any, ...]] = _envid.env_keys
    pid = os.getpid()
    _envid.env_keys = lambda *args: tuple(("forked", pid, key) for key in file_keys(*args))
    try:
        return lmdb.open(path, **kwargs)
    finally:
        _envid.env_keys = file_keys


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def begin_read(env: lmdb.Environment) -> lmdb.Transaction[memoryview]:
    """A read transaction (buffers into the map); survives another process growing the map.

    The caller ends it with `end_read`. Hot paths call this directly instead of
    `Env.read`. Adopting a map another process grew waits until no other thread of
    this process has a transaction open (`epochcache.store.remap_lock`).
    """
    lock = remap_lock.LOCK
    lock.enter()
    try:
        return env.begin(buffers=True)
    except lmdb.MapResizedError:
        lock.leave()
        lock.remap(lambda: env.set_mapsize(0))  # adopt the size another process set
        lock.enter()
        try:
            return env.begin(buffers=True)
        except BaseException:
            lock.leave()
            raise
    except BaseException:
        lock.leave()
        raise


def end_read(txn: lmdb.Transaction[memoryview]) -> None:
    """End a transaction of `begin_read` (its buffers are invalid from here on)."""
    try:
        txn.abort()
    finally:
        remap_lock.LOCK.leave()


def cache_identity(path: str) -> str:
    """Which cache ``path`` holds, machine-wide: the kernel's boot id and the data file's device
    and inode. Processes that print the same identity open the same LMDB environment (on one
    machine, from any container or mount point); a copy of the cache on another machine, or
    another directory, differs."""
    boot = boot_id()
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return f"{boot}:missing:{os.path.realpath(path)}"
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def map_bound(limit_bytes: int) -> int:
    """The largest LMDB map (and so the largest data file) for a cache of ``limit_bytes``."""
    return max(MIN_MAP_SIZE, int(limit_bytes * (1 + MAP_SLACK)) + MIN_MAP_SIZE)


def _is_io_error(exc: lmdb.Error) -> bool:
    return "Input/output error" in str(exc)


def _free_text(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return f"free space unknown: {exc.strerror or exc}"
    return f"{free / 1024**2:.0f} MiB free on the disk"


def _open_lock_file(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def _hold(path: str) -> None:
    """Count one more writable handle on ``path`` in this process (shared flock on the first)."""
    with _lock:
        entry = _writers.get(path)
        if entry is None:
            fd = _open_lock_file(os.path.join(path, WRITERS_FILE))
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another process changes limits
            entry = (fd, 0)
        _writers[path] = (entry[0], entry[1] + 1)


def _unhold(path: str) -> None:
    with _lock:
        entry = _writers.get(path)
        if entry is None:
            return
        fd, count = entry
        if count > 1:
            _writers[path] = (fd, count - 1)
            return
        del _writers[path]
        os.close(fd)  # releases the shared lock


#: Directories whose permissions were warned about in this process (once each).
_warned_open: set[str] = set()


def _first_on_node() -> bool:
    """Whether this process is its node's first rank (or no rank): the one to warn."""
    try:
        return read_placement(os.environ).local_rank == 0
    except NodeLayoutError:
        return True


def make_private_dir(path: str) -> None:
    """Create ``path`` readable by its owner only; warn (once per process, never in a child
    process of a daemon or a DataLoader, nor in a node's other ranks: the first warned) about
    one others can read.

    Raises:
        PathNotWritable: ``path`` cannot be created (read-only, under a file, /proc).
    """
    existed = os.path.isdir(path)
    with writing(path, "the cache directory"):
        os.makedirs(path, mode=0o700, exist_ok=True)
        if not existed:
            os.chmod(path, 0o700)
            return
    require_writable_dir(path, "the cache directory")
    real = os.path.realpath(path)
    if (os.stat(path).st_mode & 0o077 and real not in _warned_open
            and multiprocessing.parent_process() is None and _first_on_node()):
        _warned_open.add(real)
        log.warning("cache directory %s is readable by other users; consider chmod 700", path)


class Env:
    """Transactions on one cache directory's LMDB environment (the ``env`` of a
    `SampleStore`; the storage layer as a whole is the *store*).

    Args:
        path: the cache directory.
        map_size: the initial map size in bytes.
        max_map_size: how far the map may grow on ``MapFullError``; past it, writes raise
            ``lmdb.MapFullError`` for the caller to treat as a full disk.
        readonly: open without write access (``verify``/``status`` on another user's cache).
        sync: flush each commit (data, then the meta page) before it returns: a returned
            commit survives power loss and kernel crashes. Without it a commit survives the
            crash of any process (``kill -9``), and the cache stays consistent after a power
            loss but may lose the commits of the last seconds.
    """

    def __init__(
        self,
        path: str,
        *,
        map_size: int = MIN_MAP_SIZE,
        max_map_size: int | None = None,
        readonly: bool = False,
        sync: bool = True,
    ) -> None:
        self.path = os.path.realpath(path)
        self.readonly = readonly
        self.sync = sync
        self.max_map_size = max(map_size, max_map_size or map_size)
        self._map_size = map_size
        self._pid = -1
        self._env: lmdb.Environment | None = None
        self._dbs: dict[bytes, lmdb._Database] = {}
        self._closed = False
        self._holding = False
        self._ensure_open()

    # -- process-level handle management ---------------------------------------------------

    def _ensure_open(self) -> lmdb.Environment:
        pid = os.getpid()
        if self._env is not None and self._pid == pid:
            return self._env
        if self._closed:
            raise CacheError(f"{self.path}: cache is closed")
        with _lock:
            entry = _envs.get(self.path)
            if entry is None or entry[2] != pid:
                entry = self._open_env(pid)
                _envs[self.path] = entry
                _refcounts[self.path] = 0
            _refcounts[self.path] += 1
        env, self._dbs, self._pid = entry
        self._env = env
        if not self.readonly:
            if not self._holding:
                _hold(self.path)
                self._holding = True
            if env.info()["map_size"] < self._map_size:
                self._set_map_size(self._map_size)
        return env

    def _open_env(self, pid: int) -> tuple[lmdb.Environment, dict[bytes, lmdb._Database], int]:
        if not self.readonly:
            make_private_dir(self.path)
        # Before LMDB maps it: a page past the file's end is a SIGBUS, not an error.
        check_data_file(self.path, create=not self.readonly)
        # The environment is shared by every Env on this path in the process, so it is
        # opened writable whenever the directory allows it; `readonly` Envs just never write.
        lmdb_readonly = self.readonly and not os.access(self.path, os.W_OK)
        try:
            env = _open_lmdb(
                self.path,
                map_size=self._map_size,
                subdir=True,
                readonly=lmdb_readonly,
                sync=self.sync,
                # With sync, the meta page is flushed too (a second fdatasync per commit):
                # without it LMDB keeps atomicity but a power loss may undo the last commit
                # that returned (lmdb.h, MDB_NOMETASYNC). Without sync neither is flushed.
                metasync=self.sync,
                readahead=False,  # random reads over a cache larger than RAM
                meminit=False,
                max_readers=MAX_READERS,
                max_dbs=len(ALL_DBS) + 2,
                mode=0o600,
                lock=True,
            )
        except (lmdb.InvalidError, lmdb.VersionMismatchError, lmdb.CorruptedError) as exc:
            raise CacheUnusable(f"{self.path}: not a cache this version can open ({exc}); "
                                "delete it and let a daemon fill it anew") from exc
        except lmdb.Error as exc:
            raise CacheError(f"{self.path}: cannot open the cache: {exc}") from exc
        dbs: dict[bytes, lmdb._Database] = {}
        for _attempt in range(5):
            try:
                with env.begin(write=not lmdb_readonly) as txn:
                    for name in ALL_DBS:
                        try:
                            # Read-only (a read-only mount, another user's cache): py-lmdb
                            # ends a read transaction with an abort, which closes the handles
                            # opened in it; without txn it opens one in a committed one.
                            dbs[name] = env.open_db(name, txn=None if lmdb_readonly else txn,
                                                    create=not lmdb_readonly)
                        except lmdb.NotFoundError:
                            if name not in OPTIONAL_DBS:
                                raise
                break
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # a writer grew the map while we opened: adopt its size
            except lmdb.NotFoundError as exc:
                env.close()
                raise CacheUnusable(f"{self.path}: an LMDB environment but not an epochcache "
                                    f"cache ({exc}); point cache.dir elsewhere") from exc
        return env, dbs, pid

    @property
    def dbs(self) -> dict[bytes, lmdb._Database]:
        """The sub-database handles of this process's environment (opened on first use)."""
        self._ensure_open()
        return self._dbs

    @property
    def lmdb_env(self) -> lmdb.Environment:
        """The ``lmdb.Environment``, opened on first use (again in a forked child)."""
        return self._ensure_open()

    def close(self) -> None:
        """Drop this handle; the environment closes when its last handle in the process does."""
        if self._env is None or self._closed:
            self._closed = True
            return
        self._closed = True
        if self._pid != os.getpid():
            self._env = None
            return
        if self._holding:
            self._holding = False
            _unhold(self.path)
        with _lock:
            _refcounts[self.path] = _refcounts.get(self.path, 1) - 1
            if _refcounts[self.path] <= 0:
                entry = _envs.pop(self.path, None)
                _refcounts.pop(self.path, None)
                if entry is not None:
                    entry[0].close()
        self._env = None

    # -- writers --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def alone(self) -> Iterator[bool]:
        """Whether this process is the only one holding the cache, kept true for the block.

        Processes that want to change the cache's limits take turns (``limits.lock``); inside
        the block no other process can open the cache for writing (it waits at open).

        Raises:
            CacheError: another process has been changing the limits for ``LIMITS_WAIT_S``.
        """
        if self.readonly:
            raise CacheError(f"{self.path}: opened read-only")
        self._ensure_open()
        limits_fd = _open_lock_file(os.path.join(self.path, LIMITS_FILE))
        try:
            deadline = time.monotonic() + LIMITS_WAIT_S
            while True:
                try:
                    fcntl.flock(limits_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise CacheError(
                            f"{self.path}: another process has been changing the cache's limits "
                            f"for {LIMITS_WAIT_S:.0f}s ({LIMITS_FILE} is locked)"
                        ) from None
                    time.sleep(0.05)
            with _lock:
                fd = _writers[self.path][0]
            # Linux converts a flock by dropping the shared lock first: a failed conversion
            # leaves none, so the shared lock is taken again in any case below.
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                sole = True
            except BlockingIOError:
                sole = False
            try:
                yield sole
            finally:
                fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(limits_fd)

    # -- map size ---------------------------------------------------------------------------

    @property
    def map_size(self) -> int:
        return int(self.lmdb_env.info()["map_size"])

    def set_map_limits(self, map_size: int, max_map_size: int) -> None:
        """Set the initial map size (growing the map now if it is smaller) and its bound."""
        self._map_size = map_size
        self.max_map_size = max(map_size, max_map_size)
        if not self.readonly and self.map_size < map_size:
            self._set_map_size(map_size)

    def _set_map_size(self, size: int) -> None:
        # Only valid with no transaction of this process open (py-lmdb, "Handling growth"):
        # other threads may be reading from the map this replaces.
        env = self.lmdb_env
        remap_lock.LOCK.remap(lambda: env.set_mapsize(size))
        log.debug("%s: LMDB map size set to %d bytes", self.path, size)

    def _grow_map(self) -> bool:
        current = self.map_size
        if current >= self.max_map_size:
            return False
        self._set_map_size(min(self.max_map_size, max(current * 3 // 2, current + MIN_MAP_SIZE)))
        return True

    # -- transactions -----------------------------------------------------------------------

    @contextlib.contextmanager
    def read(self) -> Iterator[lmdb.Transaction[memoryview]]:
        """A short read transaction; survives another process growing the map."""
        txn = begin_read(self.lmdb_env)
        try:
            yield txn
        finally:
            end_read(txn)

    def read_many(
        self, db: lmdb._Database, keys: list[bytes], fn: Callable[[memoryview], T]
    ) -> list[T | None]:
        """``fn(value)`` for each key (None where missing), in one read transaction.

        The hot read path, so no context manager around it. ``fn`` must copy what it keeps:
        the buffers point into the map and are valid only inside the transaction.
        """
        txn = begin_read(self.lmdb_env)
        try:
            get = txn.get
            return [None if (value := get(key, None, db)) is None else fn(value) for key in keys]
        finally:
            end_read(txn)

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction and commit it; grow the map when it is full.

        ``fn`` may run more than once (after a map growth), so it must not have side effects
        outside the transaction. ``lmdb.MapFullError`` escapes once the map is at its bound,
        and ``lmdb.DiskError`` (or the EIO of a short write) when the disk is full: callers
        lower the capacity.

        Raises:
            CacheIOError: the disk failed the write with EIO while it has room: a failing disk.
        """
        if self.readonly:
            raise CacheError(f"{self.path}: opened read-only")
        while True:
            env = self.lmdb_env
            lock = remap_lock.LOCK
            lock.enter()  # a write transaction holds buffers into the map too
            try:
                with env.begin(write=True, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                resize: lmdb.Error | None = None
            except lmdb.MapFullError as exc:
                resize = exc
            except lmdb.Error as exc:
                if _is_io_error(exc) and not self._disk_nearly_full():
                    raise CacheIOError(
                        f"{self.path}: the disk failed a write with an I/O error ({exc}; "
                        f"{_free_text(self.path)}): this is not a full disk but a failing one, so "
                        "the writer stops. Nothing committed was lost (the transaction was not "
                        "committed); check the disk and filesystem (dmesg, SMART), then restart"
                    ) from exc
                raise
            finally:
                lock.leave()
            # Outside the transaction: replacing the map waits for other threads' to end.
            if resize is None:
                # adopt the size another process set (the lambda is called at once)
                lock.remap(lambda: env.set_mapsize(0))  # noqa: B023
            elif not self._grow_map():
                raise resize

    def _disk_nearly_full(self) -> bool:
        # LMDB reports a short write (a full disk) as EIO too: tell the two apart by the room.
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return False
        return free < NEARLY_FULL_BYTES

    def file_bytes(self) -> int:
        """Size of the data file on disk (allocated blocks, since LMDB files can be sparse)."""
        try:
            st = os.stat(os.path.join(self.path, "data.mdb"))
        except FileNotFoundError:
            return 0
        return min(st.st_size, st.st_blocks * 512)
