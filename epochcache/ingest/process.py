"""What a sampler process (and the daemon's) sets up for itself: it never outlives its parent,
and its large buffers come from the heap.

Never outliving the parent takes two mechanisms, because either alone leaves a gap:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the sampler the moment its
  parent dies, whatever the sampler is doing (waiting for space behind a lease, blocked in a
  fetch). Nothing committed is lost: a commit is durable when it returns, and a sampler killed
  mid-commit leaves the cache as a ``kill -9`` does (LMDB rolls the transaction back);
* everywhere, `Lifeline.parent_gone`, which every wait loop of a sampler checks, so a
  platform without ``prctl`` still stops within about a second.

The heap: every sample a sampler fetches and frames is a fresh buffer of its size. glibc serves
allocations over 128 KiB (its initial mmap threshold) with a new ``mmap`` each, and the kernel
zero-fills every page on first touch: measured here, framing a 1 MiB sample while a batch of
them is alive cost 230 us instead of 100 us, and reading the object paid the same again.
Raising the mmap threshold (to glibc's maximum, 32 MiB) and the trim threshold
(`reuse_freed_buffers`) makes those buffers come from the heap and be reused once freed. The
price is that a sampler keeps the memory of its peak in-flight bytes (bounded by
``sampler.max_bytes_in_flight``) instead of returning it to the system between batches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1
#: mallopt's parameters (``<malloc.h>``) and the values set.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def kill_with_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); True if it will.

    The signal is tied to the parent *thread* that started this process: the daemon starts
    and restarts samplers from the thread that runs its supervision loop, which lives as long
    as the samplers do.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = bool(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    return ok


class Lifeline:
    """Whether this process's daemon (``parent_pid``) is still there.

    Args:
        parent_pid: the daemon's pid; None disables the check (a sampler run by hand).
    """

    def __init__(self, parent_pid: int | None) -> None:
        self.parent_pid = parent_pid
        self._gone = False

    def parent_gone(self) -> bool:
        """True once the parent has died (this process was re-parented); one getppid() call."""
        if not self._gone and self.parent_pid is not None and os.getppid() != self.parent_pid:
            self._gone = True
            log.warning("daemon %d is gone; stopping", self.parent_pid)
        return self._gone


def reuse_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where that is not
    possible (another C library), which only costs speed."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the thresholds; large buffers stay mmap-backed")
    return ok
