"""EpochLoader: what epochs() yields per epoch, and the timing that drives the next epoch.

Iterating it yields the epoch's batches and, as they go by, keeps an average of the gap between
batches: from it the loader tells epochs() when the epoch is close enough to its end to take
the next snapshot (so the next epoch sees what the cache gained during this one), and, a few
batches in, to start preparing the next loader.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from .schedule import EpochSchedule
from .stall import WorkerCheck, process_state, with_time_limit
from .workers import Tallies


class EpochLoader:
    """What epochs() yields per epoch: iterate it once for the epoch's batches.

    Attributes:
        epoch: the epoch number.
        dataset: the epoch's [`EpochDataset`][epochcache.data.dataset.EpochDataset] (its snapshot, on this node's leader).
        loader: the underlying DataLoader.
    """

    def __init__(self, epoch: int, schedule: EpochSchedule, loader: DataLoader[Any], iterator: Any,
                 on_near_end: Callable[[], None], on_started: Callable[[], None], lead_s: float,
                 depth: int, stall: Any, stall_action: str = "raise",
                 tallies: Tallies | None = None) -> None:
        self.epoch, self.dataset, self.loader = epoch, schedule.dataset, loader
        self._schedule, self._iterator = schedule, iterator
        self._on_near_end, self._lead_s, self._depth = on_near_end, lead_s, depth
        self._on_started: Callable[[], None] | None = on_started
        self._stall, self._stall_action = stall, stall_action
        self._used = False
        self.batch_times: list[float] = []
        #: Release each batch's samples once the loop asks for the next batch (progressive
        #: release). A run that checkpoints mid-epoch turns this off and calls
        #: `release` with what its last checkpoint covers, so that a resumed epoch
        #: finds every sample after that checkpoint.
        self.release_as_consumed = True
        #: Batches handed to the loop so far.
        self.yielded = 0
        #: Once [`state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] was taken, the epoch's lease outlives an abandoned epoch
        #: (a stop, a crash) by this long, for a resume (epochs()' ``resume_grace_s``).
        self.resume_grace_s = 0.0
        self._kept = False
        self._block = tallies
        self._counted: dict[str, int] | None = None  # the epoch's tallies, once it is over

    def __len__(self) -> int:
        return self._schedule.n_batches

    @property
    def seqs(self) -> np.ndarray:
        """This rank's sample order for the epoch (sequence numbers)."""
        return self._schedule.order[: self._schedule.samples(self._schedule.n_batches)]

    def _maybe_trigger(self, done: int, gap_s: float) -> None:
        remaining = self._schedule.n_batches - done
        if remaining <= self._depth + 2 or (gap_s > 0 and remaining * gap_s <= self._lead_s):
            self._on_near_end()

    def __iter__(self) -> Iterator[Any]:
        if self._used:
            raise RuntimeError(f"the loader of epoch {self.epoch} was already iterated; "
                               "epochs() yields a fresh one per epoch")
        self._used = True
        it, n = self._iterator, self._schedule.n_batches
        gap, last = 0.0, time.monotonic()
        self._maybe_trigger(0, 0.0)
        for i in range(n):
            if self._stall is not None:
                with self._stall.watch(f"epoch {self.epoch} batch {i} (waiting for workers)",
                                       self._stall_action) as activity:
                    activity.check = functools.partial(self._check_workers, i)
                    activity.on_raise = self._stop_workers
                    activity.cache_path = self.dataset.reader.path
                    batch = next(it)
            else:
                batch = next(it)
            now = time.monotonic()
            self.batch_times.append(now)
            # An EMA of the gap between batches: the scheduler's lead time in batches. It starts
            # at the second batch: the first one often waited in the workers' prefetch queue,
            # and that near-zero wait taken as a gap triggered the next snapshot at once.
            if i == 1:
                gap = now - last
            elif i > 1:
                gap = 0.8 * gap + 0.2 * (now - last)
            last = now
            if i == 2:
                self._start_next()
            self._maybe_trigger(i + 1, gap)
            self.yielded = i + 1
            yield batch
            if self.release_as_consumed:
                self._schedule.release(i + 1)
        self.dataset.finished = True  # read to its end: its lease goes, checkpoint or not
        self.finish()

    def _check_workers(self, batch: int) -> WorkerCheck:
        """For a stall report: the workers of this loader, which one owes ``batch`` and what
        each process is doing, and the batch's first sample key (on the stall thread)."""
        it = self._iterator
        workers = list(getattr(it, "_workers", ()))
        # torch's iterator: _task_info[index] is (worker,) until the batch arrives
        task = getattr(it, "_task_info", {}).get(getattr(it, "_rcvd_idx", -1), ())
        owner = task[0] if len(task) == 1 else None
        check = WorkerCheck()
        if owner is not None and owner < len(workers):
            check.worker = f"DataLoader worker {owner} (pid {workers[owner].pid})"
        seqs = self._schedule.batch(batch)
        if len(seqs):
            cache = self.dataset.reader.cache
            check.key = with_time_limit(lambda: repr(cache.info(int(seqs[0])).key),
                                        f"seq {int(seqs[0])}")
            check.key += f" (the first of the batch's {len(seqs)})"
        check.lines.append(f"epoch {self.epoch} batch {batch} is owed by "
                           f"{check.worker or 'no worker yet (the sampler or pin thread)'}")
        check_workers(it, check)
        return check

    def _stop_workers(self, error: Exception) -> None:
        stop_workers(self._iterator)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch: enough to resume it exactly after the batches
        yielded so far (``epochs(resume=...)``), on the same snapshot in the same order.

        A few numbers: the epoch, the node's lease, this rank's place (``local_rank`` of
        ``local_world_size``, ``node``, ``rank``), the length of its lane and how far along
        it the loop has trained (``position``), and what the order depends on (seed,
        shuffle, samples per epoch). To resume on the same layout each rank needs only its
        own state; to resume on another number of ranks per node, give every rank the
        states of all ranks (a list, or a dict by rank): the rest of each node's epoch is
        then dealt anew (see `epochcache.data.resume`). An epoch that was itself
        resumed on another layout also records that earlier split (``"resumed"``).

        The first state taken in an epoch keeps the epoch's lease for a resume: however the
        job stops before the epoch's end (SIGTERM, Ctrl-C, a crash, a kill), the lease
        outlives it by ``resume_grace_s`` ([`keep_for_resume`][epochcache.data.epoch_loader.EpochLoader.keep_for_resume])."""
        if self.resume_grace_s > 0 and not self._kept:
            self.keep_for_resume(self.resume_grace_s)
        return self.position_state()

    def position_state(self) -> dict[str, Any]:
        """The numbers of [`state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict],
        without keeping the epoch's lease: for what reads where the epoch stands without
        checkpointing it (a run's manifest)."""
        schedule = self._schedule
        state = {"kind": "epochcache.epochs", "version": 1, "epoch": self.epoch,
                 "lease": schedule.dataset.lease_id, "position": schedule.position(self.yielded),
                 "lane": schedule.lane_length, "batches": self.yielded, **schedule.identity}
        if schedule.resumed_split is not None:
            state["resumed"] = schedule.resumed_split
        return state

    @property
    def resume_report(self) -> dict[str, int] | None:
        """For the first epoch of ``epochs(resume=...)``: what the resume continued and what it
        could not, over the whole job (the same on every rank), else None. Keys:
        ``resume_batches`` (per rank), ``resume_continued`` (samples of the interrupted epoch
        read again), ``resume_evicted`` (evicted since, skipped), ``resume_left_out`` (beyond
        the agreed batch count, skipped), ``resume_fresh_ranks`` (ranks that started the
        epoch on a fresh snapshot: a new node, or a lease gone), ``resume_departed`` and
        ``resume_departed_nodes`` (the rest on nodes that did not come back, skipped)."""
        return self._schedule.resume_report

    def keep_for_resume(self, grace_s: float) -> None:
        """Keep the epoch's lease ``grace_s`` seconds after this process dies (a checkpoint
        names it), so that a resumed run finds its samples."""
        lease_id = self._schedule.dataset.lease_id
        self._kept = True
        if lease_id and self._schedule.dataset.snapshot is not None:  # this node's leader holds it
            self._schedule.dataset.reader.cache.keep_for_resume(lease_id, grace_s)

    def release(self, batches: int) -> None:
        """The first ``batches`` batches are done with for good: their samples may be
        evicted from now on (those no later snapshot protects)."""
        self._schedule.release(batches)

    def tallies(self) -> dict[str, int]:
        """The figures the epoch's reads counted (those marked ``tally=True`` in
        `epochcache.epoch_record`), in this process and the loader's DataLoader workers:
        so far, or, once the epoch is over, in all.

        The loader's block counts from the end of its previous epoch (``epochs()`` alternates
        two loaders, so that is epoch - 2): batches its workers prefetched for the next epoch
        are that epoch's. Of an epoch left before its end, what its workers were still
        reading counts in the next epoch of the same loader."""
        if self._counted is not None:
            return dict(self._counted)
        return {} if self._block is None else self._block.since_mark()

    def _start_next(self) -> None:
        hook, self._on_started = self._on_started, None
        if hook is not None:
            hook()

    def finish(self) -> None:
        """The epoch is over (or abandoned): make sure the next one is being prepared."""
        if self._counted is None and self._block is not None:
            self._counted = self._block.since_mark(advance=True)
        self._start_next()
        self._on_near_end()


def check_workers(iterator: Any, check: WorkerCheck) -> None:
    """Add the workers of a DataLoader iterator to a stall report: their pids (each is asked
    for its stacks) and what each process is doing."""
    for index, worker in enumerate(getattr(iterator, "_workers", ())):
        if worker.pid:
            check.pids.append(worker.pid)
            check.lines.append(f"DataLoader worker {index} (pid {worker.pid}): "
                               f"{process_state(worker.pid)}; its stacks follow")


def stop_workers(iterator: Any) -> None:
    """End a stalled epoch: kill the iterator's workers, which the waiting loop sees at once
    (DataLoader's SIGCHLD handler, or its next poll) and turns into the stall's error."""
    for worker in list(getattr(iterator, "_workers", ())):
        if worker.pid and worker.is_alive():
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except OSError:
                pass
