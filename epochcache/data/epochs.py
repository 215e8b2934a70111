"""epochs(): a DataLoader per epoch over a fresh snapshot, the next one prepared in the background.

While epoch k runs, two background threads prepare epoch k+1:

* the *builder* makes the DataLoader and calls ``iter()`` on it, which starts its workers (the
  expensive part: ~1 s per worker with ``spawn``) and primes their prefetch queue; the batch
  sampler blocks in that priming until the schedule exists;
* the *scheduler* waits until epoch k is nearly over (a lead time estimated from the batch rate
  and from how long the last schedule took), then takes the snapshot, so epoch k+1 trains on what
  the cache gained during epoch k, shuffles it and agrees the batch count across ranks.

So the boundary between epochs costs about one batch gap: the new workers are already up and
their first batches already read. A failure on either thread is re-raised in the training loop
``from`` the original exception.

Without workers and without DDP there is nothing to start and no collective to wait for, so the
next epoch is scheduled in the training thread itself, two batches before the end of the current
one (~0.3 ms: a snapshot and a shuffle), and the previous epoch's lease is released there too: on
a background thread the same work cost the training thread several times that in GIL hand-offs.

The loader reads whole batches: its sampler yields arrays of sequence numbers and the dataset
returns finished batches (see `SampleReader.read_batch`), so no per-sample work happens in
``collate``. Without a transform the default is ``num_workers=0``: reading 64 KiB from LMDB's
shared pages in the training process beats shipping batches from workers through shared memory.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..errors import PrepareFailed, StallError
from ..options import (
    EPOCH_NAMES,
    LOADER_NAMES,
    EpochOptions,
    LoaderOptions,
    ReaderOptions,
    resolve_options,
)
from ..placement import Placement, detect_placement, dist_initialized
from ..store.env import cache_identity
from .dataset import EpochDataset
from .distributed import NodeSync
from .epoch_loader import EpochLoader, check_workers, stop_workers
from .reader import SampleReader
from .resume import (
    COUNT,
    RESUMED,
    adopt_node,
    deal,
    ended_lease,
    lease_tag,
    log_resume,
    report,
    resume_rank,
)
from .ring import forget_exited
from .schedule import (
    EpochSchedule,
    Preparer,
    ScheduleIndices,
    SeqBatches,
    identity,
    in_process_batches,
    tallies_of,
    wait_for_samples,
)
from .stall import WorkerCheck, arm_stack_dump, get_watchdog
from .states import NodeStates, check_resume, order_identity
from .workers import Tallies, start_method, start_workers

if TYPE_CHECKING:
    from ..store import SampleStore

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    pass


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of an epoch's DataLoader generator on global rank ``rank``.

    DataLoader seeds worker ``w`` with ``base + w``, ``base`` drawn from this generator, so the
    workers' seeds depend on (seed, epoch, rank, worker id): the same on a rerun, different on
    every rank (identical augmentations on every rank would shrink the effective batch).
    """
    state = np.random.SeedSequence([seed, epoch, rank]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1  # 63 bits: manual_seed takes it as is


def _seed_worker(user_init: Callable[[int], None] | None, stall_file: str | None,
                 worker_id: int) -> None:
    # A stall report asks each worker for its stacks (a forked worker inherited the handler).
    arm_stack_dump(stall_file)
    # torch seeds each worker from the loader's generator (see loader_seed); numpy and random
    # follow it, so a transform's randomness is reproducible from epochs(seed=...).
    seed = torch.initial_seed()
    np.random.seed(np.random.SeedSequence(seed).generate_state(4))
    random.seed(seed)
    if user_init is not None:
        user_init(worker_id)


class _Pending:
    """Epoch k+1 in preparation: the scheduler's and the builder's futures."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.trigger = threading.Event()
        self.schedule: cf.Future[EpochSchedule] = cf.Future()
        self.loader: DataLoader[Any] | None = None
        self.sampler: ScheduleIndices | None = None
        self.iterator: cf.Future[Any] = cf.Future()


def _run_into(future: cf.Future[Any], fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - surfaced to the consumer through the future
        future.set_exception(exc)


class _TaskThread:
    """A daemon thread that runs the tasks given to it in order.

    One per kind of background work (scheduling, building, releasing), kept for the whole
    epochs() call: starting three threads per epoch cost ~1 ms of the training thread's time,
    visible in short epochs. Daemon, so a scheduler still waiting for its trigger never holds up
    the interpreter's exit.
    """

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[cf.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=f"epochcache-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> cf.Future[Any]:
        future: cf.Future[Any] = cf.Future()
        self._tasks.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            _run_into(*task)
            # Hold nothing while idle: a task's references (the epochs() state, its process
            # groups) must be dropped by the thread that owns them, not by this one at exit.
            del task

    def close(self, timeout: float | None = None) -> None:
        """Stop after the tasks already given; wait up to ``timeout`` for them."""
        self._tasks.put(None)
        self._thread.join(timeout)


class _Epochs:
    """The state behind one epochs() call (see [`epochs`][epochcache.data.epochs.epochs] for the arguments)."""

    def __init__(self, cache: SampleStore, epoch: EpochOptions, loader: LoaderOptions,
                 reader: SampleReader, place: Placement,
                 resume: list[NodeStates] | None = None) -> None:
        self.cache, self.reader, self.place = cache, reader, place
        self.epoch_options, self.loader_options = epoch, loader
        self.loader_kwargs = dict(loader.dataloader)  # each DataLoader's; completed here
        self.num_workers, self.persistent = _worker_settings(
            loader, reader.options.transform, self.loader_kwargs, place.local_world_size)
        self.resume = resume  # the states by node, consumed by the first epoch's schedule
        # CUDA's current device is per thread, and loaders are built on a task thread, whose
        # device is GPU 0: DataLoader's pin-memory thread takes the builder's, so every rank
        # would pin (and hold a CUDA context) on GPU 0. Built under the trainer's device.
        self.device_index = (torch.cuda.current_device() if self.loader_kwargs.get("pin_memory")
                             and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                             else None)
        # Batches read in this process go straight into page-locked memory (one copy).
        self.pinned = bool(self.loader_kwargs.get("pin_memory")) and torch.cuda.is_available()
        self.sync = (NodeSync(self.place, cache_identity(cache.path), cache.path)
                     if dist_initialized() and self.place.distributed else None)
        self.preparer = Preparer(cache, place, self.sync, epoch)
        # In process and without DDP collectives, the next epoch is scheduled in the training
        # thread when triggered (~0.3 ms, once per epoch): on a background thread the same work
        # cost the training thread ~5x that in GIL hand-offs.
        self.inline = self.num_workers == 0 and self.sync is None
        self.forks = self.num_workers > 0 and start_method(
            self.loader_kwargs.get("multiprocessing_context")) == "fork"
        self.slots: list[tuple[DataLoader[Any], ScheduleIndices]] = []
        self.prepared = 0
        self.last_schedule_s = 0.05
        self.abort = threading.Event()
        self.next: _Pending | None = None
        self.unreleased: EpochDataset | None = None  # the last epoch's, until started()
        self.want_next = False
        self.threads: dict[str, _TaskThread] = {}

    # -- background work --------------------------------------------------------------------

    def _make_loader(self, epoch: int) -> tuple[DataLoader[Any], ScheduleIndices]:
        slot = self.prepared % 2
        self.prepared += 1
        if self.persistent and slot < len(self.slots):
            return self.slots[slot]  # alternate two loaders: one finishes while one prefetches
        sampler = ScheduleIndices()
        generator = torch.Generator().manual_seed(
            loader_seed(self.epoch_options.seed, epoch, self.place.rank))
        kwargs = dict(self.loader_kwargs)
        if self.num_workers > 0:
            kwargs["worker_init_fn"] = functools.partial(
                _seed_worker, self.loader_options.worker_init_fn, self.reader.options.stall_file)
            # Persistent for torch in every case: its workers are started by a warm-up
            # iteration (see _start_workers) and the epoch is a second iteration, which only
            # resets them. Without persistent_workers the loader is shut down after its epoch.
            kwargs["persistent_workers"] = True
        # Each loader's reads count into a block of its own (see epochcache.data.workers).
        # In process nothing else adds to it: a private table (sharing one cost ~0.5 ms an epoch).
        reader = self.reader.counting(Tallies(self.num_workers, shared=self.num_workers > 0))
        collate_fn = self.loader_options.collate_fn
        loader = DataLoader(
            SeqBatches(reader, collated=collate_fn is None, pinned=self.pinned),
            batch_size=None, sampler=sampler, num_workers=self.num_workers,
            collate_fn=collate_fn or identity, generator=generator, **kwargs,
        )
        if self.persistent:
            self.slots.append((loader, sampler))
        return loader, sampler

    def _schedule(self, pending: _Pending) -> EpochSchedule:
        while not pending.trigger.wait(0.5):
            if self.abort.is_set():
                raise _Cancelled
        if self.abort.is_set():
            raise _Cancelled
        started = time.monotonic()
        epoch, snapshot = pending.epoch, None
        preparer = self.preparer
        groups, self.resume = self.resume, None
        if groups is not None and groups[0].epoch != epoch:
            groups = None
        group: NodeStates | None = None

        def take() -> tuple[np.ndarray, str]:
            nonlocal snapshot, group
            if groups is not None:
                snapshot, group = adopt_node(self.cache, groups, epoch, self.place)
                if snapshot is not None:
                    return snapshot.seqs, snapshot.lease_id
            seqs, lease_id, snapshot = preparer.snapshot(epoch, f"epochs() epoch {epoch}")
            return seqs, lease_id

        if self.sync is not None and not self.sync.rendezvous(epoch, self.abort.is_set):
            raise _Cancelled
        seqs, lease_id = preparer.share(take)
        if groups is not None:  # (non-leaders learn here which node's states the leader found)
            group = next((g for g in groups if g.lease and g.lease == lease_id), None)
        dataset = EpochDataset(self.reader, seqs, epoch, snapshot, lease_id)
        dataset.finished = False  # until the loop has read the epoch to its end
        try:
            order = preparer.order(seqs, epoch)
            resumed = (resume_rank(self.cache, order, group, self.place)
                       if group is not None else None)
            order = preparer.split(order) if resumed is None else resumed.rest
            # Every rank's count, whether it continues the epoch, the node it found: the
            # batch count is agreed from them (one collective per epoch, resumed or not).
            found = (group.lease if group is not None
                     else ended_lease(self.cache, groups) if groups is not None else "")
            row = [len(order), int(resumed is not None), lease_tag(found),
                   resumed.evicted if resumed is not None else 0]
            rows = (self.sync.gather_counts(row) if self.sync is not None
                    else np.array([row], dtype=np.int64))
            agreed = deal(rows[:, COUNT].tolist(), (rows[:, RESUMED] == 1).tolist(),
                          self.loader_options.batch_size, self.loader_options.drop_last)
            n_batches, taken = agreed.batches, agreed.take(len(order))
            if n_batches == 0 and groups is None:
                log.warning("epoch %d has no batches: the snapshot holds %d samples (batch_size "
                            "%d); is the cache empty?", epoch, len(seqs),
                            self.loader_options.batch_size)
            if resumed is None:
                lane = order[:taken]  # what this rank reads: a resume's lane
                # the loop releases its lane batch by batch
                releaser = preparer.release_part(lease_id, [lane])
            else:
                lane = resumed.lane.lane
                # The rest dealt anew is read by other lanes than the release plan's: the
                # lease was adopted whole, and protects it all until the epoch ends.
                releaser = (None if resumed.lane.resumed is not None
                            else preparer.release_part(lease_id, [lane]))
        except BaseException:
            dataset.close()
            raise
        seconds = time.monotonic() - started
        self.last_schedule_s = seconds
        schedule = EpochSchedule(epoch, dataset, order, self.loader_options.batch_size,
                                 n_batches, seconds, releaser)
        schedule.lane_length = len(lane)
        if groups is not None:
            schedule.bounds = agreed.bounds(len(order))
            schedule.resume_report = report(groups, rows, agreed)
            if self.place.rank == 0:
                log_resume(epoch, schedule.resume_report, groups, self.place)
        if resumed is not None:
            schedule.offsets, schedule.resumed_from = resumed.offsets, resumed.lane.position
            schedule.resumed_split = resumed.lane.resumed
            if taken < len(order):  # left out: a later resume must not read them either
                schedule.lane_length = (int(resumed.offsets[taken - 1]) + 1 if taken
                                    else resumed.lane.position)
        opts = self.epoch_options
        schedule.identity = order_identity(seed=opts.seed, shuffle=opts.shuffle,
                                           samples_per_epoch=opts.samples_per_epoch,
                                           place=self.place)
        return schedule

    def _build(self, pending: _Pending) -> Any:
        if pending.loader is None:
            pending.loader, pending.sampler = self._make_loader(pending.epoch)
        loader, sampler = pending.loader, pending.sampler
        assert sampler is not None
        sampler.schedule = pending.schedule
        if self.num_workers == 0 and not loader.pin_memory:
            return in_process_batches(loader, sampler)
        with self._device():
            # With workers: they run already (_start_workers), this resets them for the epoch
            # (no fork) and primes their queues, which waits for the schedule.
            return iter(loader)

    def _device(self) -> Any:
        """The trainer's CUDA device, for what a loader starts (its pin-memory thread)."""
        if self.device_index is None:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device_index)

    def _start_workers(self, pending: _Pending) -> None:
        """Start the workers of ``pending``'s loader (see `epochcache.data.workers`).

        Forked workers are started here, on the thread that iterates epochs(), inside our own
        code: a fork from a background thread while the training loop runs user code copied
        whatever lock that code held into the worker (a held ``torch.manual_seed`` lock hung
        the next epoch's first batch). Workers of other start methods inherit nothing and are
        started on the builder thread (spawn takes ~1 s per worker).
        """
        loader, sampler = pending.loader, pending.sampler
        assert loader is not None and sampler is not None
        if self.forks:
            start_workers(loader, sampler.warm_up, self._device)
        else:
            self._thread("build").submit(
                functools.partial(start_workers, loader, sampler.warm_up, self._device))

    def prepare(self, epoch: int) -> _Pending:
        """Begin preparing ``epoch``; called by the thread that iterates epochs()."""
        pending = _Pending(epoch)
        if self.num_workers > 0:
            pending.loader, pending.sampler = self._make_loader(epoch)
            self._start_workers(pending)
        if not self.inline:
            pending.schedule = self._thread("schedule").submit(
                functools.partial(self._schedule, pending))
            pending.iterator = self._thread("build").submit(
                functools.partial(self._build, pending))
        return pending  # inline: scheduled and built when triggered (see _trigger)

    def _lead_s(self) -> float:
        """How long before the end of an epoch to trigger the next one's schedule."""
        # Inline scheduling is done when it returns: the snapshot can wait for the last batches.
        return 0.0 if self.inline else max(0.3, 3 * self.last_schedule_s)

    def _trigger(self, pending: _Pending) -> None:
        """Schedule ``pending`` now: wake its scheduler, or, inline, schedule and build it
        right here."""
        pending.trigger.set()
        if self.inline and not pending.schedule.done():
            _run_into(pending.schedule, functools.partial(self._schedule, pending))
            _run_into(pending.iterator, functools.partial(self._build, pending))

    def _thread(self, name: str) -> _TaskThread:
        thread = self.threads.get(name)
        if thread is None:
            thread = self.threads[name] = _TaskThread(name)
        return thread

    def release_later(self, dataset: EpochDataset) -> None:
        """Release an epoch's lease (a write transaction + fsync): off the training thread,
        or, inline (see ``inline``), right here, where it costs less than a thread's GIL
        hand-offs."""
        if self.inline:
            dataset.close()
        else:
            self._thread("release").submit(dataset.close)

    def cancel(self, pending: _Pending) -> None:
        """Stop preparing ``pending`` and release what it took."""
        self.abort.set()
        pending.trigger.set()
        if self.inline and not pending.schedule.done():
            return  # never scheduled: nothing was taken
        try:
            pending.schedule.result(timeout=60).dataset.close()
        except BaseException:  # noqa: BLE001 - cancelled or failed: nothing taken, or released
            pass
        try:
            pending.iterator.result(timeout=60)
        except BaseException:  # noqa: BLE001 - the same: its failure was the consumer's to see
            pass
        # Shut down here, not by the garbage collector (see ScheduleIndices.__iter__): the
        # workers may have been started without the epoch's iteration.
        iterator = getattr(pending.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()

    # -- the generator ----------------------------------------------------------------------

    def _watch_start(self, dog: Any, pending: _Pending) -> Any:
        """Watch the wait for an epoch's workers to be ready (a worker stuck in its start-up
        never is): a stall there is reported with the workers' stacks and ends the epoch."""
        if dog is None or pending.loader is None:
            return contextlib.nullcontext()
        loader = pending.loader

        def check() -> WorkerCheck:
            # Read when the stall is reported: spawned workers are started on the builder
            # thread, whose iterator may not exist yet when the wait begins.
            found = WorkerCheck(lines=[f"epoch {pending.epoch}: its DataLoader workers are "
                                       "not ready (their start-up, or the first batches they "
                                       "prime)"])
            check_workers(getattr(loader, "_iterator", None), found)
            return found

        @contextlib.contextmanager
        def watch() -> Iterator[None]:
            with dog.watch(f"epoch {pending.epoch} (starting its DataLoader workers)",
                           self.reader.stall_action) as activity:
                activity.check = check
                activity.on_raise = lambda _error: stop_workers(getattr(loader, "_iterator",
                                                                        None))
                activity.cache_path = self.cache.path
                yield

        return watch()

    def _request_next(self) -> None:
        self.want_next = True
        if self.next is not None:
            self._trigger(self.next)

    def run(self, start: int, num_epochs: int) -> Iterator[tuple[int, EpochLoader]]:
        stall_file = self.reader.options.stall_file
        dog = (get_watchdog(self.reader.options.stall_s, stall_file) if self.num_workers > 0
               else None)
        if dog is not None:
            arm_stack_dump(stall_file)  # before the workers fork: they inherit it
        depth = self.num_workers * int(self.loader_kwargs.get("prefetch_factor") or 2)
        end = start + num_epochs
        self.next = self.prepare(start) if num_epochs > 0 else None
        previous: EpochDataset | None = None
        closing = False
        try:
            for epoch in range(start, end):
                current, self.next, self.want_next = self.next, None, False
                if current is None:
                    raise RuntimeError("epochcache: internal error, epoch not prepared")
                self._trigger(current)
                try:
                    schedule = current.schedule.result()
                    with self._watch_start(dog, current):
                        iterator = current.iterator.result()
                except (StallError, KeyboardInterrupt):
                    # A Ctrl-C in the wait (or raised in the preparation, inline) is the
                    # user's, not a failure of the preparation.
                    self.cancel(current)
                    raise
                except BaseException as exc:
                    self.cancel(current)
                    raise PrepareFailed(f"epoch {epoch}: preparing its snapshot and DataLoader "
                                        f"failed: {type(exc).__name__}: {exc}") from exc

                # The previous epoch's lease goes once this epoch's first batches are out;
                # until then the finally below owns it (an interrupt before that must not
                # leave it held).
                self.unreleased = previous

                def started(epoch: int = epoch) -> None:
                    # Deferred until this epoch's first batches are out: starting threads and
                    # building a DataLoader holds the GIL, which would show at the boundary.
                    done, self.unreleased = self.unreleased, None
                    if done is not None:
                        self.release_later(done)
                    if epoch + 1 < end:
                        self.next = self.prepare(epoch + 1)
                        if self.want_next:
                            self._trigger(self.next)

                previous = None
                loader = EpochLoader(
                    epoch, schedule, current.loader, iterator,  # type: ignore[arg-type]
                    self._request_next, started, self._lead_s(), depth, dog,
                    self.reader.stall_action, tallies_of(current.loader))
                loader.resume_grace_s = self.epoch_options.resume_grace_s
                if epoch == start and self.persistent:
                    # The second loader's workers start now, alongside the first's, so even a
                    # first epoch shorter than a worker start-up ends without a wait.
                    loader._start_next()
                try:
                    yield epoch, loader
                except BaseException:
                    # Closed by an error in the training loop (or close()): the other ranks
                    # may be waiting in a collective this rank will never join, so nothing
                    # here may wait for them -- no barrier, no next epoch; the lease is
                    # released locally and the scheduler, if it waits for the others, gives up.
                    closing = True
                    self.abort.set()
                    raise
                finally:
                    if not closing:
                        loader.finish()
                    if not self.persistent and hasattr(iterator, "_shutdown_workers"):
                        iterator._shutdown_workers()
                    if self.sync is not None and not closing:
                        self.sync.epoch_end()
                    previous = schedule.dataset
        finally:
            for done in (previous, self.unreleased):
                if done is not None:
                    done.close()
            self.unreleased = None
            if self.next is not None:
                self.cancel(self.next)
            for loader_, _sampler in self.slots:
                it = getattr(loader_, "_iterator", None)
                if it is not None and hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
            if self.num_workers > 0:
                forget_exited()  # this process's mappings of the workers' batch rings
            for thread in self.threads.values():
                # Leases are released before epochs() returns, and no task thread outlives
                # this generator holding references to its state (see _TaskThread._run).
                thread.close(timeout=60)
            if self.sync is not None:
                self.sync.close()


def epochs(
    cache: SampleStore | Any,
    num_epochs: int,
    *,
    batch_size: int = LoaderOptions.batch_size,
    num_workers: int | None = LoaderOptions.num_workers,
    seed: int = EpochOptions.seed,
    shuffle: bool = EpochOptions.shuffle,
    drop_last: bool = LoaderOptions.drop_last,
    samples_per_epoch: int | None = EpochOptions.samples_per_epoch,
    min_samples: int = LoaderOptions.min_samples,
    wait_timeout_s: float | None = LoaderOptions.wait_timeout_s,
    start_epoch: int = 0,
    release: str = EpochOptions.release,
    resume: dict[str, Any] | list[Any] | None = None,
    resume_grace_s: float = EpochOptions.resume_grace_s,
    collate_fn: Callable[[Any], Any] | None = LoaderOptions.collate_fn,
    persistent_workers: bool | None = LoaderOptions.persistent_workers,
    worker_init_fn: Callable[[int], None] | None = LoaderOptions.worker_init_fn,
    options: ReaderOptions | None = None,
    **kwargs: Any,
) -> Iterator[tuple[int, EpochLoader]]:
    """Yield ``(epoch, loader)`` for ``num_epochs`` epochs, each over a fresh snapshot.

    Each epoch's batches come from a snapshot taken near the end of the previous epoch; the
    next loader and its workers are prepared in the background. Every sample of the snapshot
    is delivered once per epoch (per node under DDP, split across its ranks), unless
    ``samples_per_epoch`` fixes the count (resampling when the cache is still small).

    Args:
        cache: the cache to train from.
        num_epochs: how many epochs to yield.
        samples_per_epoch: samples per epoch per node; None means the whole snapshot.
        min_samples: wait (with a progress bar) until the cache holds this many samples;
            a wait without new samples warns on stderr (within seconds when no daemon fills
            the cache).
        seed: seeds the per-epoch shuffle (same seed and snapshot, same order) and the
            workers' torch, numpy and ``random`` state, from (seed, epoch, global rank, worker
            id): reproducible, and different on every rank. Without workers a transform draws
            from the training process's own random state.
        batch_size: samples per batch.
        num_workers: DataLoader workers. None (the default): 0 without a transform (reading
            in the training process is fastest) and with one the cores this process may use
            divided by the ranks of its node (see `default_num_workers`).
        collate_fn: replaces the built-in batch assembly; it receives a list of samples.
        persistent_workers: keep workers across epochs (two loaders alternate, so the next
            epoch's workers prefetch while this one finishes). None (the default): True with
            workers; False starts fresh workers every epoch.
        start_epoch: the first epoch's number (for resuming).
        wait_timeout_s: give up waiting for ``min_samples`` after this long.
        release: ``"progressive"``: a batch's samples may be evicted once the loop is done
            with it, so a full cache keeps turning over during the epoch
            (docs/guide/turnover.md); ``"epoch"``: the whole snapshot stays until the epoch ends.
        resume: the [`EpochLoader.state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] of an interrupted epoch (from a
            checkpoint), or every rank's (a list, or a dict by rank: what ``epochcache run``
            checkpoints): the first epoch is that one, on the same snapshot in the same order,
            from the sample after the state's position; ``start_epoch`` is ignored. Samples
            evicted since are skipped and counted. One rank's own state resumes on the layout
            that ran the epoch; given every rank's, the job may come back in another shape:
            each node's rest is dealt anew to its ranks (batches may then be smaller than
            ``batch_size``, never empty, the same number on every rank), a new node starts
            the epoch on a fresh snapshot, and the rest of a node that did not come back is
            counted ([`EpochLoader.resume_report`][epochcache.data.epoch_loader.EpochLoader.resume_report]; see `epochcache.data.resume`
            and docs/guide/resume.md).
        resume_grace_s: once a loader's [`state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] was taken, its
            epoch's lease outlives a stop before the epoch's end (SIGTERM, Ctrl-C, a crash,
            the process exiting) by this long (seconds; 30 minutes by default), so that
            ``resume=`` finds its samples; an epoch read to its end releases its lease at
            once. 0 disables.
        options: how samples are read: decoding, fields, images, the transform (applied in
            the workers, if any) and the stall watchdog
            ([`ReaderOptions`][epochcache.ReaderOptions]; by default a batch slower than
            300 s is reported with the stacks of the training process and of its workers,
            then fails the loop with [`StallError`][epochcache.StallError], so that the job
            ends instead of hanging and a restart resumes it).
        **kwargs: reader options by name (``fields=("jpg;png", "cls")``, ``transform=...``,
            ``stall_s=...``: they override ``options``); the rest go to each epoch's
            DataLoader (``pin_memory``, ``prefetch_factor``, ``timeout``,
            ``multiprocessing_context``, ...).

    Raises:
        ValueError: an invalid argument (named in the message).
        TimeoutError: ``min_samples`` were not cached within ``wait_timeout_s``.
        PrepareFailed: the background preparation failed (``__cause__`` is the error).
    """
    # Each default is the option's own (epochcache.options): the keywords become the values.
    given = {name: value for name, value in locals().items()
             if name in EPOCH_NAMES | LOADER_NAMES}
    reader, epoch, loader = resolve_options("cache.epochs()", options, {**given, **kwargs},
                                            loader=True)
    return epochs_of(cache, num_epochs, reader, epoch, loader, start_epoch=start_epoch,
                     resume=resume)


def epochs_of(cache: SampleStore | Any, num_epochs: int, reader: ReaderOptions,
              epoch: EpochOptions, loader: LoaderOptions, *, start_epoch: int = 0,
              resume: dict[str, Any] | list[Any] | None = None,
              ) -> Iterator[tuple[int, EpochLoader]]:
    """[`epochs`][epochcache.data.epochs.epochs] with its options as values (a run's config
    gives them whole: `EpochcacheConfig.epoch_options`, `EpochcacheConfig.loader_options`)."""
    if not isinstance(num_epochs, int) or num_epochs < 0:
        raise ValueError(f"num_epochs: expected an int >= 0, got {num_epochs!r}")
    place = detect_placement()
    groups = None
    if resume is not None:
        groups = check_resume(resume, seed=epoch.seed, shuffle=epoch.shuffle,
                              samples_per_epoch=epoch.samples_per_epoch, place=place)
        start_epoch = groups[0].epoch
    sample_reader = SampleReader(cache.path, reader)
    sample_reader.bind(cache)
    return _generate(_Epochs(cache, epoch, loader, sample_reader, place, groups), start_epoch,
                     num_epochs)


def default_num_workers(transform: Callable[[Any], Any] | None, local_world_size: int) -> int:
    """epochs()' ``num_workers`` when none is given (also ``loader.num_workers: null`` of runs).

    0 without a transform: decoding reads the map in the training process, and shipping batches
    from workers through shared memory only costs (``scripts/bench_loader.py --workers``: 1 or
    2 workers run at a fraction of in-process reading). With a transform, the cores this
    process may use split between the ranks of its node (every rank starts its own workers: a
    core count per rank would oversubscribe the node under DDP), at least 1.
    """
    if transform is None:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world_size))


def _worker_settings(loader: LoaderOptions, transform: Callable[[Any], Any] | None,
                     dataloader_kwargs: dict[str, Any], local_world_size: int = 1,
                     ) -> tuple[int, bool]:
    """``(num_workers, persistent)`` with their defaults; completes ``dataloader_kwargs``."""
    num_workers = loader.num_workers
    if num_workers is None:
        num_workers = default_num_workers(transform, local_world_size)
    timeout = dataloader_kwargs.get("timeout", 0)
    if timeout and num_workers == 0:
        # torch applies it to batches from workers only: in process it asserts timeout == 0
        # where batches are pinned (a GPU), and epochs() ignored it on the CPU.
        raise ValueError(
            f"epochs(timeout={timeout!r}): DataLoader's timeout applies to batches from worker "
            "processes, and num_workers is 0 (the default without a transform); pass "
            "num_workers > 0 with it, or drop timeout (stall_s= reports a slow batch either way)")
    persistent = (num_workers > 0 if loader.persistent_workers is None
                  else bool(loader.persistent_workers))
    persistent = persistent and num_workers > 0
    if num_workers == 0:
        dataloader_kwargs.pop("prefetch_factor", None)
    # Workers start the platform's way unless the caller names a multiprocessing_context (fork
    # on Linux before Python 3.14: no pickling, no re-import of __main__). Loaders are built on
    # a background thread, so every lock of ours a forked worker could meet is renewed in the
    # child, and the child opens its own LMDB environment (see epochcache.store.env).
    return num_workers, persistent


def _generate(state: _Epochs, start: int, num_epochs: int) -> Iterator[tuple[int, EpochLoader]]:
    wait_for_samples(state.cache, state.loader_options.min_samples,
                     state.loader_options.wait_timeout_s)
    yield from state.run(start, num_epochs)
