"""What coverage and manifests cost: the write path's origin rows, and an epoch's end.

* **write path**: ``put_many`` of pre-framed records in commits of ``--batch`` samples (what a
  sampler's committer does), with and without origins given (a row of keys is written either
  way), alternating, best of ``--repeat``, ``sync: false`` so that no fsync hides a cost. Run it
  on a checkout from before origins too (``PYTHONPATH=/path/to/old --write-only``: the same
  put without any row) for the row's whole cost;
* **tagger**: a sampler's per-batch origins (``OriginTagger.origins``) per sample;
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
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# No sys.path insert: PYTHONPATH chooses the checkout measured (the venv's is the default).
from epochcache import Cache

try:
    from epochcache.store.origins import Origin
except ImportError:  # a checkout from before origins (PYTHONPATH=...): the write path only
    Origin = None  # type: ignore[assignment,misc]


def _write_path(root: Path, size: int, count: int, batch: int, repeat: int) -> dict[str, Any]:
    """Seconds per sample of put_many with and without origins (best of ``repeat``)."""
    payloads = [os.urandom(size) for _ in range(64)]
    best: dict[str, float] = {}
    modes = ("without", "with") if Origin is not None else ("without",)
    for round_ in range(repeat):
        for mode in modes:
            path = root / f"w-{mode}-{round_}"
            cache = Cache(path, capacity=size * count * 4, sync=False, compression="none")
            keys = [f"train/sample-{i:08d}.bin" for i in range(count)]
            records = [(key, cache.writer.encode(key, payloads[i % 64])) for i, key in enumerate(keys)]
            origins = {key: Origin(0, i) for i, key in enumerate(keys)} if mode == "with" else None
            parts = [(records[lo: lo + batch], None if origins is None else
                      {k: origins[k] for k, _ in records[lo: lo + batch]})
                     for lo in range(0, count, batch)]
            started = time.perf_counter()
            for part, given in parts:
                if given is None:
                    cache.put_many(part, encoded=True)
                else:
                    cache.put_many(part, encoded=True, origins=given)
            seconds = time.perf_counter() - started
            cache.close()
            shutil.rmtree(path)
            best[mode] = min(best.get(mode, float("inf")), seconds)
    per = {mode: seconds / count * 1e6 for mode, seconds in best.items()}
    row: dict[str, Any] = {"size": size, "samples": count, "batch": batch,
                           "us_per_sample_without": round(per["without"], 2)}
    if "with" in per:
        row.update(us_per_sample_with=round(per["with"], 2),
                   overhead_us_per_sample=round(per["with"] - per["without"], 2))
    return row


def _tagger(root: Path, count: int, batch: int, repeat: int) -> dict[str, Any]:
    """Seconds per sample of a sampler's OriginTagger.origins (a batch's dict of origins), on
    a stand-in feed of a listing of ``count`` keys (the tagger reads only these fields)."""
    from types import SimpleNamespace

    from epochcache.ingest.layouts import KeyTable, SampleRef, SourceSpec
    from epochcache.ingest.lineage import OriginTagger

    keys = [f"train/sample-{i:08d}.bin" for i in range(count)]
    table = KeyTable.from_refs([SampleRef(key) for key in keys])
    source = SimpleNamespace(spec=SourceSpec(url="file:///bench"), url="file:///bench",
                             unit="sample")
    feed = SimpleNamespace(name="", generation="g", table=table, gone=set(), complete=True,
                           source=source, cache_key=lambda key: key)
    cache = Cache(root / "tagger", capacity="1GiB", sync=False)
    tagger = OriginTagger(cache, (0, 1))
    payload = b"x"
    batches = [([SampleRef(k) for k in keys[lo: lo + batch]], list(range(lo, lo + batch)))
               for lo in range(0, count, batch)]
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for refs, indices in batches:
            tagger.origins(feed, refs, indices, [(ref, payload) for ref in refs], "g")  # type: ignore[arg-type]
        best = min(best, time.perf_counter() - started)
    cache.close()
    return {"samples": count, "batch": batch, "us_per_sample": round(best / count * 1e6, 2)}


def _epoch_end(root: Path, samples: int, batch: int) -> dict[str, Any]:
    from epochcache.coverage.manifests import ManifestWriter, manifest_path
    from epochcache.store.origins import read_origins, register_listing

    cache = Cache(root / "epoch", capacity=64 * samples * 4, sync=False, compression="none")
    lid = register_listing(cache.env, {
        "source": "", "fingerprint": "bench", "generation": "g", "url": "file:///bench",
        "unit": "sample", "listed": samples, "gone": 0, "complete": True, "node_rank": 0,
        "num_nodes": 1})
    started = time.perf_counter()
    chunk = batch  # one origin row per commit of a sampler's size, as a daemon writes them
    for lo in range(0, samples, chunk):
        keys = [f"train/sample-{i:08d}.bin" for i in range(lo, min(samples, lo + chunk))]
        cache.put_many([(k, b"x" * 16) for k in keys],
                       origins={k: Origin(lid, lo + j) for j, k in enumerate(keys)})
    fill_s = time.perf_counter() - started
    seqs = np.random.default_rng(0).permutation(np.arange(samples, dtype=np.uint64))
    out: dict[str, Any] = {"samples": samples, "fill_s": round(fill_s, 2)}
    started = time.perf_counter()
    with cache.env.read() as txn:
        read_origins(txn, cache.env.dbs, seqs)
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
    parser.add_argument("--write-only", action="store_true", help="the write path only")
    parser.add_argument("--out", default="bench_ledger.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    try:
        results: dict[str, Any] = {"write_path": []}
        for size in (1024, 64 * 1024):
            count = args.write_samples if size < 65536 else args.write_samples // 5
            row = _write_path(root, size, count, args.batch, args.repeat)
            print(json.dumps(row), flush=True)
            results["write_path"].append(row)
        if Origin is not None and not args.write_only:
            results["tagger"] = _tagger(root, args.write_samples, args.batch, args.repeat)
            print(json.dumps(results["tagger"]), flush=True)
            results["epoch_end"] = _epoch_end(root, args.samples, args.batch)
            print(json.dumps(results["epoch_end"]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
