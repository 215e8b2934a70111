"""Cache statistics as a JSON-able dict (``status --json``) and as a rich table."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from ..boot import recorded_alive
from ..epoch_record import HISTORY, epoch_history, is_epoch_row, status_cell
from ..redact import redact_tree
from ..stall_records import read_stalls
from ..units import format_count, format_size
from .jobs import jobs

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .sample_store import SampleStore

#: A daemon whose heartbeat is older than this is reported as not alive.
DAEMON_STALE_S = 60.0
#: A source none of whose reads succeeded for this long is *failing*: the samplers log it and
#: write it to their health document, status and the metrics report it (one value for all).
FAILING_AFTER_S = 60.0


def daemon_health(doc: dict[str, Any] | None, now: float | None = None) -> dict[str, Any] | None:
    """The daemon's state document plus whether it is alive (pid on this host, fresh heartbeat)."""
    if doc is None:
        return None
    now = time.time() if now is None else now
    age = now - float(doc.get("heartbeat", 0))
    if doc.get("host") == socket.gethostname():
        alive = recorded_alive(doc) and not doc.get("stopped")
    else:
        alive = age < DAEMON_STALE_S and not doc.get("stopped")
    return {**doc, "alive": bool(alive), "heartbeat_age_s": round(age, 1)}


def failing_sources(daemon: dict[str, Any] | None, now: float | None = None
                    ) -> dict[str, dict[str, Any]]:
    """``{source label: {for_s, error, stopped}}``: the sources of a live daemon none of whose
    reads succeeded for `FAILING_AFTER_S` in some sampler, or that a refusal stopped
    (``ingest.feed``), from the samplers' health documents. A source failing in every sampler
    is not busy: no sample of it is coming."""
    if not daemon or not daemon.get("alive"):
        return {}
    now = time.time() if now is None else now
    found: dict[str, dict[str, Any]] = {}
    for sampler in (daemon.get("samplers") or {}).values():
        if not sampler.get("alive", True):
            continue
        for label, entry in (sampler.get("failing") or {}).items():
            for_s = now - float(entry.get("since", now))
            if not entry.get("stopped") and for_s < FAILING_AFTER_S:
                continue
            known = found.get(label)
            if known is None or for_s > known["for_s"]:
                found[label] = {"for_s": round(for_s, 1), "error": str(entry.get("error", "")),
                                "stopped": bool(entry.get("stopped"))}
    return found


def ingest_rate(history: list[dict[str, Any]], window_s: float = 60.0) -> dict[str, float]:
    """Samples/s and bytes/s inserted over the last ``window_s`` of history rows."""
    if len(history) < 2 or time.time() - history[-1]["time"] > 2 * window_s:
        return {"samples_per_s": 0.0, "bytes_per_s": 0.0}  # no recent rows: nothing is ingesting
    last = history[-1]
    first = next((row for row in history if last["time"] - row["time"] <= window_s), history[-2])
    if first is last:
        first = history[-2]
    dt = max(1e-9, last["time"] - first["time"])
    inserted_bytes = (last["bytes"] + last["evicted_bytes"]) - (first["bytes"] + first["evicted_bytes"])
    return {
        "samples_per_s": round((last["inserted"] - first["inserted"]) / dt, 2),
        "bytes_per_s": round(inserted_bytes / dt, 1),
    }


#: The request counters samplers and the daemon keep per source (``ingest.accounting``), and
#: the gauges (the value now, summed over the live samplers).
REQUEST_COUNTERS = ("gets", "heads", "lists", "bytes", "throttled", "timeouts", "errors", "retries")
REQUEST_GAUGES = ("concurrency", "pace")


def request_totals(cache: SampleStore) -> dict[str, dict[str, float]]:
    """What each source cost in requests and egress so far: ``{source: {gets, heads, lists, bytes,
    throttled, timeouts, errors, retries, concurrency, pace}}``, the counters summed over the
    sampler health documents and the daemon's (they go on across restarts), the requests in
    flight over the samplers of a live daemon, and its pace after throttling (one per source,
    shared by the samplers). A single ``source:`` is keyed ``source``."""
    daemon = daemon_health(cache.tables.get_state("daemon"))
    live = {str(i) for i, doc in ((daemon or {}).get("samplers") or {}).items()
            if doc.get("alive")} if daemon and daemon["alive"] else set()
    totals: dict[str, dict[str, float]] = {}

    def add(requests: Any, gauges: bool) -> None:
        if not isinstance(requests, dict):
            return
        for label, values in requests.items():
            if not isinstance(values, dict):
                continue
            into = totals.setdefault(str(label), dict.fromkeys(REQUEST_COUNTERS +
                                                                 REQUEST_GAUGES, 0))
            for name in REQUEST_COUNTERS + (REQUEST_GAUGES if gauges else ()):
                value = values.get(name, 0)
                if not isinstance(value, (int, float)):
                    continue
                if name == "pace":  # one pace per source, shared by the samplers
                    into[name] = max(into[name], value)
                else:
                    into[name] += value
            if gauges:  # the concurrency is summed over these (say so: 2 x 32, not 64)
                into["samplers"] = into.get("samplers", 0) + 1

    for name, doc in cache.tables.states("sampler/").items():
        add(doc.get("requests"), name.rsplit("/", 1)[-1] in live)
    add((daemon or {}).get("requests"), False)
    for values in totals.values():
        values["pace"] = round(values["pace"], 1)
    return totals


def request_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                  ) -> dict[str, dict[str, float]]:
    """The counters of `request_totals` between two readings (the gauges as they are
    at the second): what an epoch cost."""
    out = {}
    for label, values in after.items():
        start = before.get(label, {})
        row = {name: values.get(name, 0) - start.get(name, 0) for name in REQUEST_COUNTERS}
        row.update({name: values.get(name, 0) for name in (*REQUEST_GAUGES, "samplers")})
        out[label] = row
    return out


def describe_requests(values: dict[str, float], *, local: bool = False,
                      epoch: bool = False) -> str:
    """One line of a source's request counters (status, a run's log): ``local`` for a source
    on this machine's filesystem (file reads and listings, not GETs and LISTs); ``epoch`` for
    the counts of one epoch (bytes may arrive for requests sent before it)."""
    gets, lists, nbytes = values.get("gets", 0), values.get("lists", 0), values.get("bytes", 0)
    if local:
        text = (f"{format_count(gets, 'file read')}, {format_count(lists, 'listing')}, "
                f"{format_size(nbytes)} read")
    else:
        heads = values.get("heads", 0)
        text = (f"{format_count(gets, 'GET')}, "
                + (f"{format_count(heads, 'HEAD')}, " if heads else "")
                + f"{format_count(lists, 'LIST')}, {format_size(nbytes)} received")
    if epoch and nbytes and not gets:
        text += " (for requests sent before this epoch)"
    for name in ("throttled", "retries", "timeouts", "errors"):
        if values.get(name):
            text += f", {name} {int(values[name]):,}"
    concurrency, samplers = int(values.get("concurrency", 0)), int(values.get("samplers", 0))
    if concurrency:
        text += f", concurrency {concurrency}"
        if samplers > 1:  # the config's sampler.concurrency is per sampler
            text += (f" ({samplers} samplers x {concurrency // samplers})"
                     if concurrency % samplers == 0 else f" (over {samplers} samplers)")
    if values.get("pace"):
        text += f" (paced at {values['pace']:g}/s)"
    return text


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
    return redact_tree(_collect(cache))  # type: ignore[no-any-return]


def _collect(cache: SampleStore) -> dict[str, Any]:
    counters = cache.counters()
    now = time.time()
    leases = cache.leases()
    history = cache.history(limit=200)
    lowered = cache.capacity_lowered()
    capacity = cache.capacity.effective if lowered is None else min(
        cache.capacity.effective, int(lowered["limit"]))
    return {
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
        "sources": cache.source_stats(),
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
        "jobs": jobs(cache, leases),
        "ingest": ingest_rate(history),
        "daemon": daemon_health(cache.tables.get_state("daemon"), now),
        # sources none of whose reads succeeded for a minute, or stopped by a refusal
        "failing": failing_sources(daemon_health(cache.tables.get_state("daemon"), now), now),
        "requests": request_totals(cache),
        "recent_quarantine": cache.quarantined(limit=5),
        "turnover": recent_epochs(cache),
        # trainers whose batch stalled, while they run (see epochcache.data.stall)
        "stalls": [{**doc, "for_s": round(now - float(doc.get("since", now)), 1)}
                   for doc in read_stalls(cache.path)],
    }


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
        leases = Table(title="leases", title_justify="left")
        for column in ("id", "label", "pid", "host", "samples", "age_s", "alive"):
            leases.add_column(column)
        for lease in stats["lease_details"]:
            leases.add_row(*(str(lease[c]) for c in ("id", "label", "pid", "host", "samples", "age_s", "alive")))
        parts.append(leases)
    if stats.get("jobs"):
        table_jobs = Table(title="jobs (trainers reading this cache)", title_justify="left")
        for column in ("pid", "host", "run", "rank", "epoch", "snapshot samples",
                       "unread (protected)"):
            table_jobs.add_column(column)
        for job in stats["jobs"]:
            table_jobs.add_row(str(job["pid"]), str(job["host"]),
                               str(job.get("run_dir") or job.get("label") or "-"),
                               str(job.get("rank", "-")),
                               "-" if job.get("epoch") is None else str(job["epoch"]),
                               f"{job['samples']:,}", f"{job['unread']:,}")
        parts.append(table_jobs)
    if stats.get("turnover"):
        turnover = Table(title="turnover (epochs of epochcache run)", title_justify="left")
        columns = [f for f in HISTORY if f.label]  # the epoch record's fields status shows
        for f in columns:
            turnover.add_column(f.label)
        for row in stats["turnover"]:
            turnover.add_row(*(status_cell(f, row) for f in columns))
        parts.append(turnover)
    coverage_table = _coverage_table(stats.get("coverage") or {})
    if coverage_table is not None:
        parts.append(coverage_table)
    if stats["recent_quarantine"]:
        quarantine = Table(title="recent quarantine", title_justify="left")
        quarantine.add_column("key")
        quarantine.add_column("reason")
        for row in stats["recent_quarantine"]:
            quarantine.add_row(escape(str(row.get("key"))), escape(str(row.get("reason"))))
        parts.append(quarantine)
    return Group(*parts)


def _coverage_table(coverage: dict[str, Any]) -> RenderableType | None:
    """What training has seen of each source (``cache.coverage()``), or None before any."""
    from rich.table import Table

    from ..units import format_duration

    sources = coverage.get("sources") or []
    if not sources:
        return None
    table = Table(title="coverage (distinct samples trained on, of those listed)",
                  title_justify="left")
    for column in ("source", "covered", "epochs per sample", "growth", "all seen in"):
        table.add_column(column)
    for row in sources:
        approx = "~" if row["estimated"] else ""
        covered = f"{row['covered']:,} / {approx}{row['samples']:,} ({row['fraction']:.1%})"
        if row["num_nodes"] > 1:
            covered += f", {row['share_fraction']:.1%} of node {row['node_rank']}'s share"
        histogram = row["histogram"]
        shown = ", ".join(f"{label}: {count:,}" for label, count in histogram.items()
                          if count or label == "0")
        growth = f"{3600 * row['coverage_per_s']:,.0f}/h"
        table.add_row(row["source"] or str(row["url"]), covered, shown, growth,
                      format_duration(row["eta_s"]))
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
