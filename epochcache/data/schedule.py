"""An epoch's schedule: what one epoch reads on one rank, in which order, in which batches.

An `EpochSchedule` is one epoch on one rank: its dataset (holding the snapshot's lease
on the node's leader), its seeded sample order and its batch count. (What a snapshot's readers
have read, for eviction, is its *release plan*: `epochcache.store.plans`.) The DataLoader
epochs() builds is driven by a `ScheduleIndices`, which yields batches of sequence
numbers once the schedule exists, over a `SeqBatches` dataset that turns each such batch
into a finished batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from ..store.plans import Releaser
from .collate import batch_buffers
from .dataset import EpochDataset, snapshot_gone
from .reader import SampleReader
from .ring import hand_off
from .tallies import Tallies
from .workers import WarmUp


def epoch_order(seqs: np.ndarray, epoch: int, seed: int = 0, shuffle: bool = True,
                samples_per_epoch: int | None = None) -> np.ndarray:
    """The epoch's sample order: a seeded permutation of ``seqs`` (same inputs, same order).

    With ``samples_per_epoch`` larger than the snapshot, whole permutations are concatenated
    (resampling), so each sample appears at most once more than any other.
    """
    n = int(seqs.shape[0])
    want = n if samples_per_epoch is None else samples_per_epoch
    if n == 0 or want == 0:
        return np.empty(0, dtype=np.uint64)
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    parts = []
    for _ in range(math.ceil(want / n)):
        parts.append(rng.permutation(n) if shuffle else np.arange(n))
    index = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return seqs[index[:want]]


class EpochSchedule:
    """One epoch on this rank: its dataset (holding the lease on the leader) and batch order."""

    def __init__(self, epoch: int, dataset: EpochDataset, order: np.ndarray, batch_size: int,
                 n_batches: int, seconds: float, releaser: Releaser | None = None) -> None:
        self.epoch, self.dataset, self.order = epoch, dataset, order
        self.batch_size, self.n_batches, self.seconds = batch_size, n_batches, seconds
        #: Releases the samples of the batches trained on (progressive release), when the
        #: epoch has a release plan.
        self.releaser = releaser
        #: The rank's lane: the epoch's order as scheduled (``order`` is what is left of it in
        #: a resumed epoch), its length, and for a resumed epoch each sample's place in it.
        self.lane_length = n_batches * batch_size
        self.offsets: np.ndarray | None = None
        self.resumed_from = 0
        #: Where each batch ends in ``order`` (``n_batches + 1`` counts from 0), when its
        #: batches are not all ``batch_size`` long (a resumed epoch, see
        #: `Deal`); None: whole batches.
        self.bounds: np.ndarray | None = None
        #: The earlier split the lane was dealt from, for the state (see
        #: `epochcache.data.resume`); None: the epoch's own lanes.
        self.resumed_split: dict[str, Any] | None = None
        #: What the resume continued and could not, over the job (`resume.report`).
        self.resume_report: dict[str, int] | None = None
        #: What a resume must match (seed, shuffle, ...), for `position_state`.
        self.identity: dict[str, Any] = {}
        self._ends: list[int] | None = None  # position() by batches (see _positions)

    def samples(self, batches: int) -> int:
        """How many samples of ``order`` the first ``batches`` batches hold."""
        batches = max(0, min(batches, self.n_batches))
        if self.bounds is not None:
            return int(self.bounds[batches])
        return min(batches * self.batch_size, len(self.order))

    def position(self, batches: int) -> int:
        """How far along the lane the first ``batches`` batches of ``order`` reach."""
        n = self.samples(batches)
        if self.offsets is None:
            return self.resumed_from + n
        return int(self.offsets[n - 1]) + 1 if n else self.resumed_from

    def release(self, batches: int) -> None:
        """The loop is done with the first ``batches`` batches: eviction may take their
        samples (those no later epoch's snapshot protects)."""
        releaser = self.releaser
        if releaser is None:
            return
        ends = self._ends
        if ends is None:
            ends = self._ends = self._positions()
        if not 0 <= batches <= self.n_batches:
            batches = max(0, min(batches, self.n_batches))
        releaser.release(ends[batches])

    def _positions(self) -> list[int]:
        """`position` after each number of batches, 0 to ``n_batches``: computed once
        per epoch with numpy (the plan is complete by the first release), so a release per
        batch is a list lookup instead of two method calls."""
        batches = np.arange(self.n_batches + 1, dtype=np.int64)
        samples = (self.bounds[: self.n_batches + 1].astype(np.int64) if self.bounds is not None
                   else np.minimum(batches * self.batch_size, len(self.order)))
        if self.offsets is None:
            ends = self.resumed_from + samples
        else:
            offsets = np.asarray(self.offsets, dtype=np.int64)
            ends = np.where(samples > 0, offsets[np.maximum(samples - 1, 0)] + 1,
                            self.resumed_from) if len(offsets) else np.full_like(
                                samples, self.resumed_from)
        positions: list[int] = ends.tolist()
        return positions

    def batch(self, i: int) -> np.ndarray:
        if self.bounds is not None:
            return self.order[int(self.bounds[i]) : int(self.bounds[i + 1])]
        return self.order[i * self.batch_size : (i + 1) * self.batch_size]


class SeqBatch(NamedTuple):
    """One batch to read: its sequence numbers, and the epoch and lease they belong to (a
    sample found gone is reported as its lease's loss, see `snapshot_gone`)."""

    seqs: np.ndarray
    epoch: int
    lease_id: str


class ScheduleIndices(Sampler[SeqBatch]):
    """Yields the current schedule's batches of sequence numbers; waits for the schedule first.

    The DataLoader's ``sampler=`` (torch's word; in epochcache a *sampler* is the daemon's).

    While ``warm_up`` is active it yields nothing: the loader's workers are being started by
    an iteration that reads nothing (see `epochcache.data.workers.start_workers`).
    """

    def __init__(self) -> None:
        self.schedule: cf.Future[EpochSchedule] | None = None
        self.warm_up = WarmUp()

    def __iter__(self) -> Iterator[SeqBatch]:
        if self.warm_up.active:
            return
        if self.schedule is None:
            raise RuntimeError("epochcache: loader used before its epoch was scheduled")
        try:
            schedule = self.schedule.result()
        except BaseException:  # noqa: BLE001 - reported by epochs() from the schedule itself
            # Scheduling failed or was cancelled (a run stopping while workers start): no
            # batches. Raised here, the error would escape DataLoader's iterator half-built,
            # its workers started and never shut down, left to the garbage collector, whose
            # finalizers run in any order: a queue's pipe closed under its feeder thread
            # ("Bad file descriptor", "semaphore or lock released too many times").
            return
        epoch, lease_id = schedule.epoch, schedule.dataset.lease_id
        for i in range(schedule.n_batches):
            yield SeqBatch(schedule.batch(i), epoch, lease_id)

    def __len__(self) -> int:
        return self.schedule.result().n_batches if self.schedule is not None else 0


class SeqBatches(Dataset[Any]):
    """The DataLoader's dataset: indexed by a batch of sequence numbers, returns the batch.

    Args:
        reader: reads the batches.
        collated: the reader collates (no ``collate_fn`` of the user's).
        pinned: batches read in the training process are read into page-locked memory (the
            DataLoader pins them: ``pin_memory=True`` where CUDA is available).
    """

    def __init__(self, reader: SampleReader, collated: bool, pinned: bool = False) -> None:
        self.reader, self.collated, self.pinned = reader, collated, pinned

    def __getitem__(self, batch: SeqBatch) -> Any:
        try:
            if self.collated:
                with batch_buffers(self.pinned):
                    return hand_off(self.reader.read_batch(batch.seqs))
            return self.reader.read_samples(batch.seqs)
        except KeyError as exc:
            raise snapshot_gone(self.reader, batch.lease_id, batch.epoch, exc) from exc


def tallies_of(loader: DataLoader[Any] | None) -> Tallies | None:
    """The tally block ``loader``'s reads count into (None: not a loader of epochs())."""
    batches = getattr(loader, "dataset", None)
    return batches.reader.tallies if isinstance(batches, SeqBatches) else None


def identity(batch: Any) -> Any:
    return batch


def in_process_batches(loader: DataLoader[Any], sampler: ScheduleIndices) -> Iterator[Any]:
    """What iterating ``loader`` yields when it has no workers and pins nothing, without
    DataLoader's per-batch bookkeeping (a profiler ``record_function`` per batch: ~7% of the
    time of a batch of 64 KiB samples read in process).

    Same fetch and collate as ``_SingleProcessDataLoaderIter``; callers use the DataLoader's
    own iterator when it pins memory.
    """
    fetch: Callable[[SeqBatch], Any] = loader.dataset.__getitem__
    collate = loader.collate_fn
    for batch in sampler:
        yield collate(fetch(batch))
