"""A sampler's lifeline to its daemon: it must never outlive it.

Two mechanisms, because either alone leaves a gap:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the sampler the moment its
  parent dies, whatever the sampler is doing (waiting for space behind a lease, blocked in a
  fetch). Nothing committed is lost: a commit is durable when it returns, and a sampler killed
  mid-commit leaves the cache as a ``kill -9`` does (LMDB rolls the transaction back);
* everywhere, `Lifeline.parent_gone`, which every wait loop of a sampler checks, so a
  platform without ``prctl`` still stops within about a second.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1


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
