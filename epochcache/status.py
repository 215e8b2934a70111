"""What ``epochcache status`` shows: the cache's statistics as a JSON-able dict (``status
--json``, `Cache.stats`) and as a rich table, and the trainers that read the cache.

It reads what each layer writes: the store's counters and leases, the health documents of the
daemon and its samplers (`epochcache.ingest.health`), the coverage report, stall records, and
the documents trainers keep of themselves (below).

**Trainers.** Several jobs may train from one node's cache and daemon at once (a sweep), each
with a trainer process per rank. Each trainer keeps its own snapshots and leases: a lease with
a release plan protects only what its trainer has not read yet (`epochcache.store.release`),
so eviction waits for the slowest trainer only for the samples it still has to read.
``status`` shows each trainer: the owner of leases (by host and pid); ``epochcache run`` adds
what it is (its run directory, rank and epoch) in a state document ``job/<host>:<pid>`` it
refreshes at each epoch.

Per trainer: its pid and host, what it says of itself, its leases, the epochs they are of, the
samples its snapshots hold and how many of them it has not read yet (``unread``: what it
protects from eviction; a lease without a complete plan protects its whole snapshot).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import lmdb

from .coverage import coverage
from .epoch_record import HISTORY, epoch_history, is_epoch_row, status_cell
from .errors import CacheError
from .ingest.health import (
    daemon_health,
    describe_requests,
    failing_sources,
    ingest_rate,
    request_totals,
)
from .paths import process_record, read_stalls, recorded_alive
from .redact import redact_tree
from .store.leases import Lease, unread
from .store.plumbing import source_stats
from .units import format_size

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from .store.sample_store import SampleStore

log = logging.getLogger("epochcache.cache")

#: A trainer's state document is ``job/<host>:<pid>``: the stored name keeps the older word, so
#: that caches written before the rename and after it read alike.
TRAINER_PREFIX = "job/"
_EPOCH = re.compile(r"epoch (\d+)")


def trainer_doc(host: str, pid: int) -> str:
    return f"{TRAINER_PREFIX}{host}:{pid}"


def note_trainer(cache: SampleStore, **fields: Any) -> None:
    """Say what this process is, for ``status`` (``run_dir``, ``rank``, ``epoch``, ...); the
    documents of trainers that died on this host are dropped on the way."""
    host, pid = socket.gethostname(), os.getpid()
    name = trainer_doc(host, pid)
    previous = cache.tables.get_state(name) or {}
    doc = {"started": previous.get("started", time.time()), **previous, **process_record(pid),
           **fields, "updated": time.time()}
    cache.tables.put_state(name, doc)
    for other, seen in cache.tables.states(TRAINER_PREFIX).items():
        if other != name and seen.get("host") == host and not recorded_alive(seen):
            cache.tables.delete_state(other)


def forget_trainer(cache: SampleStore) -> None:
    """This process no longer trains from the cache (best effort: a trainer's document is
    dropped anyway once its process is gone)."""
    try:
        cache.tables.delete_state(trainer_doc(socket.gethostname(), os.getpid()))
    except (lmdb.Error, CacheError, OSError) as exc:
        log.debug("%s: could not drop this trainer's state document: %s", cache.path, exc)


def trainers(cache: SampleStore, leases: list[Lease] | None = None) -> list[dict[str, Any]]:
    """Each trainer holding leases on the cache, or saying it trains from it (see the module
    docstring), oldest first."""
    now_ns = time.time_ns()
    leases = cache.leases() if leases is None else leases
    docs = cache.tables.states(TRAINER_PREFIX)
    out: dict[tuple[str, int], dict[str, Any]] = {}

    def entry(host: str, pid: int, since: float) -> dict[str, Any]:
        return out.setdefault((host, pid), {"pid": pid, "host": host, "leases": 0, "epochs": [],
                                            "samples": 0, "unread": 0, "since": since})

    for lease in leases:
        if not lease.is_alive(now_ns, cache.lease_timeout_s, cache.path):
            continue
        trainer = entry(lease.host, lease.pid, lease.created_ns / 1e9)
        trainer["leases"] += 1
        match = _EPOCH.search(lease.label)
        if match:
            trainer["epochs"].append(int(match.group(1)))
        trainer["samples"] += lease.count
        trainer["unread"] += unread(cache.path, lease)
        trainer["since"] = min(trainer["since"], lease.created_ns / 1e9)
    for doc in docs.values():
        host, pid = str(doc.get("host")), int(doc.get("pid", -1))
        if host == socket.gethostname() and not recorded_alive(doc):
            continue
        trainer = entry(host, pid, float(doc.get("started", time.time())))
        for name in ("run_dir", "rank", "epoch", "label"):
            if name in doc:
                trainer[name] = doc[name]
    for trainer in out.values():
        trainer["epochs"] = sorted(set(trainer["epochs"]))
        trainer.setdefault("epoch", max(trainer["epochs"]) if trainer["epochs"] else None)
        trainer["since"] = round(trainer["since"], 3)
    return sorted(out.values(), key=lambda trainer: trainer["since"])


#: History rows ``status`` looks through for the epochs of a run (5 s apart: ~7 hours).
TURNOVER_SCAN_ROWS = 5000


def recent_epochs(cache: SampleStore, count: int = 5) -> list[dict[str, Any]]:
    """The turnover of the last ``count`` epochs ``epochcache run`` recorded: epoch, samples
    new to its snapshot, snapshot size, fraction of the epoch writers waited on leases."""
    rows = [row for row in cache.history(limit=TURNOVER_SCAN_ROWS) if is_epoch_row(row)]
    return [epoch_history(row) for row in rows[-count:]]


def collect_stats(cache: SampleStore) -> dict[str, Any]:
    """Everything ``status`` shows, with URL credentials masked (state documents written by
    older versions may hold them)."""
    counters = cache.counters()
    now = time.time()
    leases = cache.leases()
    lowered = cache.capacity.lowered()
    capacity = cache.capacity.effective if lowered is None else min(
        cache.capacity.effective, int(lowered["limit"]))
    daemon = daemon_health(cache.tables.get_state("daemon"), now)
    return redact_tree({  # type: ignore[no-any-return]
        "path": cache.path,
        "samples": counters.samples,
        "bytes": counters.bytes,
        "capacity": cache.capacity_bytes,
        "effective_capacity": capacity,
        "capacity_lowered": None if lowered is None else {
            name: lowered.get(name) for name in ("limit", "reason", "since", "pid")
        },
        "headroom": cache.headroom_bytes,
        "fill": round(counters.bytes / capacity, 4) if capacity else 0.0,
        "inserted": counters.inserted,
        "evicted": counters.evicted,
        "evicted_bytes": counters.evicted_bytes,
        "quarantined": counters.quarantined,
        # rows dropped (the oldest) to keep the quarantine table within its bounds
        "quarantine_dropped": cache.tables.quarantine_dropped(),
        "sources": source_stats(cache),
        "file_bytes": cache.file_bytes(),
        # held leases: a dead owner's lease (listed with alive false) holds nothing, the next
        # writer reclaims it
        "leases": sum(lease.is_alive(time.time_ns(), cache.lease_timeout_s, cache.path)
                      for lease in leases),
        "lease_details": [
            {
                "id": lease.lease_id[:8],
                "label": lease.label,
                "pid": lease.pid,
                "host": lease.host,
                "samples": lease.count,
                "age_s": round(now - lease.created_ns / 1e9, 1),
                "alive": lease.is_alive(time.time_ns(), cache.lease_timeout_s, cache.path),
            }
            for lease in leases
        ],
        # the trainers, under the older word: the key is kept for scripts that read `status --json`
        "jobs": trainers(cache, leases),
        "ingest": ingest_rate(cache.history(limit=200)),
        "daemon": daemon,
        # sources none of whose reads succeeded for a minute, or stopped by a refusal
        "failing": failing_sources(daemon, now),
        "requests": request_totals(cache),
        "recent_quarantine": cache.quarantined(limit=5),
        "turnover": recent_epochs(cache),
        # trainers whose batch stalled, while they run (see epochcache.data.stall)
        "stalls": [{**doc, "for_s": round(now - float(doc.get("since", now)), 1)}
                   for doc in read_stalls(cache.path)],
    })


def stats_with_coverage(cache: SampleStore) -> dict[str, Any]:
    """`collect_stats` and the coverage report: what ``epochcache status`` and `Cache.stats`
    show (the store's statistics do not reach up to what training saw)."""
    return {**collect_stats(cache), "coverage": coverage(cache)}


def render(stats: dict[str, Any]) -> RenderableType:
    """A human table of `collect_stats` output."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"epochcache  {stats['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    fill = f"{format_size(stats['bytes'])} / {format_size(stats['effective_capacity'])} ({stats['fill']:.0%})"
    lowered = stats.get("capacity_lowered")
    if lowered:
        since = time.strftime("%H:%M:%S", time.localtime(lowered["since"]))
        fill += (f"  [yellow]lowered from {format_size(stats['capacity'])} since {since} by pid "
                 f"{lowered['pid']}: {escape(str(lowered['reason']))}[/]")
    table.add_row("samples", f"{stats['samples']:,}")
    table.add_row("stored", fill)
    table.add_row("headroom", format_size(stats["headroom"]))
    table.add_row("data file", format_size(stats["file_bytes"]))
    table.add_row("inserted / evicted", f"{stats['inserted']:,} / {stats['evicted']:,}")
    ingest = stats["ingest"]
    table.add_row("ingest", f"{ingest['samples_per_s']:.1f} samples/s, {format_size(ingest['bytes_per_s'])}/s")
    quarantined = stats["quarantined"]
    shown = f"[red]{quarantined:,}[/]" if quarantined else "0"
    if stats.get("quarantine_dropped"):
        shown += f" (the oldest {stats['quarantine_dropped']:,} rows dropped to bound the table)"
    table.add_row("quarantined", shown)
    for name, source in sorted(stats.get("sources", {}).items()):
        table.add_row(f"  source {name}", f"{source['samples']:,} samples, "
                      f"{format_size(source['bytes'])}, ingested {source['ingested']:,}, "
                      f"quarantined {source['quarantined']:,}")
    for name, values in sorted(stats.get("requests", {}).items()):
        table.add_row(f"requests {name}", describe_requests(values))
    daemon = stats["daemon"]
    if daemon is None:
        table.add_row("daemon", "none")
    else:
        state = "[green]alive[/]" if daemon["alive"] else "[red]not running[/]"
        table.add_row("daemon", f"{state} pid {daemon.get('pid')} on {daemon.get('host')}, "
                      f"heartbeat {daemon['heartbeat_age_s']:.0f}s ago")
        if daemon.get("metrics"):
            table.add_row("  metrics", str(daemon["metrics"]))
        for name, sampler in sorted((daemon.get("samplers") or {}).items()):
            table.add_row(f"  {name}", _sampler_line(sampler))
    for label, failing in sorted((stats.get("failing") or {}).items()):
        how = "stopped" if failing["stopped"] else "failing"
        table.add_row(f"[red]source {escape(label)}[/]", escape(
            f"{how}: no read succeeded for {failing['for_s']:.0f} s: {failing['error']}"))
    for stall in stats.get("stalls", ()):
        table.add_row("[red]stalled[/]", escape(
            f"{stall.get('process')}: {stall.get('what')} for {stall.get('for_s', 0):.0f} s, "
            f"sample key {stall.get('key')}"
            + (f", waiting for {stall['worker']}" if stall.get("worker") else "")
            + (" (ending with StallError)" if stall.get("action") == "raise" else "")))
    parts: list[RenderableType] = [table]
    if stats["lease_details"]:
        columns = ("id", "label", "pid", "host", "samples", "age_s", "alive")
        parts.append(_table("leases", columns, ([str(lease[c]) for c in columns]
                                                for lease in stats["lease_details"])))
    if stats.get("jobs"):
        parts.append(_table(
            "jobs (trainers reading this cache)",
            ("pid", "host", "run", "rank", "epoch", "snapshot samples", "unread (protected)"),
            ([str(trainer["pid"]), str(trainer["host"]),
              str(trainer.get("run_dir") or trainer.get("label") or "-"),
              str(trainer.get("rank", "-")),
              "-" if trainer.get("epoch") is None else str(trainer["epoch"]),
              f"{trainer['samples']:,}", f"{trainer['unread']:,}"] for trainer in stats["jobs"])))
    if stats.get("turnover"):
        figures = [f for f in HISTORY if f.label]  # the epoch record's fields status shows
        parts.append(_table("turnover (epochs of epochcache run)", [f.label for f in figures],
                            ([status_cell(f, row) for f in figures] for row in stats["turnover"])))
    coverage_table = _coverage_table(stats.get("coverage") or {})
    if coverage_table is not None:
        parts.append(coverage_table)
    if stats["recent_quarantine"]:
        parts.append(_table("recent quarantine", ("key", "reason"),
                            ([escape(str(row.get("key"))), escape(str(row.get("reason")))]
                             for row in stats["recent_quarantine"])))
    return Group(*parts)


def _table(title: str, columns: Iterable[str], rows: Iterable[list[str]]) -> Table:
    """A titled table of ``rows`` under ``columns``."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    return table


def _coverage_table(coverage: dict[str, Any]) -> Table | None:
    """What training has seen of each source (``cache.coverage()``), or None before any."""
    from .units import format_duration

    sources = coverage.get("sources") or []
    if not sources:
        return None
    cells = []
    for row in sources:
        approx = "~" if row["estimated"] else ""
        covered = f"{row['covered']:,} / {approx}{row['samples']:,} ({row['fraction']:.1%})"
        if row["num_nodes"] > 1:
            covered += f", {row['share_fraction']:.1%} of node {row['node_rank']}'s share"
        histogram = row["histogram"]
        shown = ", ".join(f"{label}: {count:,}" for label, count in histogram.items()
                          if count or label == "0")
        growth = f"{3600 * row['coverage_per_s']:,.0f}/h"
        cells.append([row["source"] or str(row["url"]), covered, shown, growth,
                      format_duration(row["eta_s"])])
    table = _table("coverage (distinct samples trained on, of those listed)",
                   ("source", "covered", "epochs per sample", "growth", "all seen in"), cells)
    if coverage.get("unattributed"):
        table.caption = (f"{coverage['unattributed']:,} trained samples had no recorded origin "
                         "(cached by an older version, or put through the Python API)")
    return table


def _sampler_line(sampler: dict[str, Any]) -> str:
    state = "[green]up[/]" if sampler.get("alive", True) else "[red]down[/]"
    bits = [state, f"pid {sampler.get('pid')}", f"fetched {sampler.get('fetched', 0):,}"]
    if sampler.get("errors"):
        bits.append(f"[yellow]errors {sampler['errors']}[/]")
    if sampler.get("quarantined"):
        bits.append(f"quarantined {sampler['quarantined']}")
    if sampler.get("deferred"):
        bits.append(f"[yellow]deferred {sampler['deferred']} (larger than the headroom)[/]")
    down = sorted(name for name, src in (sampler.get("sources") or {}).items() if src.get("down"))
    if down:
        bits.append(f"[yellow]source {', '.join(down)} down (retried)[/]")
    if sampler.get("waiting_for_space"):
        bits.append("waiting for space")
    if sampler.get("restarts"):
        bits.append(f"[yellow]restarts {sampler['restarts']}[/]")
    if sampler.get("last_error"):
        bits.append(f"last error: {sampler['last_error']}")
    return ", ".join(bits)
