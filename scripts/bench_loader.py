#!/usr/bin/env python
"""Loader benchmarks for issue 4, side by side in one run; prints a table and writes JSON.

64 KiB random float32 samples (incompressible, stored raw), warm page cache:
  - epochs() default loader vs one-file-per-sample and plain-LMDB Datasets (in process and
    num_workers=2);
  - num_workers=2 with a CPU-heavy transform vs the same DataLoader over a no-I/O dataset;
  - dataset[i] vs raw LMDB get+copy;
  - epoch boundary gap / median batch gap, per worker start method;
  - worker RSS growth over 10 epochs; snapshot time with 1M tiny cached samples;
  - multi-field records {npy, cls} (the same arrays plus a label): epochs() vs the single-.npy
    rate, and vs WebDataset reading the same samples from local tar shards (in process with and
    without a DataLoader, and with 2 workers; batched in the pipeline, a fast .npy decoder).

The first three run as back-to-back pairs for five rounds; each ratio is the median of its
per-round ratios (these shared 2-core machines drift by up to 2x within minutes).

`--workers` runs only the num_workers sweep that chose epochs()' default (``num_workers=None``):
epochs() with 0, 1 and 2 workers, without a transform and with the heavy one, three rounds in
alternating order.

`--rows` runs only the loader rows at 1 KiB, 64 KiB and 1 MiB (epochs() in process and with 2
workers, against the floor, the no-I/O DataLoader and the peers), and `--ab COMMIT` the same rows
for COMMIT and this checkout side by side (scripts/loader_rows.py).

Usage: .venv/bin/python scripts/bench_loader.py [--samples 3000] [--json bench_loader.json]
       .venv/bin/python scripts/bench_loader.py --workers
       .venv/bin/python scripts/bench_loader.py --rows | --ab COMMIT [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Any

import lmdb
import numpy as np
import torch
from loader_rows import FileDataset, LmdbDataset, fast_npy, npy
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from epochcache import Cache
from epochcache.store.records import seq_key

FLOATS = 16384  # 64 KiB of float32
BATCH = 64
ROUNDS = 5
HEAVY = 3000  # samples per heavy-transform run (~1 s: shorter runs were too noisy)


def heavy(x: Any) -> torch.Tensor:
    """A CPU-heavy transform (~0.5 ms per sample), the same for every contender."""
    t = torch.as_tensor(x).reshape(128, 128).nan_to_num(0.0).clamp(-1, 1)
    for _ in range(6):
        t = torch.tanh(t @ t.T * 0.01)
    return t.reshape(-1)


class NoIODataset(Dataset[Any]):
    def __init__(self, n: int, transform: Any, x: np.ndarray | None = None) -> None:
        self.n, self.transform = n, transform
        # The cached samples' own values when given: a transform's cost depends on the data
        # (random bit patterns hold NaNs and denormals, which slow float arithmetic down).
        self.x = (np.random.default_rng(0).standard_normal((1, FLOATS)).astype(np.float32)
                  if x is None else x)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        x = self.x[i % len(self.x)]
        return self.transform(x) if self.transform else x.copy()


def _wds_sample(sample: dict[str, Any]) -> tuple[np.ndarray, int]:
    return fast_npy(sample["npy"], FLOATS), int(sample["cls"])


def _wds_batch(samples: list[tuple[np.ndarray, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = torch.from_numpy(np.stack([a for a, _ in samples]))
    return arrays, torch.tensor([c for _, c in samples])


def wds_loader(shards: list[str], workers: int | None, shuffle: int = 1000) -> Any:
    """WebDataset's recommended shape: decode and batch in the pipeline (in the workers), then
    a DataLoader with batch_size=None; ``workers=None`` iterates the pipeline directly."""
    import webdataset as wds

    pipeline = wds.WebDataset(shards, shardshuffle=False, empty_check=False)
    if shuffle:
        pipeline = pipeline.shuffle(shuffle)
    pipeline = pipeline.map(_wds_sample).batched(BATCH, collation_fn=_wds_batch)
    if workers is None:
        return pipeline
    return DataLoader(pipeline, batch_size=None, num_workers=workers,
                      persistent_workers=workers > 0)


def write_shards(root: str, blobs: list[bytes], per_shard: int = 300) -> list[str]:
    shards = []
    for start in range(0, len(blobs), per_shard):
        path = os.path.join(root, f"shard-{start // per_shard:04d}.tar")
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(len(blobs), start + per_shard)):
                for name, data in ((f"{i:07d}.npy", blobs[i]),
                                   (f"{i:07d}.cls", str(i % 1000).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards.append(path)
    return shards


def _count(batch: Any) -> int:
    return len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)


def rate(loader: Any, passes: int = 2) -> float:
    """Samples/s over ``passes`` full passes after a warm-up pass."""
    for _ in loader:
        pass
    n, t0 = 0, time.perf_counter()
    for _ in range(passes):
        for batch in loader:
            n += _count(batch)
    return n / (time.perf_counter() - t0)


def _store(cache: Any) -> Any:
    """The store layer of a Cache: the Cache itself (it is a SampleStore), or ``Cache._store``
    in the versions whose public Cache held one, which an A/B run may import."""
    return getattr(cache, "_store", cache)


def ours_rate(cache: Cache, epochs: int = 3, **kw: Any) -> float:
    n, t0 = 0, None
    for epoch, loader in cache.epochs(epochs + 1, batch_size=BATCH, **kw):
        for batch in loader:
            if epoch == 0:
                continue  # warm-up epoch (workers start, pages cached)
            if t0 is None:
                t0 = time.perf_counter()
            n += _count(batch)
    return n / (time.perf_counter() - (t0 or 0.0))


def bare_copy_rate(cache: Cache, seqs: np.ndarray) -> float:
    """The ceiling for any reader of this cache: per batch one read transaction, then per
    sample one LMDB get and one memcpy of the array into a reused buffer -- no checks, no
    DataLoader, nothing else."""
    env, db = _store(cache).env.lmdb_env, _store(cache).env.dbs[b"samples"]
    nbytes = FLOATS * 4
    out = memoryview(np.empty(BATCH * nbytes, np.uint8))
    keys = [seq_key(int(s)) for s in seqs]
    for _pass in range(2):  # a warm-up pass, then the timed one
        t0 = time.perf_counter()
        for start in range(0, len(keys), BATCH):
            with env.begin(buffers=True) as txn:
                pos = 0
                for k in keys[start : start + BATCH]:
                    record = txn.get(k, None, db)
                    out[pos : pos + nbytes] = record[len(record) - nbytes :]
                    pos += nbytes
    return len(keys) / (time.perf_counter() - t0)


def getitem_rate(cache: Cache, order: np.ndarray) -> float:
    with cache.dataset() as ds:
        for i in order:  # warm-up pass, as raw_get_rate does
            ds[int(i)]
        t0 = time.perf_counter()
        for i in order:
            ds[int(i)]
        return len(order) / (time.perf_counter() - t0)


def raw_get_rate(cache: Cache, keys: list[bytes]) -> float:
    """Raw LMDB get + copy of the same records, all in one read transaction."""
    env, db = _store(cache).env.lmdb_env, _store(cache).env.dbs[b"samples"]
    with env.begin(buffers=True) as txn:
        for _pass in range(2):  # a warm-up pass, then the timed one
            t0 = time.perf_counter()
            for k in keys:
                np.frombuffer(txn.get(k, db=db), dtype=np.uint8).copy()
    return len(keys) / (time.perf_counter() - t0)


def boundary(cache: Cache, epochs: int, samples: int, **kw: Any) -> dict[str, float]:
    stamps: list[list[float]] = []
    for _epoch, loader in cache.epochs(epochs, batch_size=BATCH, samples_per_epoch=samples, **kw):
        times = []
        for _batch in loader:
            times.append(time.perf_counter())
        stamps.append(times)
    gaps = np.concatenate([np.diff(t) for t in stamps])
    bounds = [stamps[k + 1][0] - stamps[k][-1] for k in range(len(stamps) - 1)]
    median = float(np.median(gaps))
    return {"median_gap_ms": median * 1e3, "boundary_ms": [b * 1e3 for b in bounds],
            "worst_ratio": max(bounds) / median,
            "worst_ratio_after_first": max(bounds[1:] or bounds) / median}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def rss_growth(cache: Cache) -> float:
    per_epoch = []
    for _epoch, loader in cache.epochs(10, batch_size=BATCH, num_workers=2, transform=_ident):
        for _batch in loader:
            pass
        it = getattr(loader.loader, "_iterator", None)
        per_epoch.append({w.pid: rss_kib(w.pid) for w in getattr(it, "_workers", [])})
    growth = [per_epoch[late][pid] / kib - 1 for early, late in ((1, 9), (2, 8))
              for pid, kib in per_epoch[early].items() if pid in per_epoch[late]]
    return max(growth) * 100


def _ident(x: Any) -> Any:
    return x


def snapshot_1m(root: str, n: int) -> float:
    cache = Cache(os.path.join(root, "tiny"), "1GiB", compression="none", sync=False)
    for start in range(0, n, 100_000):
        cache.put_many([(f"t{i}", b"x" * 16) for i in range(start, min(n, start + 100_000))])
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        snap = cache.snapshot(epoch=0)
        best = min(best, time.perf_counter() - t0)
        if len(snap) != n:
            raise RuntimeError(f"snapshot holds {len(snap)} samples, expected {n}")
        snap.release()
    return best


def workers_sweep(samples: int) -> dict[str, Any]:
    """epochs() samples/s by num_workers, without and with a CPU-heavy transform."""
    root = tempfile.mkdtemp(prefix="bench-workers-")
    try:
        rng = np.random.default_rng(0)
        cache = Cache(os.path.join(root, "cache"), "2GiB", sync=False)
        cache.put_many([(f"train/{i:07d}.npy",
                         npy(rng.integers(0, 2**32, FLOATS, dtype=np.uint32).view(np.float32)))
                        for i in range(samples)])
        runs = {f"{kind}_w{w}": (w, transform) for kind, transform in (("plain", None),
                                                                        ("heavy", heavy))
                for w in (0, 1, 2)}
        rounds: dict[str, list[float]] = {}
        for rnd in range(3):
            print(f"num_workers sweep: round {rnd + 1}/3 ...", flush=True)
            items = list(runs.items())
            if rnd % 2:
                items.reverse()
            for name, (w, transform) in items:
                heavy_kw = {"samples_per_epoch": HEAVY} if transform is not None else {}
                rounds.setdefault(name, []).append(ours_rate(
                    cache, epochs=1 if transform is not None else 3, num_workers=w,
                    transform=transform, **heavy_kw))
        cache.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "rounds": rounds}
    for name, values in rounds.items():
        result[name] = float(np.median(values))
    for kind in ("plain", "heavy"):
        for w in (1, 2):
            ratios = [a / b for a, b in zip(rounds[f"{kind}_w{w}"], rounds[f"{kind}_w0"])]
            result[f"{kind}_w{w}_vs_w0"] = float(np.median(ratios))
    print(f"{'contender':<34}{'median':>12}  vs 0 workers")
    for kind, label in (("plain", "no transform"), ("heavy", "heavy transform")):
        for w in (0, 1, 2):
            ratio = "" if w == 0 else f"{result[f'{kind}_w{w}_vs_w0']:.2f}x"
            print(f"{label + f', {w} workers':<34}{result[f'{kind}_w{w}']:>10,.0f}/s  {ratio}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--tiny", type=int, default=1_000_000)
    parser.add_argument("--json", default="bench_loader.json")
    parser.add_argument("--workers", action="store_true",
                        help="only the num_workers sweep behind epochs()' default")
    parser.add_argument("--rows", action="store_true",
                        help="only the loader rows, 1 KiB, 64 KiB and 1 MiB, against the floor, "
                             "the no-I/O DataLoader and the peers (scripts/loader_rows.py)")
    parser.add_argument("--ab", metavar="COMMIT",
                        help="the loader rows of COMMIT (A) and of this checkout (B) side by side")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --rows and --ab")
    parser.add_argument("--quick", action="store_true", help="--rows/--ab: fewer samples")
    parser.add_argument("--sizes", default="1024,65536,1048576",
                        help="--rows/--ab: sample sizes in bytes, comma-separated")
    args = parser.parse_args()
    if args.rows or args.ab:
        import loader_rows

        result = loader_rows.run(args.ab, rounds=args.rounds, quick=args.quick,
                                 sizes=tuple(int(size) for size in args.sizes.split(",")))
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        return
    if args.workers:
        result = workers_sweep(args.samples)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        return
    root = tempfile.mkdtemp(prefix="bench-loader-")
    r: dict[str, Any] = {"samples": args.samples, "sample_bytes": FLOATS * 4, "batch": BATCH,
                         "cpus": os.cpu_count()}
    try:
        rng = np.random.default_rng(0)
        blobs = [npy(rng.integers(0, 2**32, FLOATS, dtype=np.uint32).view(np.float32))
                 for _ in range(args.samples)]
        cache = Cache(os.path.join(root, "cache"), "2GiB", sync=False)
        cache.put_many([(f"train/{i:07d}.npy", b) for i, b in enumerate(blobs)])
        # The same arrays as WebDataset-style records {npy, cls}, and as tar shards.
        fields_cache = Cache(os.path.join(root, "fields"), "2GiB", sync=False)
        fields_cache.put_many([(f"shard-{i // 300:04d}.tar/{i:07d}",
                                {"npy": b, "cls": str(i % 1000).encode()})
                               for i, b in enumerate(blobs)])
        os.makedirs(os.path.join(root, "shards"))
        shards = write_shards(os.path.join(root, "shards"), blobs)
        files = []
        os.makedirs(os.path.join(root, "files"))
        for i, b in enumerate(blobs):
            files.append(os.path.join(root, "files", f"{i:07d}.npy"))
            with open(files[-1], "wb") as f:
                f.write(b)
        env = lmdb.open(os.path.join(root, "plain"), map_size=2 << 30)
        with env.begin(write=True) as txn:
            for i, b in enumerate(blobs):
                txn.put(b"%08d" % i, b)
        env.close()
        heavy_inputs = np.stack([np.load(io.BytesIO(b)) for b in blobs[:256]])
        del blobs
        n = args.samples
        plain = os.path.join(root, "plain")
        order = np.random.default_rng(1).permutation(n)
        with cache.dataset() as ds:
            keys = [seq_key(int(ds.seqs[i])) for i in order]
            seqs_shuffled = ds.seqs[order]
        # These shared machines drift by up to 2x within minutes, so the contenders of each
        # ratio run back to back, ROUNDS times over; a ratio is the median of its per-round
        # ratios (a paired comparison: slow drift hits both sides of a pair alike).
        rounds: dict[str, list[float]] = {}
        for rnd in range(ROUNDS):
            print(f"throughput, heavy transform, dataset[i]: round {rnd + 1}/{ROUNDS} ...",
                  flush=True)
            measure = {
                "ours_default": lambda: ours_rate(cache),
                "bare_copy": lambda: bare_copy_rate(cache, seqs_shuffled),
                "files_inproc": lambda: rate(DataLoader(FileDataset(files, FLOATS), BATCH, shuffle=True)),
                "lmdb_inproc": lambda: rate(DataLoader(LmdbDataset(plain, n, FLOATS), BATCH,
                                                       shuffle=True)),
                # Both sides start workers the platform's way (fork on Linux) and are timed
                # over two epochs after a warm-up one: a forked worker's first epoch in a
                # large process pays for copying its page tables, which is start-up, not
                # throughput.
                "heavy_ours_w2": lambda: ours_rate(cache, epochs=2, num_workers=2,
                                                   transform=heavy, samples_per_epoch=HEAVY),
                "heavy_noio_w2": lambda: rate(DataLoader(
                    NoIODataset(HEAVY, heavy, heavy_inputs), BATCH,
                    num_workers=2, persistent_workers=True), passes=2),
                "getitem": lambda: getitem_rate(cache, order),
                "raw_get_copy": lambda: raw_get_rate(cache, keys),
                "fields_ours": lambda: ours_rate(fields_cache, fields=("npy", "cls")),
                "fields_wds_inproc": lambda: rate(wds_loader(shards, 0)),
                "fields_wds_direct": lambda: rate(wds_loader(shards, None)),
                "fields_wds_unshuffled": lambda: rate(wds_loader(shards, None, shuffle=0)),
            }
            items = list(measure.items())
            if rnd % 2:
                items.reverse()  # neither side of a pair always runs first
            for name, fn in items:
                rounds.setdefault(name, []).append(fn())
        r["rounds"] = rounds
        for name, values in rounds.items():
            r[name] = float(np.median(values))
        # Workers are slow here (IPC-bound, see the issue): one run each is enough to show it.
        r["files_w2"] = rate(DataLoader(FileDataset(files, FLOATS), BATCH, shuffle=True, num_workers=2,
                                        persistent_workers=True))
        r["lmdb_w2"] = rate(DataLoader(LmdbDataset(plain, n, FLOATS), BATCH, shuffle=True, num_workers=2,
                                       persistent_workers=True))
        r["fields_wds_w2"] = rate(wds_loader(shards, 2))
        r["fields_vs_npy_rounds"] = [a / b for a, b in zip(rounds["fields_ours"],
                                                           rounds["ours_default"])]
        r["fields_vs_wds_rounds"] = [
            o / max(a, b, c, r["fields_wds_w2"]) for o, a, b, c in
            zip(rounds["fields_ours"], rounds["fields_wds_inproc"], rounds["fields_wds_direct"],
                rounds["fields_wds_unshuffled"])]
        r["ours_vs_best_peer_rounds"] = [
            o / max(f, lm, r["files_w2"], r["lmdb_w2"]) for o, f, lm in
            zip(rounds["ours_default"], rounds["files_inproc"], rounds["lmdb_inproc"])]
        r["ours_vs_bare_copy_rounds"] = [a / b for a, b in zip(rounds["ours_default"],
                                                               rounds["bare_copy"])]
        r["ours_vs_bare_copy"] = float(np.median(r["ours_vs_bare_copy_rounds"]))
        r["heavy_ratio_rounds"] = [a / b for a, b in zip(rounds["heavy_ours_w2"],
                                                         rounds["heavy_noio_w2"])]
        r["getitem_vs_raw_rounds"] = [a / b for a, b in zip(rounds["getitem"],
                                                            rounds["raw_get_copy"])]
        for key in ("ours_vs_best_peer", "heavy_ratio", "getitem_vs_raw", "fields_vs_npy",
                    "fields_vs_wds"):
            r[key] = float(np.median(r[f"{key}_rounds"]))
        print("epoch boundaries ...", flush=True)
        r["boundary_inproc"] = boundary(cache, 5, n)
        for method in ("fork", "forkserver", "spawn"):
            try:
                r[f"boundary_{method}"] = boundary(cache, 5, 12_000, num_workers=2,
                                                   multiprocessing_context=method)
            except Exception as exc:  # noqa: BLE001 - report, keep measuring the rest
                r[f"boundary_{method}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("worker RSS ...", flush=True)
        r["worker_rss_growth_pct"] = rss_growth(cache)
        print("snapshot of 1M ...", flush=True)
        r["snapshot_1m_s"] = snapshot_1m(root, args.tiny)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump(r, f, indent=2)
    report(r)


def report(r: dict[str, Any]) -> None:
    def spread(key: str) -> str:
        values = r.get(f"{key}_rounds") or []
        return f" [rounds {min(values):.2f}-{max(values):.2f}]" if values else ""

    rows = [
        ("epochs() default (in process)", f"{r['ours_default']:,.0f}/s",
         f"{r['ours_vs_best_peer']:.2f}x best peer (target >= 2){spread('ours_vs_best_peer')}"),
        ("  ceiling: bare get + memcpy loop", f"{r['bare_copy']:,.0f}/s",
         f"epochs() = {r['ours_vs_bare_copy']:.2f} of it{spread('ours_vs_bare_copy')}"),
        ("files, in process / 2 workers", f"{r['files_inproc']:,.0f} / {r['files_w2']:,.0f}/s", ""),
        ("plain LMDB, in process / 2 workers", f"{r['lmdb_inproc']:,.0f} / {r['lmdb_w2']:,.0f}/s", ""),
        ("heavy transform, ours / no-I/O (2 workers)",
         f"{r['heavy_ours_w2']:,.0f} / {r['heavy_noio_w2']:,.0f}/s",
         f"{r['heavy_ratio']:.2f} (target >= 0.9){spread('heavy_ratio')}"),
        ("dataset[i] / raw get+copy", f"{r['getitem']:,.0f} / {r['raw_get_copy']:,.0f}/s",
         f"{r['getitem_vs_raw']:.2f} (target >= 0.7){spread('getitem_vs_raw')}"),
        ("{npy, cls} records, epochs()", f"{r['fields_ours']:,.0f}/s",
         f"{r['fields_vs_npy']:.2f} of single .npy (target >= 0.8){spread('fields_vs_npy')}"),
        ("  vs best WebDataset, same samples", "",
         f"{r['fields_vs_wds']:.2f}x (target >= 2){spread('fields_vs_wds')}"),
        ("  WebDataset: DataLoader w0 / direct / unshuffled / w2",
         f"{r['fields_wds_inproc']:,.0f} / {r['fields_wds_direct']:,.0f} / "
         f"{r['fields_wds_unshuffled']:,.0f} / {r['fields_wds_w2']:,.0f}/s", ""),
    ]
    for name in ("inproc", "fork", "forkserver", "spawn"):
        b = r[f"boundary_{name}"]
        if "error" in b:
            rows.append((f"epoch boundary, {name}", "failed", b["error"][:60]))
        else:
            rows.append((f"epoch boundary, {name}", f"median gap {b['median_gap_ms']:.2f} ms",
                         f"worst {b['worst_ratio']:.2f}x, after 1st {b['worst_ratio_after_first']:.2f}x"
                         " (target <= 1.5)"))
    rows.append(("worker RSS growth, 10 epochs", f"{r['worker_rss_growth_pct']:.2f}%", "target < 5%"))
    rows.append(("snapshot of 1M samples", f"{r['snapshot_1m_s'] * 1e3:.1f} ms", "target < 1 s"))
    width = max(len(a) for a, _, _ in rows)
    for a, b, c in rows:
        print(f"{a:<{width}}  {b:<28} {c}")


if __name__ == "__main__":
    main()
