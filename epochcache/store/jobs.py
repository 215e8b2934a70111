"""The training jobs that read one cache: what each holds, for ``status``.

Several jobs may train from one node's cache and daemon at once (a sweep). Each keeps its own
snapshots and leases: a lease with a release plan protects only what its job has not read yet
(`release`), so eviction waits for the slowest job only for the samples that job still
has to read. ``status`` shows each job: a job is a trainer process, the owner of leases (by
host and pid); ``epochcache run`` adds what it is (its run directory, rank and epoch) in a
state document ``job/<host>:<pid>`` it refreshes at each epoch.

Per job: its pid and host, what it says of itself, its leases, the epochs they are of, the
samples its snapshots hold and how many of them it has not read yet (``unread``: what it
protects from eviction; a lease without a complete plan protects its whole snapshot).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from typing import TYPE_CHECKING, Any

import lmdb

from ..boot import process_record, recorded_alive
from ..errors import CacheError
from .leases import Lease
from .plans import Part, part_path

if TYPE_CHECKING:
    from .sample_store import SampleStore

log = logging.getLogger("epochcache.cache")

JOB_PREFIX = "job/"
_EPOCH = re.compile(r"epoch (\d+)")


def job_name(host: str, pid: int) -> str:
    return f"{JOB_PREFIX}{host}:{pid}"


def note_job(cache: SampleStore, **fields: Any) -> None:
    """Say what this process is, for ``status`` (``run_dir``, ``rank``, ``epoch``, ...); the
    documents of jobs that died on this host are dropped on the way."""
    host, pid = socket.gethostname(), os.getpid()
    name = job_name(host, pid)
    previous = cache.tables.get_state(name) or {}
    doc = {"started": previous.get("started", time.time()), **previous, **process_record(pid),
           **fields, "updated": time.time()}
    cache.tables.put_state(name, doc)
    for other, seen in cache.tables.states(JOB_PREFIX).items():
        if other != name and seen.get("host") == host and not recorded_alive(seen):
            cache.tables.delete_state(other)


def forget_job(cache: SampleStore) -> None:
    """This process no longer trains from the cache (best effort: a job's document is
    dropped anyway once its process is gone)."""
    try:
        cache.tables.delete_state(job_name(socket.gethostname(), os.getpid()))
    except (lmdb.Error, CacheError, OSError) as exc:
        log.debug("%s: could not drop this job's state document: %s", cache.path, exc)


def unread(cache_path: str, lease: Lease) -> int:
    """Samples of a lease's snapshot its readers have not read yet (what it protects)."""
    if not lease.plan_parts:
        return lease.count
    total = 0
    for part in range(lease.plan_parts):
        try:
            mapped = Part(part_path(cache_path, lease.lease_id, part))
        except (OSError, ValueError):
            return lease.count  # the plan is not complete: the whole snapshot is protected
        lengths = mapped.offsets[1:] - mapped.offsets[:-1]
        total += int((lengths - mapped.positions).sum())
    return min(total, lease.count) if lease.plan_parts == 1 else total


def jobs(cache: SampleStore, leases: list[Lease] | None = None) -> list[dict[str, Any]]:
    """Each job holding leases on the cache, or saying it trains from it (see the module
    docstring), oldest first."""
    now_ns = time.time_ns()
    leases = cache.leases() if leases is None else leases
    docs = cache.tables.states(JOB_PREFIX)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for lease in leases:
        if not lease.is_alive(now_ns, cache.lease_timeout_s, cache.path):
            continue
        job = out.setdefault((lease.host, lease.pid), {
            "pid": lease.pid, "host": lease.host, "leases": 0, "epochs": [], "samples": 0,
            "unread": 0, "since": lease.created_ns / 1e9})
        job["leases"] += 1
        match = _EPOCH.search(lease.label)
        if match:
            job["epochs"].append(int(match.group(1)))
        job["samples"] += lease.count
        job["unread"] += unread(cache.path, lease)
        job["since"] = min(job["since"], lease.created_ns / 1e9)
    for doc in docs.values():
        host, pid = str(doc.get("host")), int(doc.get("pid", -1))
        if host == socket.gethostname() and not recorded_alive(doc):
            continue
        job = out.setdefault((host, pid), {"pid": pid, "host": host, "leases": 0, "epochs": [],
                                           "samples": 0, "unread": 0,
                                           "since": float(doc.get("started", time.time()))})
        for name in ("run_dir", "rank", "epoch", "label"):
            if name in doc:
                job[name] = doc[name]
    for job in out.values():
        job["epochs"] = sorted(set(job["epochs"]))
        job.setdefault("epoch", max(job["epochs"]) if job["epochs"] else None)
        job["since"] = round(job["since"], 3)
    return sorted(out.values(), key=lambda job: job["since"])
