#!/usr/bin/env python
"""The seed's workload: 1 MiB incompressible float32 arrays to the training loop while the daemon
turns the same cache over.

    .venv/bin/python scripts/bench_seed.py [--rounds 3] [--quick] [--json bench_seed.json]

A ``file://`` dataset of 1 MiB ``.npy`` float32 arrays of random bits (incompressible: stored
raw), larger than the cache; the daemon (``ec.Daemon``, one sampler process, a bandwidth limit)
fills the cache and then keeps turning it over (evicting the oldest samples, progressive release)
while, in each round, ``cache.epochs()`` reads it in process (its default without a transform)
and with ``num_workers=2``, A B B A (each figure of a round is the mean of its two runs). Each
row is MB/s of arrays delivered to the loop (timed over at least ``--seconds`` and two epochs
after a warm-up one, epoch boundaries included), with the daemon's own ingest rate over the
same stretch; next to them, measured in the same round in the trainer process, memcpy's
bandwidth (64 MiB copies between two warm buffers for half a second, scripts/machine.py) and a core probe.

Targets (issue 35): with 2 workers >= 600 MB/s while ingesting; in process >= 0.5 of memcpy
(per-round ratios; a figure whose rounds range wider than 2x is reported as that range).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from loader_rows import ours_rate, unstable, verdict
from machine import core_probe, memcpy_gbps

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epochcache as ec

MIB = 1 << 20
FLOATS = MIB // 4


def write_dataset(root: Path, count: int) -> None:
    """``count`` 1 MiB float32 .npy arrays of random bits (NaNs included: bits, not values)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        array = rng.integers(0, 2**32, FLOATS, dtype=np.uint32).view(np.float32)
        np.save(root / f"{i:06d}.npy", array)


def _row(cache: ec.Cache, seconds: float, workers: int) -> dict[str, float]:
    """MB/s of arrays to the loop and of the daemon's ingest, over the same stretch."""
    before, started = cache.counters().inserted, time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = ours_rate(cache, seconds, num_workers=workers)
    elapsed = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    ingest = (cache.counters().inserted - before) * MIB / elapsed
    return {"mb_s": got["rate"] * MIB / 1e6, "cpu_us": got["cpu_us"], "ingest_mb_s": ingest / 1e6,
            "faults_per_s": faults / elapsed}


def run(rounds: int, quick: bool, seconds: float) -> dict[str, Any]:
    objects, capacity = (600, 384 * MIB) if quick else (3000, 2048 * MIB)
    bandwidth = 300 * 10**6
    root = Path(tempfile.mkdtemp(prefix="bench-seed-", dir=os.environ.get("EPOCHCACHE_BENCH_DIR")))
    result: dict[str, Any] = {"objects": objects, "capacity": capacity,
                              "bandwidth_limit": bandwidth, "rounds": [], "machine": []}
    try:
        print(f"writing {objects} arrays of 1 MiB ...", flush=True)
        write_dataset(root / "data", objects)
        config = {
            "source": {"url": f"file://{root / 'data'}", "pattern": "*.npy"},
            "cache": {"dir": str(root / "cache"), "capacity": capacity, "sync": False},
            "sampler": {"processes": 1, "bandwidth_limit": bandwidth},
        }
        with ec.Daemon(config):
            cache = ec.Cache(root / "cache")
            deadline = time.monotonic() + 600
            while cache.counters().bytes < 0.95 * capacity:
                if time.monotonic() > deadline:
                    raise RuntimeError("the cache did not fill in 600 s")
                time.sleep(0.2)
            print(f"cache full ({cache.counters().bytes / MIB:.0f} MiB); measuring while the "
                  "daemon turns it over ...", flush=True)
            for rnd in range(rounds):
                probe = core_probe()
                result["machine"].append(probe)
                order = [0, 2, 2, 0] if rnd % 2 == 0 else [2, 0, 0, 2]
                runs: dict[int, list[dict[str, float]]] = {0: [], 2: []}
                memcpy = [memcpy_gbps()]
                for workers in order:
                    runs[workers].append(_row(cache, seconds, workers))
                memcpy.append(memcpy_gbps())
                this = {f"w{w}_{key}": float(np.mean([r[key] for r in got]))
                        for w, got in runs.items() for key in got[0]}
                this["memcpy_gb_s"] = float(np.mean(memcpy))
                result["rounds"].append(this)
                print(f"round {rnd + 1}/{rounds}: in process {this['w0_mb_s']:,.0f} MB/s, "
                      f"2 workers {this['w2_mb_s']:,.0f} MB/s, memcpy "
                      f"{this['memcpy_gb_s']:.1f} GB/s, ingest {this['w0_ingest_mb_s']:.0f} / "
                      f"{this['w2_ingest_mb_s']:.0f} MB/s (cores free {probe['cores_free']})",
                      flush=True)
            evicted = cache.counters().evicted
            cache.close()
        result["evicted"] = evicted
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["targets"] = targets(result["rounds"])
    return result


def targets(rounds: list[dict[str, float]]) -> list[dict[str, Any]]:
    checks = (("2 workers while ingesting, MB/s", [r["w2_mb_s"] for r in rounds], 600.0),
              ("in process / memcpy", [r["w0_mb_s"] / (r["memcpy_gb_s"] * 1e3) for r in rounds],
               0.5))
    return [{"target": label, **verdict(values, least)} for label, values, least in checks]


def report(result: dict[str, Any]) -> None:
    rounds = result["rounds"]

    def cell(key: str, digits: int = 0, scale: float = 1.0) -> str:
        values = [r[key] * scale for r in rounds]
        if unstable(values):
            return f"unstable: {min(values):,.{digits}f}-{max(values):,.{digits}f}"
        return (f"{float(np.median(values)):,.{digits}f} "
                f"[{min(values):,.{digits}f}-{max(values):,.{digits}f}]")

    print(f"\n1 MiB float32 arrays, cache {result['capacity'] // MIB} MiB over "
          f"{result['objects']} objects, daemon limited to {result['bandwidth_limit'] / 1e6:.0f} "
          f"MB/s ({result['evicted']} samples evicted in all); median [range] of "
          f"{len(rounds)} rounds")
    print(f"  in process:  {cell('w0_mb_s')} MB/s  (CPU {cell('w0_cpu_us')} us per sample; "
          f"daemon ingest {cell('w0_ingest_mb_s')} MB/s; page faults in the trainer "
          f"{cell('w0_faults_per_s')}/s)")
    print(f"  2 workers:   {cell('w2_mb_s')} MB/s  (CPU {cell('w2_cpu_us')} us per sample; "
          f"daemon ingest {cell('w2_ingest_mb_s')} MB/s)")
    print(f"  memcpy:      {cell('memcpy_gb_s', 1)} GB/s")
    free = ", ".join(f"{p['cores_free']:.2f}" for p in result["machine"])
    print(f"  cores free per round (core probe): {free} of {result['machine'][0]['cores']}")
    print("targets:")
    for target in result["targets"]:
        print(f"  {target['target']}: {target['median']:,.2f} [{target['range'][0]:,.2f}-"
              f"{target['range'][1]:,.2f}], at least {target['at_least']}: {target['verdict']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="at least this long per row")
    parser.add_argument("--quick", action="store_true", help="a smaller dataset and cache")
    parser.add_argument("--json", default="bench_seed.json")
    args = parser.parse_args()
    result = run(args.rounds, args.quick, args.seconds)
    report(result)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
