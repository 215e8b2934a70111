"""Starting DataLoader workers so that none inherits a lock another thread of the trainer holds.

A worker started with ``fork`` is a copy of the trainer at the instant of the fork, locks
included, with only the forking thread running. A lock some other thread held at that instant
stays held in the worker forever, and the worker blocks the first time it takes it: torch's
``_worker_loop`` calls ``torch.manual_seed`` first thing, which takes
``torch.cuda._initialization_lock`` (even on a CPU-only build) and holds it while it formats a
stack, so a training loop that seeds torch while a background thread forks a worker hung the
job at the next epoch's first batch. Two rules keep fork safe here, and fork is kept because it
needs no picklable transform and no ``if __name__ == "__main__":`` guard (the README's quick
start is a plain script) and starts a worker in milliseconds:

1. **Workers are forked by the training thread, inside epochcache's own code** -- never by a
   background thread while the training loop runs user code. ``epochs()`` starts each
   loader's workers with an empty warm-up iteration (`start_workers`) on the thread that
   iterates it, at a point where that thread holds none of its own locks; the real epoch is
   then primed in the background without forking (a persistent iterator's ``_reset``).
2. **The locks a worker's start-up takes are held across every fork of the process**
   (`_before_fork`): torch's lazy-initialisation locks and numpy's global
   ``RandomState`` lock, the way CPython itself holds ``logging``'s locks across a fork. A
   user thread inside ``torch.manual_seed`` or ``np.random`` delays a fork by microseconds
   instead of deadlocking the child. epochcache's own locks are renewed in the child by the
   modules that own them (``register_at_fork`` in store/env.py, owners.py, remap_lock.py,
   data/stall.py, collate.py).

What fork cannot protect is a lock of the user's own code held by the user's own thread and
taken again by a transform in the worker; the ``forkserver`` and ``spawn`` start methods
(``multiprocessing_context=`` of ``epochs()`` or the DataLoader) isolate workers from every
thread of the trainer, at the price of a picklable dataset and a guarded script
(docs/howto/tuning.md). A worker that blocks anyway is caught by the stall watchdog, which
dumps its stacks and ends the job (`epochcache.data.stall`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

#: How long a fork waits for a start-up lock another thread holds (held for microseconds by
#: the code that takes them); past it the fork goes on without that one, logged.
_LOCK_WAIT_S = 2.0


def _startup_locks() -> Iterator[Any]:
    """The locks of modules already imported that a worker's start-up takes, in one fixed
    order (a fixed order cannot deadlock against a thread taking two of them)."""
    for name in ("torch.cuda", "torch.xpu", "torch.mtia"):
        module = sys.modules.get(name)
        lock = getattr(module, "_initialization_lock", None)
        if lock is not None:
            yield lock
    # The global RandomState behind np.random.seed & co. locks its bit generator.
    legacy = getattr(getattr(sys.modules.get("numpy.random"), "mtrand", None), "_rand", None)
    lock = getattr(getattr(legacy, "_bit_generator", None), "lock", None)
    if lock is not None:
        yield lock


_held: list[Any] = []  # the locks this fork holds, released on both sides after it
_skipped: list[str] = []  # those it could not take in time, logged in the parent after it


def _before_fork() -> None:
    for lock in _startup_locks():
        if lock.acquire(timeout=_LOCK_WAIT_S):
            _held.append(lock)
        else:  # a thread stuck with it; nothing is logged here (logging's locks are held)
            _skipped.append(repr(lock))


def _after_fork() -> None:
    while _held:
        _held.pop().release()


def _after_fork_in_parent() -> None:
    _after_fork()
    if _skipped:
        log.warning("a fork went on without the start-up lock(s) %s, held by another thread "
                    "for over %.0f s: a worker forked now may block on it (start workers with "
                    "multiprocessing_context='forkserver' to rule this out)",
                    ", ".join(_skipped), _LOCK_WAIT_S)
        _skipped.clear()


def _after_fork_in_child() -> None:
    _after_fork()
    _skipped.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def start_method(context: Any) -> str:
    """The start method a DataLoader with ``multiprocessing_context=context`` uses."""
    if context is None:
        return multiprocessing.get_start_method()
    if isinstance(context, str):
        return context
    return str(context.get_start_method())


class WarmUp:
    """Set while a loader's workers start: its sampler yields nothing (see
    `start_workers`)."""

    def __init__(self) -> None:
        self.active = False


def start_workers(loader: Any, warm_up: WarmUp,
                  enter: Callable[[], Any] | None = None) -> None:
    """Start the workers of ``loader`` (a DataLoader with ``persistent_workers=True``) now, on
    this thread, with an iteration that reads nothing: the workers are forked here, and a
    later ``iter(loader)`` only resets them for the real epoch (no fork), wherever it runs.

    ``warm_up`` is the flag its sampler checks; ``enter`` returns a context manager to start
    them under (the trainer's CUDA device, for the pin-memory thread).
    """
    if getattr(loader, "_iterator", None) is not None:
        return  # started before
    warm_up.active = True
    try:
        if enter is None:
            iter(loader)
        else:
            with enter():
                iter(loader)
    finally:
        warm_up.active = False
