"""The byte limits of a cache: the configured capacity and headroom, and the limit in force.

Capacity and headroom are stored in the cache's ``meta`` table, so every process that opens
the cache (samplers, trainers, ``status``) works to the same limits. The limit in force, the
*effective capacity*, is the configured capacity unless the disk cannot hold it: then it is
lowered (`Capacity.lower`) for the process that found out, recovers by itself and is never
stored as a limit. Headroom shrinks in proportion with it.

* **at open** the capacity is fitted to the room on the disk (free space plus the data file);
* **a write that fails** on a full disk (``ENOSPC``, or the ``EIO`` LMDB reports for a short
  write on a nearly full disk) or a full LMDB map, with nothing left to evict, lowers the
  limit a little below what is stored;
* **while lowered, it probes** every ``EPOCHCACHE_CAPACITY_PROBE_S`` seconds (default 30, read
  when a limit is lowered) from the write path: when the disk has more room than when the limit
  was lowered, the limit goes up in proportion, to the configured capacity once the disk
  allows it. A full map tells nothing about its room, so a limit a full map lowered is lifted at
  the probe. A limit lowered again soon after a probe raised it makes the next probe wait twice
  as long (at most 10 minutes), so a disk that stays full costs little;
* **never persisted**: a process that opens the cache starts at the configured capacity (fitted
  to the disk), whatever happened before. Caches written by versions that stored a lowered limit
  in ``meta`` (``effective_capacity``) have that key ignored and deleted on open.

So that ``epochcache status`` (another process) can show it, a lowered limit is *published* in
the ``state`` table as the document ``capacity/<pid>/<id>``: the limit, the configured capacity,
the reason, since when, the pid and its start time. It is deleted when the limit recovers or the
process closes the cache; documents of dead processes are ignored by readers and deleted by the
next process that opens the cache for writing. Publishing is best effort: on a full disk even
this small write may fail, and it is tried again at the next probe.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import lmdb

from ..errors import CacheError, CacheUnusable
from ..paths import process_record, recorded_alive
from ..units import format_size, headroom_bytes, parse_headroom
from .datafile import no_cache_here
from .env import Env
from .records import (
    C_EFFECTIVE_CAPACITY,
    C_FORMAT,
    DB_META,
    DB_STATE,
    FORMAT_VERSION,
    pack_u64,
    unpack_u64,
)
from .tables import Counters

_M_CAPACITY = b"capacity"
_M_HEADROOM = b"headroom"


def stored_limits(path: str) -> tuple[int | None, int | None]:
    """``(capacity, headroom)`` in bytes as stored in the cache at ``path`` (None: not stored).

    Raises:
        CacheUnusable: the cache is of another format (a newer epochcache made it), or its
            data file is not one LMDB can open (`epochcache.store.datafile`).
    """
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None, None
    env = Env(path, readonly=True)
    try:
        with env.read() as txn:
            meta = env.dbs[DB_META]
            check_stored_format(path, txn.get(C_FORMAT, db=meta))
            cap, head = txn.get(_M_CAPACITY, db=meta), txn.get(_M_HEADROOM, db=meta)
            return (
                None if cap is None else unpack_u64(cap),
                None if head is None else unpack_u64(head),
            )
    finally:
        env.close()


def check_stored_format(path: str, stored: bytes | memoryview | None) -> None:
    """Refuse a cache whose stored format version is not this version's (None: a cache being
    created)."""
    if stored is None or unpack_u64(stored) == FORMAT_VERSION:
        return
    version = unpack_u64(stored)
    newer = version > FORMAT_VERSION
    fix = ("upgrade epochcache (pip install -U epochcache) to open it" if newer
           else "open it with the version that made it")
    raise CacheUnusable(
        f"{path}: cache format {version}, made by {'a newer' if newer else 'an older'} "
        f"epochcache (this version reads format {FORMAT_VERSION}); {fix}, or delete the "
        "directory and let a daemon fill it anew (every sample is still in the remote)")


def resolve_limits(
    path: str, capacity: int | None, headroom: float | int | str
) -> tuple[int, int, bool]:
    """``(capacity, headroom, changed)`` in bytes for opening the cache at ``path``.

    A given capacity wins (and the headroom is computed from it); None keeps the stored one.
    ``changed`` tells whether the result differs from what the cache stores.

    Raises:
        CacheUnusable: no capacity was given and the cache stores none (or there is none).
    """
    stored_cap, stored_head = stored_limits(path)
    if capacity is None and stored_cap is None:
        if not os.path.exists(os.path.join(path, "data.mdb")):
            raise CacheUnusable(no_cache_here(path))
        raise CacheUnusable(f"{path}: the cache has no stored capacity (its creation was "
                            "interrupted?); open it with Cache(path, capacity='...')")
    cap = capacity if capacity is not None else int(stored_cap or 0)
    if capacity is not None or stored_head is None:
        head = headroom_bytes(parse_headroom(headroom), cap)
    else:
        head = stored_head
    return cap, head, (stored_cap, stored_head) != (cap, head)


log = logging.getLogger("epochcache.cache")  # one logger for everything a cache does

PROBE_ENV = "EPOCHCACHE_CAPACITY_PROBE_S"
DEFAULT_PROBE_S = 30.0
MAX_PROBE_S = 600.0
#: Keep this fraction of the disk's room unused when sizing the cache to the disk.
DISK_RESERVE = 0.05
#: State documents of lowered limits are named ``capacity/<pid>/<id>``.
STATE_PREFIX = "capacity/"


def probe_interval_s() -> float:
    """Seconds between probes of a lowered limit (``EPOCHCACHE_CAPACITY_PROBE_S``)."""
    raw = os.environ.get(PROBE_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_PROBE_S
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %.0f", PROBE_ENV, raw, DEFAULT_PROBE_S)
        return DEFAULT_PROBE_S
    return max(0.0, value)


def disk_room(env: Env) -> int:
    """Bytes the cache could occupy on its disk now: free space plus its own data file."""
    return shutil.disk_usage(env.path).free + env.file_bytes()


@dataclass
class LoweredLimit:
    """The state of a lowered limit.

    Attributes:
        limit: the capacity in force, in bytes.
        reason: why, for logs and ``status``.
        cause: ``disk`` (room on the disk can be measured) or ``map`` (it cannot).
        since: when the limit was first lowered (``time.time()``).
        room: `disk_room` when it was last lowered or raised.
        probe_s: the current probe interval.
        next_probe: ``time.monotonic()`` of the next probe.
        raised: the last probe raised the limit (if it fails again, probes slow down).
    """

    limit: int
    reason: str
    cause: str
    since: float
    room: int
    probe_s: float
    next_probe: float
    raised: bool = False


class Capacity:
    """The limits of one open cache: the configured ones, stored, and the one in force in this
    process, lowered while the disk (or the LMDB map) is full (see the module docstring).

    Args:
        env: the cache's LMDB environment.
        capacity_bytes: stored bytes to keep.
        headroom_bytes: extra bytes writers may use while leases pin the oldest samples.
    """

    def __init__(self, env: Env, capacity_bytes: int, headroom_bytes: int) -> None:
        self.env = env
        self.capacity_bytes = capacity_bytes
        self.headroom_bytes = headroom_bytes
        #: The lowered limit of this process, if any.
        self.state: LoweredLimit | None = None
        self._published = False
        self._publish_pending = False
        # One document per Capacity: a process may hold a cache open twice (`epochcache run`
        # runs the daemon next to the trainer), and only the publishing process withdraws it
        # (a forked DataLoader worker inherits this object).
        self._pid = os.getpid()
        self._name = f"{STATE_PREFIX}{self._pid}/{uuid.uuid4().hex[:8]}"
        #: (monotonic time, probe interval) of the last full recovery
        self._recovered: tuple[float, float] | None = None

    def save(self, txn: lmdb.Transaction) -> None:
        """Store the format version, capacity and headroom (refusing another format)."""
        meta = self.env.dbs[DB_META]
        check_stored_format(self.env.path, txn.get(C_FORMAT, db=meta))
        txn.put(C_FORMAT, pack_u64(FORMAT_VERSION), db=meta)
        txn.put(_M_CAPACITY, pack_u64(self.capacity_bytes), db=meta)
        txn.put(_M_HEADROOM, pack_u64(self.headroom_bytes), db=meta)

    @property
    def effective(self) -> int:
        """Capacity in force in this process: the configured one, lowered while the disk (or
        the LMDB map) is full."""
        state = self.state
        return self.capacity_bytes if state is None else min(self.capacity_bytes, state.limit)

    def lowered(self) -> dict[str, Any] | None:
        """The lowest limit in force in any live process (this one included), with its reason,
        as published for ``status``; None when no process runs lowered."""
        own = self.document()
        docs = [doc for doc in published(self.env) if own is None or doc["name"] != own["name"]]
        docs = sorted(docs + ([own] if own is not None else []), key=lambda d: int(d["limit"]))
        if not docs or int(docs[0]["limit"]) >= self.capacity_bytes:
            return None
        return docs[0]

    def headroom_for(self, limit: int) -> int:
        """Headroom scaled down with the capacity when the disk forced a lower one."""
        if limit >= self.capacity_bytes or self.capacity_bytes == 0:
            return self.headroom_bytes
        return int(self.headroom_bytes * limit / self.capacity_bytes)

    # -- the three ways a limit changes -----------------------------------------------------

    def fit_to_disk(self) -> None:
        """At open: drop the back-off state that earlier processes or versions left in the
        cache, then lower the limit in force when the disk cannot hold capacity + headroom."""
        _clean_stale(self.env)
        room = disk_room(self.env)
        fit = self._fit(room)
        if fit < self.capacity_bytes:
            free = shutil.disk_usage(self.env.path).free
            reason = (f"capacity + headroom ({format_size(self.capacity_bytes + self.headroom_bytes)}) "
                      f"does not fit the {format_size(free)} free on the disk")
            log.warning(
                "%s: %s; using an effective capacity of %s until the disk has room (free space "
                "or lower cache.capacity)", self.env.path, reason, format_size(fit),
            )
            self._set(LoweredLimit(fit, reason, "disk", time.time(), room, probe_interval_s(),
                              time.monotonic() + probe_interval_s()))

    def lower(self, exc: Exception, incoming: int) -> None:
        """A write failed on a full disk or map, with nothing left to evict: lower the limit
        in force below what is stored (a back-off that `probe` lifts)."""
        with self.env.read() as txn:
            stored = Counters.load(txn, self.env.dbs[DB_META]).bytes
        cause = "map" if isinstance(exc, lmdb.MapFullError) else "disk"
        reason = ("LMDB map full" if cause == "map"
                  else "disk full") + f" ({type(exc).__name__}: {exc})"
        new_limit = max(0, min(self.effective, stored) - max(incoming, stored // 10))
        now = time.monotonic()
        previous = self.state
        interval = probe_interval_s()
        if previous is not None:
            interval = previous.probe_s * 2 if previous.raised else previous.probe_s
        elif self._recovered is not None and now - self._recovered[0] < 2 * self._recovered[1] + 60:
            interval = self._recovered[1] * 2  # lowered again soon after it recovered
        interval = min(MAX_PROBE_S, max(interval, probe_interval_s()))
        since = time.time() if previous is None else previous.since
        room = disk_room(self.env)
        again = (previous is not None and previous.raised) or (
            previous is None and interval > probe_interval_s())
        level = logging.INFO if again else logging.WARNING  # a failed probe is no news
        log.log(
            level,
            "%s: %s with %s stored; lowering the effective capacity to %s (configured %s). It "
            "goes back up by itself once writes succeed and the disk has room (checked every "
            "%.0fs); if this persists, free disk space or lower cache.capacity.",
            self.env.path, reason, format_size(stored), format_size(new_limit),
            format_size(self.capacity_bytes), interval,
        )
        # Not published here: on a full map even that small write takes the last free pages
        # that eviction needs; published after the next successful write (`settle`).
        self.state = LoweredLimit(new_limit, reason, cause, since, room, interval, now + interval)
        self._publish_pending = True

    def settle(self) -> None:
        """After a successful write: publish a limit that changed (best effort)."""
        if self._publish_pending:
            self._publish()

    def probe(self) -> None:
        """From the write path: raise a lowered limit when the disk has room again (timed)."""
        state = self.state
        if state is None:
            return
        now = time.monotonic()
        if now < state.next_probe:
            return
        state.next_probe = now + state.probe_s
        room = disk_room(self.env)
        fit = self._fit(room)
        if state.cause == "disk":
            extra = room - state.room
            if extra <= state.room // 100:
                state.raised = False
                return  # no more room than when it was lowered: stay
            # The limit grows by the room that came back (less the reserve and its headroom).
            new_limit = min(fit, state.limit + self.capacity_bytes - self._fit_short(extra))
        else:
            new_limit = fit  # the map's room cannot be measured: try the disk's limit
        if new_limit >= self.capacity_bytes:
            # A limit a full map lowered is lifted on trust (the next full map lowers it again, quietly).
            level = logging.WARNING if state.cause == "disk" else logging.INFO
            log.log(level, "%s: writes succeed and the disk has room: effective capacity back to "
                    "the configured %s (it was lowered to %s: %s)", self.env.path,
                    format_size(self.capacity_bytes), format_size(state.limit), state.reason)
            self._recovered = (now, state.probe_s)
            self._set(None)
        elif new_limit > state.limit:
            log.info("%s: the disk has room again: effective capacity raised to %s",
                     self.env.path, format_size(new_limit))
            state.limit, state.room, state.raised = new_limit, room, True
            self._publish()

    def reset(self) -> None:
        """Forget a lowered limit (the caller freed space), then fit to the disk again."""
        self._set(None)
        self.fit_to_disk()

    def close(self) -> None:
        """Withdraw this process's published limit (best effort)."""
        if os.getpid() == self._pid and (self._published or self._publish_pending):
            self.state = None
            self._publish()

    # -- helpers ----------------------------------------------------------------------------

    def _fit(self, room: int) -> int:
        """The capacity whose capacity + headroom fit ``room`` (less the reserve)."""
        return self.capacity_bytes - self._fit_short(room)

    def _fit_short(self, room: int) -> int:
        """How far the capacity whose capacity + headroom fit ``room`` is below the configured
        capacity (0: it fits)."""
        need = self.capacity_bytes + self.headroom_bytes
        usable = int(room * (1 - DISK_RESERVE))
        if need <= usable or need == 0:
            return 0
        return self.capacity_bytes - int(usable * self.capacity_bytes / need)

    def _set(self, state: LoweredLimit | None) -> None:
        self.state = state
        self._publish()

    def _publish(self) -> None:
        name = self._name.encode()
        state = self.state
        if os.getpid() != self._pid:
            return  # a forked child never writes
        if state is None and not self._published and not self._publish_pending:
            return
        raw = None if state is None else json.dumps(self._document(state)).encode()

        def run(txn: lmdb.Transaction) -> None:
            db = self.env.dbs[DB_STATE]
            if raw is None:
                txn.delete(name, db=db)
            else:
                txn.put(name, raw, db=db)

        try:
            self.env.write(run)
        except (lmdb.Error, OSError, CacheError) as exc:
            # A full disk may refuse even this small write: try again at the next probe.
            log.debug("%s: cannot publish the capacity in force yet (%s)", self.env.path, exc)
            self._publish_pending = True
            return
        self._publish_pending = False
        self._published = raw is not None

    def document(self) -> dict[str, Any] | None:
        """What this process publishes while its limit is lowered (None: not lowered)."""
        return None if self.state is None else self._document(self.state)

    def _document(self, state: LoweredLimit) -> dict[str, Any]:
        return {
            "name": self._name,
            **process_record(),
            "limit": state.limit,
            "capacity": self.capacity_bytes,
            "reason": state.reason,
            "since": state.since,
            "updated": time.time(),
            "probe_s": state.probe_s,
        }


def published(env: Env) -> list[dict[str, Any]]:
    """The lowered limits published by live processes, lowest first."""
    found = [doc for doc in _documents(env) if recorded_alive(doc)]
    return sorted(found, key=lambda d: int(d.get("limit", 0)))


def _documents(env: Env) -> list[dict[str, Any]]:
    prefix = STATE_PREFIX.encode()
    docs = []
    with env.read() as txn:
        cursor = txn.cursor(db=env.dbs[DB_STATE])
        if cursor.set_range(prefix):
            for key, value in cursor:
                if not bytes(key).startswith(prefix):
                    break
                name = bytes(key).decode(errors="replace")
                try:
                    doc = dict(json.loads(bytes(value)))
                except ValueError:
                    doc = {"pid": -1}
                docs.append({**doc, "name": name})
    return docs


def _clean_stale(env: Env) -> None:
    """Delete the documents of dead processes and a limit stored by an older version."""
    with env.read() as txn:
        legacy = txn.get(C_EFFECTIVE_CAPACITY, db=env.dbs[DB_META]) is not None
    stale = [doc for doc in _documents(env) if not recorded_alive(doc)]
    if not (legacy or stale):
        return  # the common case: no write transaction at open

    def run(txn: lmdb.Transaction) -> None:
        txn.delete(C_EFFECTIVE_CAPACITY, db=env.dbs[DB_META])
        for doc in stale:
            txn.delete(str(doc["name"]).encode(), db=env.dbs[DB_STATE])

    try:
        env.write(run)
    except (lmdb.Error, OSError) as exc:
        log.debug("%s: cannot clean up old capacity documents yet (%s)", env.path, exc)
        return
    if legacy:
        log.info("%s: ignoring (and deleting) a lowered capacity stored by an older version; a "
                 "lowered capacity now lasts while the process runs, never stored", env.path)
