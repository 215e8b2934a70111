"""DataLoader workers: started so that none inherits a lock another thread of the trainer
holds, and the figures they count brought back to the training loop (`Tallies`).

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

**Tallies.** A figure such as the bytes of samples decoded is counted by the reader, and with
``num_workers > 0`` the reader runs in DataLoader workers: a count kept in a worker's copy of
the reader never reaches the training loop. A `Tallies` block is the way back: one int64
table in shared memory (a torch tensor: DataLoader's pickler shares its memory with workers
started by ``fork``, ``forkserver`` or ``spawn``, as it does the batch ring's slots, see
`epochcache.data.ring`; freed with the loader) with a row per process that reads for one
loader (row 0 the process that made it, row ``w + 1`` DataLoader worker ``w``) and a column
per tally (`epochcache.epoch_record.TALLIES`: the figures marked ``tally=True``). Each
process adds only to its own row, so no lock is taken: an add is one aligned 8-byte write to
memory every process of the loader maps, once per batch.

Each of ``epochs()``' two alternating loaders has a block of its own, so that a batch its
workers prefetch for epoch k + 1 is counted in k + 1, never in k (`EpochLoader.tallies`).
A reader made for the user's own DataLoader (``cache.dataset()``) counts into a block of the
process alone (`Tallies.local`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..epoch_record import TALLIES
from ..store.env import PROCESS

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
        with enter() if enter is not None else contextlib.nullcontext():
            iter(loader)
    finally:
        warm_up.active = False


def _zeros(rows: int, shared: bool) -> torch.Tensor:
    """A zeroed table of ``rows`` rows of tallies, in shared memory or the process's. (A
    tensor, not a bare storage: a tensor pickles by plain pickle too, as a copy, where
    DataLoader's pickler shares its memory.)"""
    table = torch.zeros((rows, len(TALLIES)), dtype=torch.int64)
    return table.share_memory_() if shared else table  # type: ignore[no-untyped-call]


class Tallies:
    """A loader's tally block: counts added by each of its processes, read by the loop.

    Args:
        workers: the DataLoader workers that may add to it (a row each, and one for this
            process).
        shared: in shared memory (False: this process's counts alone, for a reader that
            no loop reads).
    """

    def __init__(self, workers: int, *, shared: bool = True) -> None:
        self.rows = workers + 1
        self.index = {name: column for column, name in enumerate(TALLIES)}
        self.table = _zeros(self.rows, shared)
        self.shared = shared
        self.home_pid = os.getpid()
        #: The reading at the end of the loader's last epoch (see `EpochLoader.tallies`).
        self.mark = np.zeros(len(TALLIES), dtype=np.int64)
        self._bound: object = None  # the process the row below is this process's in
        self._row = memoryview(b"")  # this process's row, bound on the first add

    @classmethod
    def local(cls) -> Tallies:
        """A block of this process alone."""
        return cls(0, shared=False)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_bound"], state["_row"] = None, None
        return state

    def _table(self) -> np.ndarray:
        return self.table.numpy()

    def _bind(self) -> memoryview:
        info = get_worker_info()
        row = 0 if info is None else info.id + 1
        if info is None and os.getpid() != self.home_pid:
            # A copy in another process that is no worker of the loader (a spawned DDP rank):
            # a block of its own, so that two processes never add to one row.
            self.table = _zeros(1, shared=False)
            self.rows, self.home_pid = 1, os.getpid()
        if row >= self.rows:  # a local block's worker, or more workers than rows
            if self.shared:
                log.warning("tallies: DataLoader worker %d has no row in a block of %d "
                            "workers: what it counts is not reported", row - 1, self.rows - 1)
            self._row = np.zeros(len(TALLIES), dtype=np.int64).data
        else:
            # A memoryview's item add is half the cost of a numpy element's (~0.1 us).
            self._row = self._table()[row].data
        self._bound = PROCESS[0]
        return self._row

    def add(self, name: str, count: int) -> None:
        """Add ``count`` to tally ``name`` (one of `TALLIES`) in this process's row."""
        row = self._row if self._bound is PROCESS[0] else self._bind()
        row[self.index[name]] += count

    def reading(self) -> np.ndarray:
        """Every tally, summed over the block's processes."""
        total: np.ndarray = self._table().sum(axis=0)
        return total

    def since_mark(self, *, advance: bool = False) -> dict[str, int]:
        """Each tally since the mark (the end of the loader's last epoch); ``advance`` moves
        the mark to now."""
        now = self.reading()
        counts = dict(zip(TALLIES, (int(value) for value in now - self.mark)))
        if advance:
            self.mark = now
        return counts

    def totals(self) -> dict[str, int]:
        """Each tally since the block was made."""
        return dict(zip(TALLIES, (int(value) for value in self.reading())))
