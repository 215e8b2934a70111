"""Lease owners: one lock file per process that holds leases, and the heartbeat of its leases.

Whether a lease's owner still lives is asked of the kernel, not inferred from a pid or a
hostname: a process that holds leases on a cache holds an exclusive ``flock`` on its own file
``owners/<owner id>.lock`` in the cache directory, from its first lease there until its last is
released (the kernel drops the lock when the process ends, however it ends), and every lease
names its owner id. A lease
is alive while that lock is held. This is right across PID namespaces and hostnames -- containers
sharing the cache's volume on one machine, which LMDB's own locking already requires -- where a
pid means nothing to another namespace (a live lease was reclaimed at once) and a hostname
proves nothing.

The file is written under a temporary name, locked, then renamed into place, so an owner file
is never seen unlocked while its owner lives. Another process tests it with a non-blocking
shared lock: refused means alive; granted means the owner is gone (the file is removed with its
leases). A process opening a second descriptor on its own file is refused too, so it never
judges itself dead. A forked child (a DataLoader worker) forgets the parent's owner and makes
its own if it ever takes a snapshot. The file is removed with the process's last lease on the
cache, or at exit when it holds none; a process that exits holding leases leaves it (unlocked: its leases are then reclaimed,
and the file with them), and files left by dead processes are swept by
`sweep_dead_owners`.

Where the lock cannot serve -- the owner file could not be created or locked (a read-only or
lock-less filesystem, no owners directory), or it has disappeared -- liveness falls back to the
lease's heartbeat: while any snapshot of this process is open, a daemon thread refreshes the
heartbeat of its leases every quarter of the lease timeout (`Heartbeats`), and a lease is
presumed dead after its timeout without one. The timeout travels in the lease itself, so the
owner's promise is what every judge uses.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

OWNERS_DIR = "owners"
_SUFFIX = ".lock"
#: A temporary owner file older than this is the debris of a process killed while creating it.
_STALE_TMP_S = 60.0

_lock = threading.Lock()
#: cache path -> [owner id, fd holding its exclusive lock (-1: none), leases and pending ones]
_owners: dict[str, list[Any]] = {}
_warned: set[str] = set()  # paths where an owner lock could not be taken (logged once)


def _owner_path(cache_path: str, owner: str) -> str:
    return os.path.join(cache_path, OWNERS_DIR, owner + _SUFFIX)


def _after_fork_in_child() -> None:
    global _lock
    # The child shares the parent's lock (one open file description): closing its copy of the
    # descriptor keeps the parent's lock, and the child's own leases get an owner of their own.
    for _owner, fd, _count in _owners.values():
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    _owners.clear()
    _lock = threading.Lock()
    _heartbeats.clear()


def _remove_own_files() -> None:
    # Only owners that still hold leases are left at exit (the last end_lease removes an
    # entry), and their files must stay: an unlocked file is what tells the next judge that
    # the leases are dead (it reclaims them and removes the file). Without the file the judge
    # cannot tell and keeps the lease for its heartbeat timeout (seen after Ctrl-C of a run).
    for path, (owner, fd, count) in list(_owners.items()):
        if fd >= 0 and count <= 0:
            remove_owner(path, owner)


def _create(cache_path: str) -> tuple[str, int]:
    owner = uuid.uuid4().hex
    directory = os.path.join(cache_path, OWNERS_DIR)
    tmp = os.path.join(directory, f".{owner}.tmp")
    fd = -1
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "created": time.time()}).encode())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, _owner_path(cache_path, owner))  # visible only once locked
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if cache_path not in _warned:
            _warned.add(cache_path)
            log.warning("%s: cannot hold an owner lock in %s (%s); the leases of this process "
                        "are kept alive by their heartbeat instead", cache_path, directory,
                        exc.strerror or exc)
        return owner, -1
    return owner, fd


def begin_lease(cache_path: str) -> str:
    """This process's owner id for a lease about to be written on ``cache_path`` (the owner
    lock is taken with the first one); pair with `end_lease`."""
    with _lock:
        entry = _owners.get(cache_path)
        if entry is None:
            entry = _owners[cache_path] = [*_create(cache_path), 0]
        entry[2] += 1
        return str(entry[0])


def end_lease(cache_path: str) -> None:
    """One lease of this process on ``cache_path`` is gone; with the last, the owner lock goes
    too (a process that opens many caches does not keep a descriptor per cache)."""
    with _lock:
        entry = _owners.get(cache_path)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        del _owners[cache_path]
    owner, fd, _count = entry
    if fd >= 0:
        remove_owner(cache_path, owner)  # before the lock goes: never seen dead
        os.close(fd)


def lock_held(path: str) -> bool | None:
    """Whether a live process holds an exclusive ``flock`` on the file ``path``: True, False,
    or None when it cannot tell (no such file, or the filesystem refuses locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # also drops the shared lock taken when the owner was dead
    return False


def owner_alive(cache_path: str, owner: str) -> bool | None:
    """Whether ``owner`` still holds its lock: True, False, or None when the lock cannot tell
    (no owner file, or the filesystem refuses locks)."""
    return lock_held(_owner_path(cache_path, owner))


def remove_owner(cache_path: str, owner: str) -> None:
    """Delete an owner's file: a dead one's after its leases were reclaimed, or this
    process's own as it lets go of its lock."""
    with contextlib.suppress(OSError):
        os.unlink(_owner_path(cache_path, owner))


def sweep_dead_owners(cache_path: str, in_use: Iterable[str]) -> list[str]:
    """Delete the owner files of dead processes that no lease names; return their ids."""
    directory = os.path.join(cache_path, OWNERS_DIR)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    keep, removed, now = set(in_use), [], time.time()
    for name in names:
        full = os.path.join(directory, name)
        if name.startswith(".") and name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - os.stat(full).st_mtime > _STALE_TMP_S:
                    os.unlink(full)
            continue
        owner = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else ""
        if owner and owner not in keep and owner_alive(cache_path, owner) is False:
            remove_owner(cache_path, owner)
            removed.append(owner)
    return removed


class Heartbeats:
    """One daemon thread per process refreshing the heartbeats of its open snapshots' leases.

    Each cache registers ``beat(lease_ids)`` (one write transaction for all of them) with its
    interval; the thread ends when no lease is left and starts again with the next.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: cache path -> (beat, interval, the lease ids of this process on it)
        self._caches: dict[str, tuple[Callable[[list[str]], None], float, set[str]]] = {}
        self._thread: threading.Thread | None = None
        self._due: dict[str, float] = {}

    def clear(self) -> None:
        self._cond = threading.Condition()
        self._caches.clear()
        self._due.clear()
        self._thread = None

    def add(self, cache_path: str, lease_id: str, beat: Callable[[list[str]], None],
            interval_s: float) -> None:
        with self._cond:
            _beat, interval, leases = self._caches.get(cache_path, (beat, interval_s, set()))
            leases.add(lease_id)
            # The newest handle's beat: an older handle on the same path may have been closed.
            self._caches[cache_path] = (beat, min(interval, interval_s), leases)
            self._due.setdefault(cache_path, time.monotonic() + interval_s)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="epochcache-heartbeat",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, cache_path: str, lease_id: str) -> bool:
        """Stop refreshing ``lease_id``; whether it was this process's."""
        with self._cond:
            entry = self._caches.get(cache_path)
            if entry is None or lease_id not in entry[2]:
                return False
            entry[2].discard(lease_id)
            if not entry[2]:
                del self._caches[cache_path]
                self._due.pop(cache_path, None)
            self._cond.notify()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._caches:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [(path, self._caches[path]) for path, at in self._due.items() if at <= now]
                if not due:
                    self._cond.wait(max(0.01, min(self._due.values()) - now))
                    continue
                for path, (_beat, interval, _leases) in due:
                    self._due[path] = now + interval
                work = [(path, beat, sorted(leases)) for path, (beat, _i, leases) in due]
            for path, beat, leases in work:  # outside the lock: a write transaction
                try:
                    beat(leases)
                except Exception as exc:  # noqa: BLE001 - a closed cache, a full disk: retried
                    log.warning("%s: could not refresh the heartbeat of %d leases: %s", path,
                                len(leases), exc)


_heartbeats = Heartbeats()


def heartbeats() -> Heartbeats:
    """This process's heartbeat thread (see `Heartbeats`)."""
    return _heartbeats


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_remove_own_files)
