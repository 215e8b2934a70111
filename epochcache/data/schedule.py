"""Preparing an epoch, for both loaders; ``epochs()``' schedule of it; the wait for
``min_samples`` before the first.

**Preparing.** ``epochs()`` (`epochs`) and ``stream()`` (`stream`) prepare an epoch the same
way, with a `Preparer`:

1. **The snapshot is the node's.** The node's leader (local rank 0) takes it under a lease
   whose release plan has one *part* per rank of the node (`Preparer.parts`; none with
   ``release="epoch"``), and shares its sequence numbers with the node's other ranks
   (`Preparer.share`: one collective under DDP).
2. **The order is the seed's.** The epoch's order is a seeded permutation of the snapshot
   (`epoch_order`): every rank and worker that computes it, or a resume that
   computes it again, gets the same one. Each rank reads its disjoint slot of it
   (`Preparer.rank_order`).
3. **What a rank reads is its part of the release plan.** Its lanes (the rank's loop, or each
   DataLoader worker of a stream) go into the part that rank owns
   (`write_release_part`), so eviction may take each sample once every lane that reads
   it is past it. A disk that cannot hold the plan leaves the snapshot protected whole.

What differs stays with each loader: ``epochs()`` agrees a batch count across ranks (and
resumes by node, `resume`), a stream agrees a sample count and publishes the epoch to
its DataLoader workers as a ticket (`epochcache.data.tickets`).

**The schedule.** An `EpochSchedule` is one epoch of ``epochs()`` on one rank: its dataset
(holding the snapshot's lease on the node's leader), its order and its batch count. The
DataLoader epochs() builds is driven by a `ScheduleIndices`, which yields batches of sequence
numbers once the schedule exists, over a `SeqBatches` dataset that turns each such batch into a
finished batch.

**The wait** (`wait_for_samples`) shows a rich progress bar on a terminal, log lines elsewhere.
A wait that makes no progress says so as a WARNING, which reaches stderr in a plain script
with no logging configured (Python's last-resort handler): after `NO_DAEMON_WARN_S` without a
new sample when no daemon fills the cache, after `STALLED_WARN_S` when one does, and again
every `WARN_EVERY_S` while the count stays put (a wait of 400 s with no daemon printed nothing
at all, issue 37).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import MinSamplesUnreachable
from ..paths import heartbeat_alive
from ..placement import Placement
from ..store.reads import Releaser, write_part
from .collate import batch_buffers
from .dataset import EpochDataset, snapshot_gone
from .reader import SampleReader
from .ring import hand_off
from .workers import Tallies, WarmUp

if TYPE_CHECKING:
    from ..options import EpochOptions
    from ..store import SampleStore, Snapshot
    from .distributed import NodeSync

log = logging.getLogger(__name__)

#: ``take()`` of `Preparer.share`: the snapshot's sequence numbers and lease id.
Take = Callable[[], "tuple[np.ndarray, str]"]
#: Seconds without a new sample, no daemon filling the cache, before the wait warns.
NO_DAEMON_WARN_S = 5.0
#: Seconds without a new sample before the wait warns while a daemon runs (it lists first).
STALLED_WARN_S = 60.0
#: Seconds between two warnings while the count stays put.
WARN_EVERY_S = 60.0


class Preparer:
    """Prepares the epochs of one loader on one rank (see the module docstring).

    Args:
        cache: the cache the loader reads.
        place: this rank's place in the job.
        sync: the node's collectives under DDP (None: this rank plans alone).
        options: the epoch order's and release's (seed, shuffle, samples_per_epoch, release).
        split_ranks: each rank of the node reads its own slot of the order (False: every
            rank reads all of it, for frameworks that split the data themselves).
    """

    def __init__(self, cache: SampleStore, place: Placement, sync: NodeSync | None,
                 options: EpochOptions, *, split_ranks: bool = True) -> None:
        self.cache, self.place, self.sync = cache, place, sync
        self.seed, self.shuffle = options.seed, bool(options.shuffle)
        self.samples_per_epoch, self.progressive = options.samples_per_epoch, options.progressive
        self.split_ranks = split_ranks

    @property
    def distributed(self) -> bool:
        return self.sync is not None

    @property
    def parts(self) -> int:
        """The parts of an epoch's release plan: one per rank of the node (0: no plan)."""
        if not self.progressive:
            return 0
        return self.place.local_world_size if self.distributed else 1

    @property
    def part(self) -> int:
        """The part of the release plan this rank writes."""
        return self.place.local_rank if self.distributed else 0

    @property
    def slot(self) -> tuple[int, int]:
        """``(slot, slots)``: which slice of the node's order this rank reads."""
        if self.split_ranks:
            return self.place.local_rank, self.place.local_world_size
        return 0, 1

    def snapshot(self, epoch: int, label: str) -> tuple[np.ndarray, str, Snapshot]:
        """Take the epoch's snapshot here (the node's leader): ``(seqs, lease_id, snapshot)``,
        under a lease whose release plan has `parts` parts."""
        snapshot = self.cache.snapshot(epoch=epoch, label=label, plan_parts=self.parts)
        return snapshot.seqs, snapshot.lease_id, snapshot

    def share(self, take: Take) -> tuple[np.ndarray, str]:
        """The node's snapshot: ``take()`` on the leader, shared with the node's ranks (one
        collective under DDP; every rank calls it together)."""
        if self.sync is None:
            return take()
        return self.sync.share_seqs(take if self.place.local_rank == 0 else None)

    def order(self, seqs: np.ndarray, epoch: int) -> np.ndarray:
        """The node's order of the epoch: the seeded permutation of its snapshot (the same on
        every process that computes it, a resume included)."""
        return epoch_order(seqs, epoch, self.seed, self.shuffle, self.samples_per_epoch)

    def split(self, order: np.ndarray) -> np.ndarray:
        """This rank's disjoint slot of the node's order (a strided view, no copy)."""
        slot, slots = self.slot
        return order if slots <= 1 else order[slot::slots]

    def rank_order(self, seqs: np.ndarray, epoch: int, samples: int = -1) -> np.ndarray:
        """This rank's order of the epoch, cut to ``samples`` (all when negative)."""
        return rank_order(seqs, epoch, self.seed, self.shuffle, self.samples_per_epoch,
                          *self.slot, samples)

    def release_part(self, lease_id: str, lanes: Sequence[np.ndarray],
                     lane: int = 0) -> Releaser | None:
        """Write this rank's part of the release plan (see `write_release_part`); None
        without release plans."""
        if not self.progressive:
            return None
        return write_release_part(self.cache, lease_id, self.part, lanes, lane)


def rank_order(seqs: np.ndarray, epoch: int, seed: int, shuffle: bool,
               samples_per_epoch: int | None, slot: int = 0, slots: int = 1,
               samples: int = -1) -> np.ndarray:
    """The epoch's seeded order over a snapshot, the ``slot`` of ``slots`` of it, cut to
    ``samples`` (all when negative)."""
    order = epoch_order(seqs, epoch, seed, shuffle, samples_per_epoch)
    if slots > 1:
        order = order[slot::slots]
    return order if samples < 0 else order[:samples]


def write_release_part(cache: SampleStore, lease_id: str, part: int,
                       lanes: Sequence[np.ndarray], lane: int = 0) -> Releaser | None:
    """Write ``part`` of a lease's release plan: the ``lanes`` its readers read, in order
    (the first reader to get here writes it; the lanes are the same for all), and return the
    releaser of ``lane``. None when there is nothing to plan, or when the disk cannot hold the
    plan (full or read-only): the snapshot then stays protected whole until it ends."""
    if not lease_id or not any(len(one) for one in lanes):
        return None
    try:
        write_part(cache.path, lease_id, part, list(lanes))
    except OSError as exc:
        log.warning("%s: could not write the epoch's release plan (%s): its samples stay "
                    "protected until it ends", cache.path, exc)
        return None
    return Releaser(cache.path, lease_id, part, lane)


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
    batches, collate = loader.dataset, loader.collate_fn
    if isinstance(batches, SeqBatches) and batches.collated and not batches.pinned:
        # Straight from the reader: in this process a batch needs no buffer scope nor hand-off
        # (those are for workers and pinned memory), and its collate is the identity.
        read = batches.reader.read_batch
        for batch in sampler:
            try:
                out = read(batch.seqs)
            except KeyError as exc:
                raise snapshot_gone(batches.reader, batch.lease_id, batch.epoch, exc) from exc
            yield out
        return
    fetch: Callable[[SeqBatch], Any] = batches.__getitem__
    for batch in sampler:
        yield collate(fetch(batch))


def wait_for_samples(cache: SampleStore, min_samples: int, timeout_s: float | None = None,
                     poll_s: float = 0.5, judge: Callable[[int], bool] | None = None) -> int:
    """Block until ``cache`` holds ``min_samples`` samples; return how many it holds.

    Args:
        judge: called with the count at every poll: True ends the wait early (with fewer
            samples), an exception ends it with that error (``epochcache run`` passes
            `epochcache.run.startup.FillWatch`).

    Raises:
        TimeoutError: not enough samples after ``timeout_s`` (the message says how many).
        MinSamplesUnreachable: the cache is at its capacity and evicting below min_samples.
    """
    count = cache.counters().samples
    if count >= min_samples:
        return count
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    # With a judge the caller watches the daemon itself (`epochcache run`, which may have just
    # started it): asking whether it runs only puzzled a new user's first run.
    log.info("%s: waiting until %d samples are cached (%d now)%s", cache.path, min_samples,
             count, "" if judge is not None else "; is the daemon running?")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress("waiting for samples", BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), transient=True, console=Console(stderr=True),
                        disable=not sys.stderr.isatty())
    last_log = since = time.monotonic()  # since: when the count last grew
    warned: float | None = None
    with progress:
        task = progress.add_task("fill", total=min_samples, completed=count)
        while count < min_samples:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{cache.path}: only {count} of min_samples={min_samples} samples cached after "
                    f"{timeout_s:g} s; start `epochcache daemon` or lower train.min_samples"
                )
            time.sleep(poll_s)
            counters = cache.counters()
            now = time.monotonic()
            if counters.samples != count:
                since, warned = now, None
            count = counters.samples
            if count < min_samples and counters.evicted > 0 and counters.bytes >= 0.9 * cache.effective_capacity:
                # Eviction has started: the cache is as full as its capacity lets it get, and
                # waiting longer would wait forever.
                raise MinSamplesUnreachable(
                    f"{cache.path}: min_samples={min_samples} cannot be reached: the cache holds "
                    f"{count} samples at its capacity and has started evicting; lower "
                    "train.min_samples or raise cache.capacity"
                )
            if count < min_samples and judge is not None and judge(count):
                return count
            if count < min_samples and judge is None and (
                    warned is None or now - warned >= WARN_EVERY_S):
                # A run (judge) watches its daemon and ends the wait itself.
                if _warn_if_stuck(cache, count, min_samples, now - since):
                    warned = now
            progress.update(task, completed=min(count, min_samples))
            if time.monotonic() - last_log > 10:
                last_log = time.monotonic()
                log.info("%s: %d/%d samples cached", cache.path, count, min_samples)
    return count


def _warn_if_stuck(cache: SampleStore, count: int, min_samples: int, quiet_s: float) -> bool:
    """Warn that the wait makes no progress, with what to do; whether it warned."""
    if quiet_s < NO_DAEMON_WARN_S:
        return False
    # The daemon's health document (epochcache.ingest.health, which data/ does not import).
    daemon = cache.tables.get_state("daemon")
    age_s = time.time() - float((daemon or {}).get("heartbeat", 0))
    waiting = (f"{cache.path}: waiting for min_samples={min_samples} ({count} cached, none new "
               f"for {quiet_s:.0f} s)")
    if daemon is None or not heartbeat_alive(daemon, age_s):
        log.warning("%s and no daemon is filling this cache: start one (`epochcache daemon "
                    "CONFIG`, or `with epochcache.Daemon(config):` around the loop), fill it "
                    "with cache.put_many(), or lower min_samples (wait_timeout_s= ends the wait "
                    "with an error)", waiting)
        return True
    if quiet_s < STALLED_WARN_S:
        return False
    log.warning("%s although its daemon (pid %s) runs: `epochcache status %s` shows its "
                "samplers' last errors", waiting, daemon.get("pid"), cache.path)
    return True
