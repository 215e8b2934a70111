"""What coverage and manifests cost: the write path's origin rows, and an epoch's end.

* **write path**: ``put_many`` of pre-framed records in commits of ``--batch`` samples (what a
  sampler's committer does), with and without origins, alternating, best of ``--repeat``: the
  origin row's cost per sample (``sync: false``, so the fsync does not hide it);
* **epoch end** at ``--samples`` samples (default one million) of one listing: reading their
  origins, ``record_trained`` (the coverage ledger's update), ``cache.coverage()`` (what
  ``status`` reads), and writing the epoch's manifest (``ManifestWriter``), with its size per
  sample.

Usage::

    .venv/bin/python scripts/bench_ledger.py [--samples 1000000] [--out bench_ledger.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epochcache import Cache  # noqa: E402
from epochcache.store.listings import register_listing  # noqa: E402
from epochcache.store.manifests import ManifestWriter, manifest_path  # noqa: E402
from epochcache.store.origins import Origin, read_origins  # noqa: E402


def _write_path(root: Path, size: int, count: int, batch: int, repeat: int) -> dict[str, Any]:
    """Seconds per sample of put_many with and without origins (best of ``repeat``)."""
    payloads = [os.urandom(size) for _ in range(64)]
    best: dict[str, float] = {}
    for round_ in range(repeat):
        for mode in ("without", "with"):
            path = root / f"w-{mode}-{round_}"
            cache = Cache(path, capacity=size * count * 4, sync=False, compression="none")
            keys = [f"train/sample-{i:08d}.bin" for i in range(count)]
            records = [(key, cache.encode(key, payloads[i % 64])) for i, key in enumerate(keys)]
            origins = {key: Origin(0, i) for i, key in enumerate(keys)} if mode == "with" else None
            started = time.perf_counter()
            for lo in range(0, count, batch):
                part = records[lo: lo + batch]
                cache.put_many(part, encoded=True,
                               origins=None if origins is None else
                               {k: origins[k] for k, _ in part})
            seconds = time.perf_counter() - started
            cache.close()
            shutil.rmtree(path)
            best[mode] = min(best.get(mode, float("inf")), seconds)
    per = {mode: seconds / count * 1e6 for mode, seconds in best.items()}
    return {"size": size, "samples": count, "batch": batch,
            "us_per_sample_without": round(per["without"], 2),
            "us_per_sample_with": round(per["with"], 2),
            "overhead_us_per_sample": round(per["with"] - per["without"], 2),
            "overhead_ratio": round(per["with"] / per["without"] - 1, 4)}


def _epoch_end(root: Path, samples: int) -> dict[str, Any]:
    cache = Cache(root / "epoch", capacity=64 * samples * 4, sync=False, compression="none")
    lid = register_listing(cache.store, {
        "source": "", "fingerprint": "bench", "generation": "g", "url": "file:///bench",
        "unit": "sample", "listed": samples, "gone": 0, "complete": True, "node_rank": 0,
        "num_nodes": 1})
    started = time.perf_counter()
    chunk = 10_000
    for lo in range(0, samples, chunk):
        keys = [f"train/sample-{i:08d}.bin" for i in range(lo, min(samples, lo + chunk))]
        cache.put_many([(k, b"x" * 16) for k in keys],
                       origins={k: Origin(lid, lo + j) for j, k in enumerate(keys)})
    fill_s = time.perf_counter() - started
    seqs = np.random.default_rng(0).permutation(np.arange(samples, dtype=np.uint64))
    out: dict[str, Any] = {"samples": samples, "fill_s": round(fill_s, 2)}
    started = time.perf_counter()
    with cache.store.read() as txn:
        read_origins(txn, cache.dbs, seqs)
    out["read_origins_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    cache.record_trained(seqs, epoch=0)
    out["record_trained_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    cache.record_trained(seqs, epoch=1)
    out["record_trained_again_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    report = cache.coverage()
    out["coverage_s"] = round(time.perf_counter() - started, 4)
    assert report["sources"][0]["covered"] == samples
    writer = ManifestWriter(cache, root / "run", epoch=0, rank=0, lease="bench")
    started = time.perf_counter()
    writer.write(seqs, samples)
    out["manifest_write_s"] = round(time.perf_counter() - started, 3)
    size = manifest_path(root / "run", 0, 0).stat().st_size
    out["manifest_bytes_per_sample"] = round(size / samples, 2)
    ledger = next((root / "epoch" / "coverage").glob("*.ledger")).stat().st_size
    out["ledger_bytes_per_sample"] = round(ledger / samples, 3)
    cache.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--write-samples", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="bench_ledger.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    try:
        results: dict[str, Any] = {"write_path": []}
        for size in (1024, 64 * 1024):
            row = _write_path(root, size, args.write_samples, args.batch, args.repeat)
            print(json.dumps(row), flush=True)
            results["write_path"].append(row)
        results["epoch_end"] = _epoch_end(root, args.samples)
        print(json.dumps(results["epoch_end"]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
