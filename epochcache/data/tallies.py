"""Tallies: per-epoch figures counted where the reading is done, DataLoader workers included.

A figure such as the bytes of samples decoded is counted by the reader, and with
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

import logging
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..epoch_record import TALLIES
from ..store.env import PROCESS

log = logging.getLogger(__name__)


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
