"""Serialise replacing the LMDB memory map with the transactions of other threads.

``set_mapsize`` -- adopting a map another process grew (after ``MapResizedError``), growing our
own (after ``MapFullError``), or raising it when a second handle opens with a larger size --
replaces the process's memory map. py-lmdb then invalidates every transaction the process has
open, in every thread, and the buffers those transactions handed out point into unmapped
memory: a thread copying a sample out of the map at that moment crashes the process
(segmentation fault) or fails with "Attempt to operate on closed/deleted/dropped object".
LMDB's rule is that no transaction of the process may be open while the map is replaced.

`LOCK` enforces it per process: every transaction (read or write) is an *entry*, and
`RemapLock.remap` waits until every entry of other threads has left, keeps new ones out
while it runs, then lets them in. Entering costs a list append and a flag check (no lock: the
hot read path takes one per sample), which is safe because list ``append``/``remove`` are atomic
and ordered (the GIL): a reader either entered before the remapper raised its flag (and is
waited for) or sees the flag (and steps back until the remap is done). A thread's own entries
are not waited for (it cannot leave while it waits): a remap nested in a transaction of its own
thread invalidates that transaction, as LMDB always did.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class RemapLock:
    """Transactions enter shared; a map replacement runs alone (see the module docstring)."""

    def __init__(self) -> None:
        self._active: list[int] = []  # thread idents of open transactions (one per entry)
        self._remapping = False
        self._cond = threading.Condition(threading.Lock())

    def enter(self) -> None:
        """Before beginning a transaction; pair with `leave`."""
        ident = threading.get_ident()
        while True:
            self._active.append(ident)
            if not self._remapping:
                return
            self._active.remove(ident)  # a remap is on: step back until it is done
            with self._cond:
                if self._remapping:
                    self._cond.wait(0.05)

    def leave(self) -> None:
        """After the transaction ended (committed or aborted)."""
        self._active.remove(threading.get_ident())
        if self._remapping:
            with self._cond:
                self._cond.notify_all()

    def remap(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a ``set_mapsize``) once no other thread has a transaction open."""
        me = threading.get_ident()
        with self._cond:
            while self._remapping:  # one remap at a time
                self._cond.wait(0.05)
            self._remapping = True
        try:
            with self._cond:
                while any(ident != me for ident in list(self._active)):
                    self._cond.wait(0.01)  # woken by leave(); the timeout guards a lost wake-up
            return fn()
        finally:
            with self._cond:
                self._remapping = False
                self._cond.notify_all()


LOCK = RemapLock()


def _after_fork_in_child() -> None:
    global LOCK
    # The parent's other threads do not exist here: their entries would be waited for forever.
    LOCK = RemapLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
