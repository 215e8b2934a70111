"""The documents a daemon and its samplers keep in the cache, and what their readers make of
them: whether the daemon is alive, which sources are failing, what each source cost in
requests and egress, how fast samples come in.

Samplers write their health documents (``sampler/<i>``: fetched, errors, failing sources, the
request counters) with their commits, about twice a second, and the daemon its own
(``daemon``: its heartbeat, its samplers, its listings' requests) and the history rows the
ingest rate is measured over; they are read here, one meaning each (`FAILING_AFTER_S` once).

Every remote request of a source passes through its request gate (`requests`) or its
listing (`paging`), which count it in a `RequestStats`, per source and per process:

* ``gets``: object reads the remote received (throttled ones included: the remote answered
  them; a tar shard read in several requests counts each; one that never left the process,
  such as a refused connection, not at all);
* ``heads``: object or bucket metadata requests (a brace pattern's first shard, the region of
  a bucket read with obstore);
* ``lists``: listing pages asked for (the daemon's listings and re-listings);
* ``bytes``: bytes received in object bodies (egress, as the remote bills it);
* ``throttled``: answers of 503 SlowDown or 429; ``timeouts``; ``errors``: other failures;
* ``retries``: requests sent again for the same object (after throttling or a transient error);
* ``concurrency``: requests the sampler allows in flight now (``auto`` moves it), and
  ``pace``: requests per second it keeps to after throttling (0: not paced).

The counters start from what the document held, so they go on across restarts. Summed
(`request_totals`), they are what ``status`` (``requests``), the Prometheus metrics
(``epochcache_remote_*``) and a run's per-epoch log show. A process killed with ``kill -9``
loses the counts of its last half second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..paths import heartbeat_alive
from ..units import format_count, format_size

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

#: A source none of whose reads succeeded for this long is *failing*: the samplers log it and
#: write it to their health document, status and the metrics report it (one value for all).
FAILING_AFTER_S = 60.0


#: The counters (monotonic), in the order status shows them.
COUNTERS = ("gets", "heads", "lists", "bytes", "throttled", "timeouts", "errors", "retries")
#: The gauges (the value now; summed over processes).
GAUGES = ("concurrency", "pace")


class RequestStats:
    """The request counters of one source in one process (thread-safe).

    Args:
        saved: counters saved by an earlier process (they go on from there).
    """

    def __init__(self, saved: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = dict.fromkeys(COUNTERS + GAUGES, 0)
        for name in COUNTERS:
            try:
                self.values[name] = int((saved or {}).get(name, 0))
            except (TypeError, ValueError):
                pass  # a document of another version: start from 0

    def add(self, **counts: int) -> None:
        """Add to counters, e.g. ``add(gets=1, bytes=65536)``."""
        with self._lock:
            for name, count in counts.items():
                self.values[name] += count

    def set(self, **gauges: float) -> None:
        with self._lock:
            self.values.update(gauges)

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)

    def __repr__(self) -> str:
        return f"RequestStats({self.as_dict()})"


def source_label(name: str) -> str:
    """The key a source's counters are kept under: its ``sources:`` name, or ``source`` for
    the single ``source:`` section."""
    return name or "source"


def saved_requests(doc: Mapping[str, Any] | None, label: str) -> Mapping[str, Any] | None:
    """A source's counters in a saved health or daemon document (None when absent)."""
    requests = (doc or {}).get("requests")
    if not isinstance(requests, Mapping):
        return None
    found = requests.get(label)
    return found if isinstance(found, Mapping) else None


def daemon_health(doc: dict[str, Any] | None, now: float | None = None) -> dict[str, Any] | None:
    """The daemon's state document plus whether it is alive (pid on this host, fresh heartbeat)."""
    if doc is None:
        return None
    now = time.time() if now is None else now
    age = now - float(doc.get("heartbeat", 0))
    return {**doc, "alive": heartbeat_alive(doc, age), "heartbeat_age_s": round(age, 1)}


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
            into = totals.setdefault(str(label), dict.fromkeys(COUNTERS + GAUGES, 0))
            for name in COUNTERS + (GAUGES if gauges else ()):
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
        row = {name: values.get(name, 0) - start.get(name, 0) for name in COUNTERS}
        row.update({name: values.get(name, 0) for name in (*GAUGES, "samplers")})
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
