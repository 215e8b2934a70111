"""What training saw of each source: the coverage layer, and its report.

Per listed key, how many epochs trained on it (the per-source ``ledger``), what a checkpoint
covers, counted once it is written (``staged``), what an epoch trained, in order (the epoch
``manifests``, which a run writes with its coverage as it goes). Above the store, below
``ingest``, ``data``, ``run`` and the face: it imports the store and base modules only, never
fsspec or torch.

The report, `coverage` (``cache.coverage()``, what ``status`` and the plot show): how much of
each source training has seen, how fast, how long to go.
Read from the ledgers' headers (`ledger`): no count array is loaded, so ``status``, its
``--json`` and a metrics scrape pay a few small file reads. Per source:

* ``samples``: what its listing holds (``estimated`` for a ``tar`` source until every shard was
  trained: shards are listed, their samples counted when fetched), ``gone`` the keys the last
  re-list did not find;
* ``covered``: distinct samples ever in a trained part of an epoch, ``fraction`` of ``samples``;
  ``share``: this node's part of the source (each node samples a partition: ``samples /
  num_nodes``), ``share_fraction`` the fraction of it covered;
* ``histogram``: samples by the number of epochs they were trained in (``"0"``: never; buckets
  double from 4 on; ``"255+"``: the count saturates there);
* ``coverage_per_s`` and ``ingest_per_s``: the growth of ``covered`` and of the samples the
  cache ingested from the source, over the last `RATE_WINDOW_S` of updates;
  ``eta_s``: the time to have trained on every sample of this node's share once at the current
  ingest rate (sampling is without replacement per pass, so during the first pass every sample
  ingested is new), None while nothing is ingested;
* ``updates``: ledger updates so far (one per epoch and rank, and one per mid-epoch checkpoint).

``unattributed`` counts trained samples with no origin (cached by an older version, or put
through the Python API).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .ledger import Ledger, ledgers, read_unattributed

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

#: The updates the rates are measured over (seconds back from the last one).
RATE_WINDOW_S = 3600.0
#: Histogram buckets: (label, first count, last count).
BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3", 3, 3), ("4-7", 4, 7), ("8-15", 8, 15),
    ("16-31", 16, 31), ("32-63", 32, 63), ("64-127", 64, 127), ("128-254", 128, 254),
    ("255+", 255, 255),
)


def bucketed(histogram: list[int]) -> dict[str, int]:
    """A 256-entry histogram as `BUCKETS`."""
    return {label: int(sum(histogram[lo : hi + 1])) for label, lo, hi in BUCKETS}


def rates(updates: list[dict[str, Any]], window_s: float = RATE_WINDOW_S) -> tuple[float, float]:
    """``(coverage_per_s, ingest_per_s)`` over the updates of the last ``window_s``."""
    if len(updates) < 2:
        return 0.0, 0.0
    last = updates[-1]
    first = next((row for row in updates if last["time"] - row["time"] <= window_s), updates[-2])
    if first is last:
        first = updates[-2]
    dt = last["time"] - first["time"]
    if dt <= 0:
        return 0.0, 0.0
    covered = (last["covered"] - first["covered"]) / dt
    ingested = (last.get("ingested", 0) - first.get("ingested", 0)) / dt
    return max(0.0, covered), max(0.0, ingested)


def source_coverage(ledger: Ledger) -> dict[str, Any]:
    """One source's report (see the module docstring)."""
    header = ledger.header
    summary = header.get("summary") or {"samples": 0, "covered": 0, "estimated": False,
                                        "histogram": [0] * 256}
    samples, covered = int(summary["samples"]), int(summary["covered"])
    nodes = max(1, int(header.get("num_nodes") or 1))
    share = math.ceil(samples / nodes)
    updates = header.get("updates") or []
    coverage_per_s, ingest_per_s = rates(updates)
    remaining = max(0, share - covered)
    eta = None if ingest_per_s <= 0 else round(remaining / ingest_per_s, 1)
    return {
        "source": header.get("source") or "",
        "fingerprint": header.get("fingerprint"),
        "url": header.get("url"),
        "unit": header.get("unit"),
        "samples": samples,
        "estimated": bool(summary.get("estimated")),
        "gone": int(header.get("gone") or 0),
        "covered": covered,
        "fraction": round(covered / samples, 6) if samples else 0.0,
        "node_rank": int(header.get("node_rank") or 0),
        "num_nodes": nodes,
        "share": share,
        "share_fraction": round(min(1.0, covered / share), 6) if share else 0.0,
        "histogram": bucketed(list(summary["histogram"])),
        "coverage_per_s": round(coverage_per_s, 3),
        "ingest_per_s": round(ingest_per_s, 3),
        "eta_s": 0.0 if remaining == 0 and samples else eta,
        "updates": len(updates),
        "last_update": updates[-1]["time"] if updates else None,
        "generation": header.get("generation"),
        "previous": header.get("previous") or [],
    }


def coverage(cache: SampleStore | str) -> dict[str, Any]:
    """``{"sources": [per-source report, ...], "unattributed": n}`` for a cache (or its path)."""
    path = cache if isinstance(cache, str) else cache.path
    found = [source_coverage(ledger) for ledger in ledgers(path)]
    found.sort(key=lambda row: (row["source"], row["url"] or ""))
    return {"sources": found, "unattributed": read_unattributed(path)}


def history(cache_path: str) -> list[dict[str, Any]]:
    """Every source's updates (time, covered, samples, ...), each with its ``source`` name:
    what the plot draws."""
    rows: list[dict[str, Any]] = []
    for ledger in ledgers(cache_path):
        name = ledger.header.get("source") or ledger.header.get("url") or ""
        rows.extend({**row, "source": name} for row in ledger.header.get("updates") or [])
    rows.sort(key=lambda row: row["time"])
    return rows
