"""CacheStream: a torch IterableDataset over the cache that takes a fresh snapshot per epoch.

For training code that builds its own DataLoader (PyTorch Lightning, the Hugging Face Trainer,
accelerate, a plain loop): ``DataLoader(cache.stream(...), batch_size=..., num_workers=...)``.
Each ``iter()`` is one epoch over a snapshot taken when it starts, so later epochs see what the
cache gained; the snapshot is split disjointly across DDP ranks and DataLoader workers, and each
sample of the ticket is yielded once, in an order fixed by ``(seed, epoch)``.

Where the epoch is prepared (snapshot, shuffle, and under DDP the collectives):

* in the main process, by [`CacheStream.set_epoch`][epochcache.data.stream.CacheStream.set_epoch] (the HF Trainer and accelerate call it
  before every epoch; so can a Lightning hook), or by ``iter()`` itself without workers. Workers
  started afterwards receive the prepared ticket with the dataset (pickled or forked) and claim
  it (see `epochcache.data.tickets`);
* otherwise inside the workers: the first worker of a loader iteration takes the next epoch's
  snapshot and the others adopt it, agreed through the cache. The main process of a DataLoader
  with workers never runs ``iter()`` on the dataset, so this is how a plain loop or Lightning
  without ``set_epoch`` advances. Under DDP this is refused: the ranks must agree on a sample
  count, which takes a collective in the main process (call ``set_epoch``).
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ..options import EPOCH_NAMES, EpochOptions, ReaderOptions, resolve_options
from ..placement import detect_placement, dist_initialized
from ..store.env import cache_identity
from ..store.owners import begin_lease, end_lease
from ..store.plumbing import adopt_lease, snapshot_seqs
from ..store.reads import Releaser
from .dataset import snapshot_gone
from .distributed import NodeSync
from .reader import SampleReader
from .resume import lease_gone_reason
from .schedule import Preparer, rank_order, write_release_part
from .stall import arm_stack_dump
from .states import STREAM_KIND as KIND
from .states import STREAM_ORDER_KEYS as ORDER_KEYS
from .states import merge, resume_split, worker_states
from .tickets import (
    Reporting,
    Ticket,
    WorkerEnd,
    claim_ticket,
    drop_tickets,
    last_epoch,
    publish_ticket,
    unwatch,
)
from .workers import Tallies

if TYPE_CHECKING:
    from ..store import SampleStore, Snapshot

log = logging.getLogger(__name__)

#: Samples read per LMDB read transaction.
_CHUNK = 32
#: The DataLoader workers a stream's tallies have rows for (8 bytes per tally each).
_TALLY_WORKERS = 64


@dataclass(frozen=True)
class _Prepared:
    """An epoch the main process prepared: the ticket and this rank's part of it."""

    ticket: Ticket
    slot: int  # this rank's slot among ``slots`` (the node's ranks, or 1 slot)
    slots: int
    samples: int  # this rank's sample count (the MIN over ranks under DDP)
    distributed: bool
    part: int  # this rank's part of the epoch's release plan


@dataclass(frozen=True)
class _Reading:
    """Where this reader (the main process's loop, or one DataLoader worker) is reading: what
    its state names (`ORDER_KEYS`: the epoch, the snapshot, the seed, the
    rank's slot), how the epoch is split among the readers, and which reader this is. With
    ``CacheStream._pos`` (the samples of its lane yielded), a ``state_dict()``."""

    spec: dict[str, Any]
    split: dict[str, Any]
    worker: int


class _Home:
    """The process that holds a stream's leases and runs its collectives: where it was made,
    or where a copy was unpickled outside a DataLoader worker (a spawned DDP rank, a deep
    copy), which becomes a stream of its own. It holds the stream's id (its document in the
    cache, `epochcache.data.tickets`, and its leases' labels: a new one per home, so copies in
    several DDP ranks never share one), this process's owner lock (the leases its workers
    take name it), the prepared epoch's snapshot and order, the node's collectives, and the
    finalizer that drops the document, a worker-taken lease and the lock when the stream is
    closed or collected.

    A copy in a worker keeps the id, the home's pid and owner (what its claims of the epoch
    name) and nothing else: the snapshot, order, collectives and finalizer stay home.
    """

    def __init__(self, stream: CacheStream) -> None:
        self.stream_id = uuid.uuid4().hex[:12]
        self.pid = os.getpid()
        self.snapshot: Snapshot | None = None
        self.order: np.ndarray | None = None  # the prepared epoch's order on this rank
        self.sync: NodeSync | None = None
        self.owner = ""
        self.finalizer: weakref.finalize[Any, Any] | None = None
        self.new_finalizer(stream)

    @property
    def doc_name(self) -> str:
        return f"stream/{self.stream_id}"

    def here(self) -> bool:
        """Whether this process is the home (a copy's home is elsewhere)."""
        return self.finalizer is not None and self.pid == os.getpid()

    def new_finalizer(self, stream: CacheStream) -> None:
        """Hold the owner lock and the finalizer (again, after a close)."""
        cache = stream.reader.cache
        # This process's owner lock, for the stream's lifetime: the leases its workers take
        # name it, so they live while this process does and are reclaimed when it dies
        # (workers have owner locks of their own). The finalizer ends it.
        self.owner = begin_lease(cache.path)
        self.finalizer = weakref.finalize(stream, _drop_quietly, cache, self.doc_name, self.pid)

    def __getstate__(self) -> dict[str, Any]:
        return {"stream_id": self.stream_id, "pid": self.pid, "owner": self.owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.snapshot, self.order, self.sync, self.finalizer = None, None, None, None


class CacheStream(IterableDataset[Any]):
    """A torch ``IterableDataset`` over the cache: a fresh snapshot on every ``iter()``.

    Made by [`epochcache.Cache.stream`][epochcache.Cache.stream]. Use it as the dataset of your own DataLoader.

    Args:
        cache: the cache to read.
        seed: seeds the per-epoch order (same seed, epoch and snapshot: same order).
        shuffle: shuffle each epoch (else the snapshot's insertion order).
        samples_per_epoch: samples per epoch per node; None means the whole snapshot (a
            larger number resamples a small cache, as in ``epochs()``).
        split_ranks: split each epoch across the ranks of a DDP node. Pass False when the
            framework splits the data itself (accelerate's ``prepare``, the HF Trainer): every
            rank then yields the node's whole epoch, in the same order.
        options: how samples are read ([`ReaderOptions`][epochcache.ReaderOptions]: decoding,
            fields, images, transform, the stall watchdog); ``**reader`` (its attribute
            names, e.g. ``fields=("jpg;png", "cls")``) overrides it. A sample read slower than
            ``stall_s`` is reported with the stacks of the reading process and then, with
            ``stall_action="raise"`` (the default), raises
            [`StallError`][epochcache.StallError] there: in a worker, DataLoader re-raises it
            in the training loop.
        release: ``"progressive"`` (each worker releases what it has read, so a full cache
            keeps turning over during the epoch) or ``"epoch"`` (the whole snapshot stays
            until the epoch ends); see [`epochcache.data.epochs.epochs`][epochcache.data.epochs.epochs].
        resume_grace_s: once [`state_dict`][epochcache.data.stream.CacheStream.state_dict] was taken in an epoch, its lease outlives
            this process by this long (seconds; 30 minutes by default), for a resumed run (see [`load_state_dict`][epochcache.data.stream.CacheStream.load_state_dict]).

    Raises:
        ValueError: an invalid argument (named in the message).
        TypeError: a keyword that is no reader option.
    """

    def __init__(
        self,
        cache: SampleStore | Any,
        *,
        seed: int = EpochOptions.seed,
        shuffle: bool = EpochOptions.shuffle,
        samples_per_epoch: int | None = EpochOptions.samples_per_epoch,
        split_ranks: bool = True,
        release: str = EpochOptions.release,
        resume_grace_s: float = EpochOptions.resume_grace_s,
        options: ReaderOptions | None = None,
        **reader: Any,
    ) -> None:
        # Each default is the option's own (epochcache.options): the keywords become the values.
        given = {name: value for name, value in locals().items() if name in EPOCH_NAMES}
        opts, epoch, _ = resolve_options("cache.stream()", options, {**given, **reader})
        self.reader = SampleReader(cache.path, opts)
        # Its DataLoader is the user's: a row for each worker it may have (see tallies()).
        self.reader.tallies = Tallies(_TALLY_WORKERS)
        self.reader.bind(cache)
        self.epoch_options, self.progressive = epoch, epoch.progressive
        self.seed, self.shuffle = seed, bool(shuffle)
        self.samples_per_epoch, self.split_ranks = samples_per_epoch, bool(split_ranks)
        self._next_epoch = 0
        self._epoch_given = False  # set_epoch() named the next epoch
        self._prepared: _Prepared | None = None  # the main process's latest epoch
        self._consumed = False  # ... already iterated in the main process
        self._active = 0  # iterations running in the main process
        self._worker_iters = 0  # iterations of this copy inside one (persistent) worker
        self.resume_grace_s = resume_grace_s
        self._resume: dict[str, Any] | None = None  # a loaded state, for the next iteration
        # Counts load_state_dict() calls: with the lease, it names one resume, alike in every
        # worker that received the state (see claim_ticket).
        self._loads = 0
        self._at: _Reading | None = None  # this reader's epoch, split and lane
        self._pos = 0  # samples of the lane yielded so far
        self._kept = ""  # the lease last kept for a resume
        self._home = _Home(self)  # this process is the stream's home

    # -- the main process ("home") ----------------------------------------------------------

    @property
    def stream_id(self) -> str:
        """Names the stream's document in the cache and its leases (a new one per home)."""
        return self._home.stream_id

    def _adopt_home(self) -> None:
        # A copy unpickled outside a worker (a spawned DDP rank, a deep copy) becomes a stream
        # of its own: its own id, document and leases.
        if not self._home.here():
            self._home = _Home(self)
            self._prepared, self._consumed = None, False

    def tallies(self) -> dict[str, int]:
        """What this stream's reads have counted since it was made (the figures marked
        ``tally=True`` in `epochcache.epoch_record`, e.g. ``skipped``), in this process and
        in the DataLoader workers reading it (up to 64 of them): the difference between two
        calls at the ends of epochs is an epoch's."""
        return self.reader.tallies.totals()

    @property
    def epoch(self) -> int | None:
        """The epoch last prepared in this process (None before the first)."""
        return None if self._prepared is None else self._prepared.ticket.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the next one, and prepare it now: snapshot, order and, under DDP,
        the agreement of the ranks (every rank must call it, as DDP frameworks do).

        Called again with the epoch already prepared (or being iterated), it does nothing.
        """
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"set_epoch: expected an int >= 0, got {epoch!r}")
        if get_worker_info() is not None:  # a framework calling it inside a worker
            self._next_epoch, self._epoch_given = epoch, True
            return
        self._adopt_home()
        prepared = self._prepared
        if (prepared is not None and prepared.ticket.epoch == epoch
                and (not self._consumed or self._active)):
            return
        self._next_epoch, self._epoch_given = epoch, True
        self._prepare(epoch)

    def _prepare(self, epoch: int) -> _Prepared:
        """Take the epoch's snapshot (the node's leader under DDP) and this rank's part."""
        cache = self.reader.cache
        finalizer = self._home.finalizer
        if finalizer is None or not finalizer.alive:  # closed before: dropped again at GC
            self._home.new_finalizer(self)
        place = detect_placement()
        distributed = place.distributed and dist_initialized()
        if distributed and self._home.sync is None:
            # collective: every rank prepares in step (and checks the node layout)
            self._home.sync = NodeSync(place, cache_identity(cache.path), cache.path)
        preparer = Preparer(cache, place, self._home.sync, self.epoch_options,
                          split_ranks=self.split_ranks)
        taken: list[Snapshot] = []

        def take() -> tuple[np.ndarray, str]:
            # The release plan's lanes are written by whoever reads them (the loop or each
            # DataLoader worker: write_release_part).
            seqs, lease_id, snapshot = preparer.snapshot(epoch,
                                                        f"stream {self.stream_id} epoch {epoch}")
            taken.append(snapshot)
            unwatch(cache, lease_id)  # the ticket manages it; our owner lock keeps it
            return seqs, lease_id

        if not distributed:
            self._release_snapshot()  # no other rank can still be reading it
        seqs, lease_id = preparer.share(take)
        # Under DDP every rank is past the previous epoch once the snapshot was shared.
        self._release_snapshot()
        self._home.snapshot = taken[0] if taken else None
        try:
            order = preparer.rank_order(seqs, epoch)
            slot, slots = preparer.slot
            samples = len(order)
            if self._home.sync is not None:
                samples = self._home.sync.agree_batches(samples)  # MIN over all ranks
            lo = int(seqs[0]) if len(seqs) else 0
            hi = int(seqs[-1]) + 1 if len(seqs) else 0
            ticket = Ticket(epoch, lo, hi, len(seqs), lease_id or None, uuid.uuid4().hex)
            publish_ticket(cache, self._home.doc_name, ticket, release=not distributed)
        except BaseException:
            self._release_snapshot()
            raise
        if len(seqs) == 0:
            log.warning("stream epoch %d: the cache at %s holds no samples", epoch, cache.path)
        self._prepared = _Prepared(ticket, slot, slots, samples, distributed,
                                   place.local_rank if distributed else 0)
        self._home.order, self._consumed = order[:samples], False
        self._next_epoch, self._epoch_given = epoch + 1, False
        return self._prepared

    def _release_snapshot(self, *, finished: bool = True) -> None:
        snapshot, self._home.snapshot = self._home.snapshot, None
        if snapshot is not None:
            snapshot.release(finished=finished)

    def close(self) -> None:
        """Release the leases this stream holds and leave DDP's groups. Idempotent.

        The lease of an epoch not read to its end whose state was taken
        ([`state_dict`][epochcache.data.stream.CacheStream.state_dict]) is left for ``resume_grace_s``, for [`load_state_dict`][epochcache.data.stream.CacheStream.load_state_dict].
        """
        if not self._home.here():
            return  # a copy in a worker, or never used outside one: holds nothing
        self._release_snapshot(finished=False)
        assert self._home.finalizer is not None  # (here() says so)
        self._home.finalizer()
        if self._home.sync is not None:
            self._home.sync.close()
            self._home.sync = None

    def __enter__(self) -> CacheStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state (StatefulDataLoader, Lightning, resumed runs) --------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is in its epoch (a few numbers, see
        `states`): a StatefulDataLoader takes it in each worker
        with every batch. The first one taken in an epoch keeps the epoch's lease for
        ``resume_grace_s`` after this process dies, so a resumed run finds its samples."""
        at = self._at
        if at is None:
            return {"kind": KIND, "version": 1, "next_epoch": self._next_epoch}
        lease = at.spec["lease"]
        if lease and self._kept != lease:
            self._kept = lease
            try:
                self.reader.cache.keep_for_resume(lease, self.resume_grace_s)
            except Exception as exc:  # noqa: BLE001 - a state must not fail a training step
                log.warning("stream: could not keep the lease of epoch %d for a resume: %s",
                            at.spec["epoch"], exc)
        return {"kind": KIND, "version": 1, **at.spec, **at.split,
                "positions": {str(at.worker): self._pos},
                "next_epoch": int(at.spec["epoch"]) + 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: this stream's [`state_dict`][epochcache.data.stream.CacheStream.state_dict] (what a StatefulDataLoader
        gives back to each worker) or a whole StatefulDataLoader ``state_dict()`` (its
        workers' states merged, to resume with any ``num_workers``: the rest of every
        worker's lane is dealt anew). The next loader iteration yields the rest of that epoch,
        on the same snapshot (samples evicted since are skipped and counted), whatever its
        number of workers; the one after it, the next epoch, whole (one iteration resumes a
        loaded state, however many loaders receive a copy of the stream).

        Under torch.distributed the state of an interrupted epoch is refused (each rank's
        state holds only its own readers): the message says how to go on.

        Raises:
            ValueError: not such a state, or one that cannot be resumed as asked (named).
        """
        merged = merge(worker_states(state))
        if "epoch" in merged and detect_placement().distributed:
            _refuse_distributed(int(merged["epoch"]))
        self._next_epoch = int(merged["next_epoch"]) if "epoch" not in merged else (
            int(merged["epoch"]) + 1)
        self._epoch_given = False
        self._resume = merged if "epoch" in merged else None
        self._loads += 1

    def _resumed_order(self, state: dict[str, Any]) -> np.ndarray:
        """The order of the epoch ``state`` was taken in, rebuilt from its snapshot."""
        seqs = snapshot_seqs(self.reader.cache, state.get("lease"), int(state["lo"]),
                                               int(state["hi"]), int(state["count"]))
        return rank_order(seqs, int(state["epoch"]), int(state["seed"]),
                           bool(state["shuffle"]), state["samples_per_epoch"],
                           int(state["slot"]), int(state["slots"]), int(state["samples"]))

    def _check_resumable(self, state: dict[str, Any]) -> Ticket:
        mine = {"seed": self.seed, "shuffle": self.shuffle,
                "samples_per_epoch": self.samples_per_epoch}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"load_state_dict: the interrupted epoch ran with {key}={state.get(key)!r}, "
                    f"this stream has {key}={value!r}: its order cannot be continued")
        if detect_placement().distributed:
            _refuse_distributed(int(state["epoch"]))
        return Ticket(int(state["epoch"]), int(state["lo"]), int(state["hi"]),
                     int(state["count"]), state.get("lease") or None,
                     f"resumed:{state.get('lease') or ''}:{state['epoch']}:{self._loads}")

    def _spec(self, ticket: Ticket, slot: int, slots: int, samples: int) -> dict[str, Any]:
        return {"epoch": ticket.epoch, "lease": ticket.lease or "", "lo": ticket.lo,
                "hi": ticket.hi, "count": ticket.count, "seed": self.seed,
                "shuffle": self.shuffle, "samples_per_epoch": self.samples_per_epoch,
                "slot": slot, "slots": slots, "samples": samples}

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:
            return self._iter_main()
        return self._iter_worker(info.id, info.num_workers, info.seed - info.id)

    def _iter_main(self) -> Iterator[Any]:
        self._adopt_home()
        if self._resume is not None:
            state, self._resume = self._resume, None
            ticket = self._check_resumable(state)
            cache = self.reader.cache
            if ticket.lease and adopt_lease(cache, ticket.lease, whole=True) is None:
                log.warning("stream: epoch %d cannot continue where the state left it: its "
                            "lease %s is gone (%s); the next epoch starts instead",
                            ticket.epoch, ticket.lease[:8], lease_gone_reason(cache, ticket.lease))
            else:
                finished = False
                try:
                    yield from self._resumed_lane(state, ticket, 1, 0)
                    finished = True
                finally:
                    if ticket.lease:
                        cache.release_lease(ticket.lease, finished=finished)
                return
        prepared = self._prepared
        if prepared is None or self._consumed or self._epoch_given:
            epoch = self._next_epoch
            if not self._epoch_given:  # workers may have advanced past our count
                recorded = last_epoch(self.reader.cache, self._home.doc_name)
                if recorded is not None and recorded >= epoch:
                    epoch = recorded + 1
            prepared = self._prepare(epoch)
        self._consumed = True
        order = self._home.order if self._home.order is not None else np.empty(0, dtype=np.uint64)
        releaser = (write_release_part(self.reader.cache, prepared.ticket.lease or "",
                                       prepared.part, [order])
                    if self.progressive else None)
        self._at = _Reading(self._spec(prepared.ticket, prepared.slot, prepared.slots,
                                       prepared.samples), {"workers": 1}, 0)
        self._active += 1
        finished = False
        try:
            yield from self._samples(order, prepared.distributed, prepared.ticket, releaser)
            finished = True
        finally:
            self._active -= 1
            if not prepared.distributed and self._prepared is prepared:
                self._release_snapshot(finished=finished)

    def _iter_worker(self, worker: int, workers: int, base_seed: int) -> Iterator[Any]:
        """Claim the epoch now, as the worker starts (DataLoader calls iter() on the dataset
        then, even in a worker that is shut down before it reads anything), so that every
        worker of the group counts towards the release of the lease."""
        if self.reader.stall_s is not None:
            arm_stack_dump(self.reader.stall_file)
        cache = self.reader.cache
        group = f"{base_seed}:{self._worker_iters}"
        self._worker_iters += 1
        if self._resume is not None:
            state, self._resume = self._resume, None
            resumed = self._resume_worker(state, worker, workers, group)
            if resumed is not None:
                return resumed
            # (A copy of a stream whose state an earlier loader already resumed.)
        prepared = self._prepared if not self._consumed else None
        distributed = (prepared.distributed if prepared is not None
                       else detect_placement().distributed)
        name = self._home.doc_name
        ticket = claim_ticket(cache, name, group, worker, progressive=self.progressive,
                            prepared=prepared.ticket if prepared is not None else None,
                            first_epoch=self._next_epoch, home_pid=self._home.pid,
                            home_owner=self._home.owner,
                            label=f"stream {self.stream_id}", take=not distributed,
                            workers=workers)
        if ticket is None:
            raise RuntimeError(
                "cache.stream(): under torch.distributed the ranks must agree on each epoch in "
                "the main process: call dataset.set_epoch(epoch) on every rank before each "
                "epoch's iteration (the HF Trainer and accelerate do; in Lightning call it in "
                "train_dataloader() with reload_dataloaders_every_n_epochs=1), or use "
                "num_workers=0")
        done = WorkerEnd(cache, name, group, workers)
        try:
            if prepared is not None and ticket.token == prepared.ticket.token:
                slot, slots, samples = prepared.slot, prepared.slots, prepared.samples
                part = prepared.part
            else:
                slot, slots, samples, part = 0, 1, -1, 0
            seqs = snapshot_seqs(cache, ticket.lease, ticket.lo, ticket.hi, ticket.count)
            order = rank_order(seqs, ticket.epoch, self.seed, self.shuffle,
                                self.samples_per_epoch, slot, slots, samples)
            lanes = [order[w::workers] for w in range(workers)]
            releaser = (write_release_part(cache, ticket.lease or "", part, lanes, worker)
                        if self.progressive else None)
        except BaseException:
            done(False)
            raise
        self._at = _Reading(self._spec(ticket, slot, slots, samples), {"workers": workers},
                            worker)
        if ticket.restarted:
            log.info("stream epoch %d: a new loader iteration reads it from its start (the "
                     "previous one stopped before its end)", ticket.epoch)
        return Reporting(self._samples(lanes[worker], distributed, ticket, releaser,
                                        resumed=ticket.restarted), done)

    def _resume_worker(self, state: dict[str, Any], worker: int, workers: int,
                       group: str) -> Iterator[Any] | None:
        """This worker's part of the rest of a resumed epoch (None if an earlier loader's
        workers resumed it). The lease is adopted in the main process's name (whole: the
        readers are not those its plan was written for) and released by the group's last
        worker, as a ticket's."""
        cache = self.reader.cache
        ticket = self._check_resumable(state)
        name = self._home.doc_name
        if claim_ticket(cache, name, group, worker, prepared=None, first_epoch=ticket.epoch,
                       home_pid=self._home.pid, home_owner=self._home.owner, label="", take=False,
                       resumed=ticket) is None:
            self._next_epoch = max(self._next_epoch, ticket.epoch + 1)
            return None
        if ticket.lease:
            adopt_lease(cache, ticket.lease, owner=self._home.owner, pid=self._home.pid, whole=True)
        done = WorkerEnd(cache, name, group, workers)
        try:
            samples = self._resumed_lane(state, ticket, workers, worker)
        except BaseException:
            done(False)
            raise
        return Reporting(samples, done)

    def _resumed_lane(self, state: dict[str, Any], ticket: Ticket, workers: int,
                      worker: int) -> Iterator[Any]:
        """What reader ``worker`` of ``workers`` reads of the resumed epoch of ``state``: the
        rest of its lane (`resume_split`), samples evicted since skipped."""
        split, lane, start = resume_split(self._resumed_order(state), state, workers, worker)
        self._at = _Reading({k: state[k] for k in ORDER_KEYS}, split, worker)
        return self._samples(lane[start:], False, ticket, None, base=start, resumed=True)

    def _samples(self, order: np.ndarray, equal_counts: bool, ticket: Ticket,
                 releaser: Releaser | None, *, base: int = 0,
                 resumed: bool = False) -> Iterator[Any]:
        """Read ``order`` in chunks, releasing each chunk once read (progressive release: its
        samples are copied out, eviction may take them); under DDP a skipped sample is
        replaced by a repeat of an earlier good one, so that every rank still yields the
        agreed count.

        ``base`` is where ``order`` starts in this reader's lane (a resumed epoch), for the
        position [`state_dict`][epochcache.data.stream.CacheStream.state_dict] reports; in a ``resumed`` epoch samples evicted before the
        resume are skipped and counted.

        Raises:
            SnapshotClosed: a sample of the ticket is gone (its lease was released or
                reclaimed under it); the message names the epoch.
        """
        reader = self.reader
        missing = evicted = 0
        self._pos = base
        try:
            for start in range(0, len(order), _CHUNK):
                chunk = order[start : start + _CHUNK]
                before = reader.skipped
                kept: list[int] = []
                if resumed:
                    samples, gone = self._read_present(chunk, kept)
                    evicted += gone
                else:
                    samples = reader.read_samples(chunk, kept=kept)
                missing += reader.skipped - before
                if releaser is not None:
                    releaser.release(start + len(chunk))
                for index, sample in zip(kept, samples):
                    self._pos = base + start + index + 1
                    yield sample
                self._pos = base + start + len(chunk)
            if equal_counts and missing + evicted:
                yield from self._refill(order, missing + evicted)
        except KeyError as exc:
            raise snapshot_gone(reader, ticket.lease or "", ticket.epoch, exc) from exc
        if evicted:
            log.warning("stream epoch %d: %d samples of the interrupted epoch were evicted "
                        "before the %s and were skipped", ticket.epoch, evicted,
                        "new iteration" if ticket.restarted else "resume")

    def _read_present(self, chunk: np.ndarray, kept: list[int]) -> tuple[list[Any], int]:
        """Read ``chunk``, skipping the samples no longer cached; also how many those were."""
        try:
            return self.reader.read_samples(chunk, kept=kept), 0
        except KeyError:
            samples: list[Any] = []
            gone = 0
            for index in range(len(chunk)):
                one: list[int] = []
                try:
                    got = self.reader.read_samples(chunk[index : index + 1], kept=one)
                except KeyError:
                    gone += 1
                    continue
                if one:
                    kept.append(index)
                    samples.extend(got)
            return samples, gone

    def _refill(self, order: np.ndarray, missing: int) -> Iterator[Any]:
        reader = self.reader
        for seq in order:
            if missing == 0:
                return
            try:
                got = reader.read_samples([seq])
            except KeyError:  # evicted (a resumed or restarted epoch): not a replacement
                continue
            if got:
                missing -= 1
                yield got[0]
        if missing:
            log.warning("stream: %d samples of this rank's share could not be decoded and none "
                        "could replace them: this rank yields fewer samples", missing)

    # (Pickled, a stream keeps all but what only its home holds: see _Home.__getstate__.)

    def __repr__(self) -> str:
        return (f"CacheStream(cache={self.reader.path!r}, seed={self.seed}, "
                f"epoch={self.epoch}, split_ranks={self.split_ranks})")


def _drop_quietly(cache: SampleStore, name: str, home_pid: int) -> None:
    if os.getpid() != home_pid:
        return
    try:
        drop_tickets(cache, name)
    except Exception:  # interpreter shutdown: a dead owner's lease is reclaimed anyway
        log.debug("could not drop stream document %s", name, exc_info=True)
    finally:
        end_lease(cache.path)


def _refuse_distributed(epoch: int) -> None:
    """A stream's epoch is not resumed under torch.distributed: each rank's loader state
    holds only that rank's readers (a framework's checkpoint often only rank 0's), and the
    ranks would have to agree on the rest's sample counts in their main processes."""
    raise ValueError(
        f"load_state_dict: the state is of an interrupted epoch {epoch}, and a stream's epoch "
        "cannot be resumed under torch.distributed. Resume without the loader's state (leave "
        "the dataset or StatefulDataLoader state out of load_state_dict) and call "
        f"set_epoch({epoch + 1}) on every rank to go on with the next epoch; to continue an "
        "interrupted epoch exactly under DDP, on any number of ranks, train with "
        "cache.epochs(resume=...) or `epochcache run --resume`")
