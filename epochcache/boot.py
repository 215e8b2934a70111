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

Why a stamp and not wall-clock instants with bounds: the pace and request budget files need a
clock every process of a host reads alike and that never jumps (the wall clock jumps with NTP
and by hand, and a bound on how far ahead an instant may be is a guess: a legitimate
reservation may lie minutes ahead at a low ``max_requests_per_s``). The stamp keeps the
monotonic clock where it is right and says exactly when it is not.
"""

from __future__ import annotations

import functools
import hashlib

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
