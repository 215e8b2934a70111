"""Which boot of which machine this process runs on: what per-boot values kept in a cache mean.

Some values mean something only on the boot that read them: an instant of ``time.monotonic()``
(``CLOCK_MONOTONIC`` starts again from zero at every boot, and runs from another offset in
another time namespace), a pid, a process's start time in clock ticks since boot. A cache
outlives its boot (a node reboots, a cache is copied or moved to another host), so every such
value written under ``cache.dir`` travels with the identity of its boot, and a process that
reads it under another one ignores it:

* `boot_id`: the kernel's random id of this boot (``/proc/sys/kernel/random/boot_id``), the
  same in every container of the machine, different after a reboot and on every other host;
* `clock_id`: the boot id and this process's time namespace offsets, hashed to 16 bytes:
  two processes read the same ``time.monotonic()`` exactly when their clock ids are equal.
* `process_record` and `recorded_alive`: the pid, start ticks and boot a document (a lease, a
  stall record, a lowered capacity) names, and whether that process still runs (`pid_alive`);
  `heartbeat_alive` for a document that may come from another host (the daemon's).

Why a stamp and not wall-clock instants with bounds: the pace and request budget files need a
clock every process of a host reads alike and that never jumps (the wall clock jumps with NTP
and by hand, and a bound on how far ahead an instant may be is a guess: a legitimate
reservation may lie minutes ahead at a low ``max_requests_per_s``). The stamp keeps the
monotonic clock where it is right and says exactly when it is not.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from collections.abc import Mapping
from typing import Any

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
