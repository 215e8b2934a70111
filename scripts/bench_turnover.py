"""Turnover of a full cache: whole-snapshot leases (before) against progressive release (now).

    .venv/bin/python scripts/bench_turnover.py [--epochs 8] [--headroom 0.1,0.02] [--quick]

Both sides run in one invocation, each on a fresh cache that the real sampler daemon
(``ec.Daemon``) fills from a ``file://`` dataset at a limited bandwidth, slower than training
reads, while ``cache.epochs()`` trains at a fixed pace (a sleep per batch stands for the step).
For every epoch once the cache is full it prints:

* wait: the fraction of the epoch the samplers waited for leases to free space (target < 5%);
* new: samples of the epoch's snapshot that the previous snapshot did not have, against
  0.9 x min(ingest rate x epoch time, capacity) (target: at least that);
* the most stored bytes seen (sampled every 20 ms) against capacity + headroom, and the data
  file against its bound (twice capacity + headroom, see docs/guide/cache.md).

Then two costs of progressive release on a large cache, in process:

* commit: a put_many that must evict, with a 1M-sample lease half consumed, against the same
  with no lease at all (median of 200 commits of 64 samples);
* snapshot: taking a snapshot of 1M samples with gaps (after progressive eviction), against
  a contiguous one.

Results also go to a JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import epochcache as ec
from epochcache.demo import write_demo_data
from epochcache.store.env import map_bound
from epochcache.store.reads import write_part

SAMPLE_BYTES = 16 * 1024


def _wait_fraction(cache: ec.Cache, start: dict[str, float], elapsed: float) -> float:
    now = {name: float(doc.get("lease_wait_s", 0.0))
           for name, doc in cache.tables.states("sampler/").items()}
    waited = [now[name] - start.get(name, 0.0) for name in now]
    return min(1.0, sum(waited) / max(1, len(waited)) / elapsed) if waited else 0.0


def _waits(cache: ec.Cache) -> dict[str, float]:
    return {name: float(doc.get("lease_wait_s", 0.0))
            for name, doc in cache.tables.states("sampler/").items()}


class _Watch(threading.Thread):
    """Samples stored bytes and the data file's size every 20 ms."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path, self.stop = path, threading.Event()
        self.most_bytes = self.most_file = 0

    def run(self) -> None:
        cache = ec.Cache(self.path, readonly=True)
        try:
            while not self.stop.wait(0.02):
                self.most_bytes = max(self.most_bytes, cache.counters().bytes)
                self.most_file = max(self.most_file, cache.file_bytes())
        finally:
            cache.close()


def run_side(root: Path, data_url: str, release: str, *, headroom: float, capacity: int,
             bandwidth: int, epochs: int, batch: int, step_s: float) -> dict[str, Any]:
    cache_dir = root / f"cache-{release}-{headroom}"
    config = {
        "source": {"url": data_url, "pattern": "*.npy"},
        "cache": {"dir": str(cache_dir), "capacity": capacity, "headroom": headroom,
                  "sync": False},
        "sampler": {"processes": 2, "concurrency": 8, "bandwidth_limit": bandwidth,
                    "batch_size": 16},
    }
    rows: list[dict[str, Any]] = []
    with ec.Daemon(config):
        cache = ec.Cache(cache_dir)
        # Full first: turnover is what happens once capacity is reached.
        deadline = time.monotonic() + 300
        while cache.counters().bytes < 0.98 * capacity:
            if time.monotonic() > deadline:
                raise RuntimeError("the cache did not fill in 300 s")
            time.sleep(0.1)
        watch = _Watch(str(cache_dir))
        watch.start()
        newest = -1
        for epoch, loader in cache.epochs(epochs + 1, batch_size=batch, release=release,
                                          stall_s=None):
            waits, started = _waits(cache), time.monotonic()
            for _batch in loader:
                time.sleep(step_s)
            elapsed = time.monotonic() - started
            seqs = loader.seqs
            new = int(np.count_nonzero(seqs > newest)) if newest >= 0 else len(seqs)
            newest = int(seqs.max()) if len(seqs) else newest
            if epoch == 0:
                continue  # its snapshot was the fill's, not a turnover
            ingest_rate = bandwidth / SAMPLE_BYTES  # samples/s the samplers could bring
            samples_cap = capacity // SAMPLE_BYTES
            target = 0.9 * min(ingest_rate * elapsed, samples_cap)
            rows.append({"epoch": epoch, "seconds": round(elapsed, 2),
                         "wait": round(_wait_fraction(cache, waits, elapsed), 4),
                         "new": new, "new_target": int(target),
                         "snapshot": len(seqs)})
        watch.stop.set()
        watch.join()
        limit = cache.capacity_bytes + cache.headroom_bytes
        result = {"release": release, "headroom": headroom, "epochs": rows,
                  "most_bytes": watch.most_bytes, "limit_bytes": limit,
                  "most_file": watch.most_file, "file_bound": map_bound(limit)}
        cache.close()
    shutil.rmtree(cache_dir, ignore_errors=True)
    return result


def commit_latency(root: Path, n: int) -> dict[str, float]:
    """Median put_many latency (64 samples, each evicting one) with a plan lease of ``n``
    samples half consumed, and with no lease."""
    record = 64
    value = b"x" * record
    out: dict[str, float] = {}
    for case in ("no lease", "plan lease half read"):
        path = root / f"commit-{case.replace(' ', '-')}"
        cache = ec.Cache(path, n * 1024, headroom=0.0, sync=False)
        for start in range(0, n, 50_000):
            cache.put_many([(f"k{i}", value) for i in range(start, min(n, start + 50_000))])
        full = cache.counters().bytes
        cache.close()
        cache = ec.Cache(path, full, headroom=0.0, sync=False)  # full: every commit evicts
        snap = None
        if case != "no lease":
            snap = cache.snapshot(plan_parts=1)
            order = np.random.default_rng(0).permutation(snap.seqs)
            write_part(cache.path, snap.lease_id, 0, [order])
            from epochcache.store.reads import Releaser

            Releaser(cache.path, snap.lease_id, 0, 0).release(n // 2)
        times, first = [], 0.0
        for i in range(201):
            items = [(f"new{i}-{j}", value) for j in range(64)]
            t0 = time.perf_counter()
            cache.put_many(items)
            took = time.perf_counter() - t0
            if i == 0:
                first = took  # includes loading the plan, once per process
            else:
                times.append(took)
        out[case] = statistics.median(times) * 1e3
        out[case + " (first)"] = first * 1e3
        out[case + " evicted"] = cache.counters().evicted
        if snap is not None:
            snap.release()
        cache.close()
        shutil.rmtree(path, ignore_errors=True)
    return out


def snapshot_time(root: Path, n: int) -> dict[str, float]:
    """Seconds to take a snapshot of ``n`` samples, contiguous and with every other one gone."""
    out: dict[str, float] = {}
    path = root / "snap"
    cache = ec.Cache(path, n * 200, headroom=0.0, sync=False)
    for start in range(0, n, 100_000):
        cache.put_many([(f"k{i}", b"v") for i in range(start, min(n, start + 100_000))])
    t0 = time.perf_counter()
    cache.snapshot().release()
    out["contiguous"] = time.perf_counter() - t0
    # Progressive release leaves gaps: release every other sample of a plan lease and evict.
    snap = cache.snapshot(plan_parts=1)
    half = snap.seqs[::2]
    write_part(cache.path, snap.lease_id, 0, [np.concatenate([half, snap.seqs[1::2]])])
    from epochcache.store.reads import Releaser

    Releaser(cache.path, snap.lease_id, 0, 0).release(len(half))
    cache.evict(cache.counters().bytes // 2)
    snap.release()
    t0 = time.perf_counter()
    with cache.snapshot() as gapped:
        out["with gaps"] = time.perf_counter() - t0
        out["samples with gaps"] = len(gapped)
    cache.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--headroom", default="0.1",
                        help="comma-separated headrooms to run the progressive side with")
    parser.add_argument("--large", type=int, default=1_000_000,
                        help="samples of the commit and snapshot measurements")
    parser.add_argument("--quick", action="store_true", help="fewer epochs, 100k samples")
    parser.add_argument("--out", default="bench-turnover.json")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.large = 3, 100_000
    capacity = 1000 * SAMPLE_BYTES  # ~1000 samples
    bandwidth = 400 * SAMPLE_BYTES  # ~400 samples/s: slower than the reads below
    batch, step_s = 32, 0.04  # ~800 samples/s read: an epoch of ~1.3 s
    root = Path(tempfile.mkdtemp(prefix="ec-turnover-"))
    results: dict[str, Any] = {"sides": []}
    try:
        data = root / "data"
        write_demo_data(data.as_uri(), 20_000, "files", sample_bytes=SAMPLE_BYTES)
        sides = [("epoch", 0.1)] + [("progressive", float(h)) for h in args.headroom.split(",")]
        for release, headroom in sides:
            print(f"turnover: release={release} headroom={headroom} ...", flush=True)
            results["sides"].append(run_side(
                root, data.as_uri(), release, headroom=headroom, capacity=capacity,
                bandwidth=bandwidth, epochs=args.epochs, batch=batch, step_s=step_s))
        print("commit latency ...", flush=True)
        results["commit_ms"] = commit_latency(root, args.large)
        print("snapshot time ...", flush=True)
        results["snapshot_s"] = snapshot_time(root, args.large)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results, args.large)


def report(results: dict[str, Any], large: int) -> None:
    out = io.StringIO()
    out.write(f"{'side':<28}{'wait (<5%)':>12}{'new / target':>18}{'epoch s':>9}"
              f"{'most bytes / limit':>20}{'file / bound':>14}\n")
    for side in results["sides"]:
        name = f"{side['release']}, headroom {side['headroom']}"
        rows = side["epochs"]
        waits = [row["wait"] for row in rows]
        ratios = [row["new"] / max(1, row["new_target"]) for row in rows]
        out.write(f"{name:<28}{100 * statistics.median(waits):>10.1f}% "
                  f"{statistics.median([r['new'] for r in rows]):>8.0f} / "
                  f"{statistics.median([r['new_target'] for r in rows]):<7.0f}"
                  f"{statistics.median([r['seconds'] for r in rows]):>9.2f}"
                  f"{side['most_bytes'] / side['limit_bytes']:>20.3f}"
                  f"{side['most_file'] / side['file_bound']:>14.3f}\n")
        out.write(f"{'':<28}worst wait {100 * max(waits):.1f}%, "
                  f"least new/target {min(ratios):.2f} (per epoch: "
                  + ", ".join(f"{row['new']}/{row['new_target']}" for row in rows) + ")\n")
    commit = results["commit_ms"]
    out.write(f"commit of 64 evicting samples, {large:,} cached: no lease "
              f"{commit['no lease']:.2f} ms, plan lease half read "
              f"{commit['plan lease half read']:.2f} ms (first commit, loading the plan: "
              f"{commit['plan lease half read (first)']:.0f} ms; "
              f"{commit['plan lease half read evicted']:,} evicted)\n")
    snap = results["snapshot_s"]
    out.write(f"snapshot of {large:,} samples: contiguous {snap['contiguous'] * 1e3:.0f} ms, "
              f"with gaps ({snap['samples with gaps']:,} left) {snap['with gaps'] * 1e3:.0f} ms"
              " (target < 1 s)\n")
    print(out.getvalue(), end="")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
