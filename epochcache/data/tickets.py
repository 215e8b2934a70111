"""Epoch tickets: one snapshot that several processes (a loader's workers) agree on.

A torch ``IterableDataset`` is iterated inside each DataLoader worker, and the workers of one
``iter(loader)`` must read one snapshot, split between them, however the cache grows while they
start. The agreement lives in the cache itself: a state document per stream and rank
(``stream/<id>/<rank>``) names the epoch's snapshot by its lease's range, and one write
transaction decides, for the first worker of a group, whether it adopts the snapshot the main
process prepared, adopts the one another worker of its group took, or takes the next epoch's.

The lease is held in the name of the main process (the *home*), so it outlives workers that
finish early and is reclaimed if the main process dies; the last worker of a group to finish
releases it (a worker's samples report its end once: `Reporting`). A document::

    {"epoch": 3, "lo": 100, "hi": 900, "count": 800, "lease": "ab12...", "token": "...",
     "group": "1234:0", "claimed": [0, 1], "done": 1, "release": true}

``token`` names a ticket the main process prepared (``set_epoch``), ``group`` the loader
iteration that claimed it (None until one does), ``claimed`` the workers of that iteration that
did, ``release`` whether the workers release the lease (not under DDP: there the node's leader
releases it once every rank is past the epoch).

A group is the loader's base seed, which repeats when every loader gets a generator seeded
alike (``generator=torch.Generator().manual_seed(0)``, a common habit): a worker whose group
matches but who already claimed the ticket, or whose ticket was released, belongs to a new
iteration, which is a new epoch. A ticket is never handed out again once its lease is released.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import lmdb

from ..store.leases import Lease, delete_lease, note_end, write_lease
from ..store.owners import end_lease, heartbeats
from ..store.reads import record_reads, remove_plan
from ..store.records import DB_LEASES, DB_STATE
from ..store.sample_store import take_snapshot

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """One epoch's snapshot as processes pass it around: its lease's range and count."""

    epoch: int
    lo: int
    hi: int
    count: int
    lease: str | None  # None on DDP ranks that are not their node's leader
    token: str = ""
    #: Read again from its start by a new loader iteration, after one that stopped before
    #: its end (see `claim_ticket`): samples that one released may be gone.
    restarted: bool = False


def _load(txn: lmdb.Transaction, cache: SampleStore, name: str) -> dict[str, Any] | None:
    raw = txn.get(name.encode(), db=cache.env.dbs[DB_STATE])
    return None if raw is None else dict(json.loads(bytes(raw)))


def _save(txn: lmdb.Transaction, cache: SampleStore, name: str, doc: dict[str, Any]) -> None:
    txn.put(name.encode(), json.dumps(doc, separators=(",", ":")).encode(), db=cache.env.dbs[DB_STATE])


def _ticket_of(doc: dict[str, Any]) -> Ticket:
    return Ticket(doc["epoch"], doc["lo"], doc["hi"], doc["count"], doc["lease"], doc["token"],
                 bool(doc.get("restarted")))


def _release_old(txn: lmdb.Transaction, cache: SampleStore, doc: dict[str, Any] | None, *,
                 finished: bool, reason: str) -> None:
    """Release the lease of the ticket ``doc`` records, if its readers release it.

    ``finished=False``: the epoch was abandoned before its end (the stream closed or
    collected, its main process exiting or killed): a lease a state named for a resume
    (``resume_grace_s``, set by [`CacheStream.state_dict`][epochcache.data.stream.CacheStream.state_dict]) is then left for the resumed
    run -- held by no process, kept for its grace -- never released by a worker.
    """
    if doc is None or not doc.get("lease") or not doc.get("release") or doc.get("released"):
        return
    db = cache.env.dbs[DB_LEASES]
    raw = txn.get(doc["lease"].encode(), db=db)
    if raw is None:
        return
    lease = Lease.from_bytes(raw)
    if not finished and lease.resume_grace_s > 0:
        lease.owner, lease.pid, lease.start_ticks = "", 0, None  # see release_lease
        lease.heartbeat_ns = time.time_ns()
        write_lease(txn, db, lease)
        return
    delete_lease(txn, db, doc["lease"])
    note_end(txn, cache.env.dbs[DB_STATE], doc["lease"], reason)
    record_reads(txn, cache.env.dbs, cache.path, doc["lease"])
    remove_plan(cache.path, doc["lease"])  # (a file, outside the transaction's undo)


def publish_ticket(cache: SampleStore, name: str, ticket: Ticket, release: bool) -> None:
    """Record a ticket the main process prepared, for its workers to claim."""
    doc = {**asdict(ticket), "group": None, "done": 0, "release": release, "released": False}

    def run(txn: lmdb.Transaction) -> None:
        old = _load(txn, cache, name)
        if old is not None and old.get("lease") != ticket.lease:
            # a worker-taken lease of an earlier epoch: the stream went on to the next
            _release_old(txn, cache, old, finished=True,
                         reason="released when its stream prepared the next epoch")
        _save(txn, cache, name, doc)

    cache.env.write(run)


def claim_ticket(cache: SampleStore, name: str, group: str, worker: int, *,
                progressive: bool = True, prepared: Ticket | None, first_epoch: int,
                home_pid: int, home_owner: str, label: str, take: bool,
                resumed: Ticket | None = None, workers: int = 1) -> Ticket | None:
    """The ticket worker ``worker`` of the loader iteration ``group`` reads, agreed in one
    write transaction.

    In order: the ticket another worker of ``group`` already claimed (unless this worker did
    too, or the ticket was released: then this is a new iteration); the ``prepared`` ticket,
    if no iteration claimed it yet; else, when ``take``, a new snapshot for the epoch after the
    last one recorded (or ``first_epoch``), leased in the name of ``home_pid`` and its owner
    lock ``home_owner`` (the stream's, `begin_lease`). Returns None
    when a new snapshot is needed but ``take`` is false (under DDP, where only the main
    process may agree on one). With ``resumed`` (the rest of an interrupted epoch, its lease
    adopted), the iteration reads that ticket and its last worker releases its lease; None
    then means an earlier iteration resumed it already.

    Under DDP (``take`` false) a new iteration that finds the ``prepared`` ticket claimed by
    an iteration that did not read it to its end starts it over: a loader iterator created
    and dropped before the epoch (Lightning 2.6 calls ``iter()`` twice) must not use up the
    epoch the ranks agreed on. The ticket is then ``restarted``.
    """

    limit = cache.effective_capacity  # read before the write transaction, as snapshot() does

    def run(txn: lmdb.Transaction) -> Ticket | None:
        doc = _load(txn, cache, name)
        if resumed is not None:
            marker = _resumed_key(name)
            if txn.get(marker, db=cache.env.dbs[DB_STATE]) != resumed.token.encode():
                # The first reader of this resume: the iteration ``group`` reads it. Recorded
                # apart from the document, which the next epoch replaces: the main process's
                # copy of the stream still holds the state, and every later loader's workers
                # receive it again (a copy pickled into them), so without this record each
                # later pass would resume the old epoch once more.
                txn.put(marker, resumed.token.encode(), db=cache.env.dbs[DB_STATE])
                _save(txn, cache, name, {**asdict(resumed), "group": group, "claimed": [worker],
                                         "done": 0, "release": True, "released": False})
                return resumed
            if (doc is not None and doc.get("lease") == resumed.lease
                    and doc.get("group") == group and not doc.get("released")
                    and worker not in doc.get("claimed", ())):
                doc["claimed"] = [*doc.get("claimed", ()), worker]
                _save(txn, cache, name, doc)
                return resumed
            return None  # resumed by an earlier iteration already: the next epoch follows
        if (doc is not None and doc.get("group") == group and not doc.get("released")
                and worker not in doc.get("claimed", ())):
            doc["claimed"] = [*doc.get("claimed", ()), worker]
            _save(txn, cache, name, doc)
            return _ticket_of(doc)
        if (prepared is not None and doc is not None and doc.get("group") is None
                and doc.get("token") == prepared.token):
            doc["group"], doc["claimed"], doc["workers"] = group, [worker], workers
            _save(txn, cache, name, doc)
            return _ticket_of(doc)
        if (not take and prepared is not None and doc is not None
                and doc.get("token") == prepared.token and not doc.get("released")
                and int(doc.get("complete", 0)) < int(doc.get("workers") or 1)):
            doc.update(group=group, claimed=[worker], done=0, complete=0, workers=workers,
                       restarted=True)
            _save(txn, cache, name, doc)
            return _ticket_of(doc)
        if not take:
            return None
        _release_old(txn, cache, doc, finished=True,
                     reason="released when its stream's workers took the next epoch")
        epoch = first_epoch if doc is None else max(first_epoch, int(doc["epoch"]) + 1)
        seqs, lease_id = take_snapshot(cache, txn, f"{label} epoch {epoch}", limit,
                                             owner=home_owner, pid=home_pid,
                                             plan_parts=1 if progressive else 0)
        lo = int(seqs[0]) if len(seqs) else 0
        hi = int(seqs[-1]) + 1 if len(seqs) else 0
        ticket = Ticket(epoch, lo, hi, len(seqs), lease_id)
        _save(txn, cache, name, {**asdict(ticket), "group": group, "claimed": [worker],
                                 "done": 0, "release": True, "released": False})
        return ticket

    return cache.env.write(run)


def finish_ticket(cache: SampleStore, name: str, group: str, workers: int, *,
                 complete: bool = True) -> None:
    """One worker of ``group`` is done: ``complete`` when it read its whole part, not when it
    stopped early (shut down, its main process gone). The last of ``workers`` releases the
    lease, unless the group stopped early and a state named the lease for a resume: then it
    is left for the resume (see `_release_old`) -- a trainer killed alone (the OOM
    killer, a segfault) must find its epoch when it resumes, though its workers exit
    normally when they see it gone."""

    def run(txn: lmdb.Transaction) -> None:
        doc = _load(txn, cache, name)
        if doc is None or doc.get("group") != group:
            return  # a newer iteration took over; it released this one's lease
        doc["done"] = int(doc.get("done", 0)) + 1
        doc["complete"] = int(doc.get("complete", 0)) + int(complete)
        if doc["done"] >= workers and doc.get("release") and not doc.get("released"):
            finished = doc["complete"] >= workers
            _release_old(txn, cache, doc, finished=finished,
                         reason="released by its stream's workers at the end of the epoch"
                         if finished else "released by its stream's workers when they "
                         "stopped, before any state named the lease")
            doc["released"] = True
        _save(txn, cache, name, doc)

    cache.env.write(run)


class WorkerEnd:
    """A worker's end of its ticket, reported to `finish_ticket` the first time it is called,
    never again (the samples ran out, or the worker stopped or failed before)."""

    def __init__(self, cache: SampleStore, name: str, group: str, workers: int) -> None:
        self._ticket: tuple[SampleStore, str, str, int] | None = (cache, name, group, workers)

    def __call__(self, complete: bool) -> None:
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            finish_ticket(*ticket, complete=complete)


class Reporting(Iterator[Any]):
    """A worker's samples that report their end once: exhausted (complete), or closed or
    collected before that (the worker shut down or exiting because its main process is
    gone: not complete, see `finish_ticket`)."""

    def __init__(self, samples: Iterator[Any], done: WorkerEnd) -> None:
        self._samples, self._done = samples, done

    def __next__(self) -> Any:
        try:
            return next(self._samples)
        except StopIteration:
            self._done(True)
            raise

    def close(self) -> None:
        close = getattr(self._samples, "close", None)
        if close is not None:
            close()
        self._done(False)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # a worker exiting at shutdown: the home process cleans up
            log.debug("stream: could not report a worker's end", exc_info=True)


def last_epoch(cache: SampleStore, name: str) -> int | None:
    """The epoch last recorded under ``name`` (by the main process or its workers)."""
    with cache.env.read() as txn:
        doc = _load(txn, cache, name)
    return None if doc is None else int(doc["epoch"])


def drop_tickets(cache: SampleStore, name: str) -> None:
    """Release a worker-taken lease still recorded under ``name`` (one a state named is left
    for its resume) and forget the document."""

    def run(txn: lmdb.Transaction) -> None:
        _release_old(txn, cache, _load(txn, cache, name), finished=False,
                     reason="released when its stream was closed, before any state named "
                     "the lease")
        txn.delete(name.encode(), db=cache.env.dbs[DB_STATE])
        txn.delete(_resumed_key(name), db=cache.env.dbs[DB_STATE])

    cache.env.write(run)


def _resumed_key(name: str) -> bytes:
    """Where the token of the last resume a loader iteration of ``name`` took is kept."""
    return f"{name}/resumed".encode()


def unwatch(cache: SampleStore, lease_id: str) -> None:
    """Stop heartbeating a snapshot whose lease a ticket now manages: its workers may release
    it, which the heartbeat would report as a reclaim. The stream's owner lock
    (`CacheStream`'s) keeps the lease alive instead, so the snapshot's count is returned."""
    if heartbeats().remove(cache.path, lease_id):
        end_lease(cache.path)
