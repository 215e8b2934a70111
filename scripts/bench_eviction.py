"""What least-recently-read eviction costs against oldest-first, side by side (issue 36).

    .venv/bin/python scripts/bench_eviction.py [--samples 1000000] [--commits 50]

For each policy, on a fresh cache of ``--samples`` small samples filled to its capacity: an
epoch whose plan (4 lanes) is read half through ends (its lease is released: under
least-recently-read the process records the read log, O(n) once per epoch), then 64-sample
commits that each evict 64 samples. It prints the lease end, the first evicting commit (a
writer loads the read log once per epoch) and the median of the following commits, with the
ratio least-recently-read / oldest of the last (target: at most 2: a commit that evicts costs
about what it costs oldest-first). It also checks that least-recently-read took only samples
the epoch did not read, and oldest-first only read ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from epochcache.store.reads import write_part

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epochcache import Cache
from epochcache.store.reads import Releaser
from epochcache.store.records import DB_SAMPLES

POLICIES = ("oldest", "least-recently-read")


def run(policy: str, samples: int, commits: int) -> dict[str, float]:
    path = f"{tempfile.mkdtemp(prefix='bench-eviction-')}/cache"
    with Cache(path, samples * 200, headroom=0.0, compression="none", sync=False,
               eviction=policy) as cache:
        for start in range(0, samples, 20_000):
            cache.put_many([(f"k{i:09d}", b"x" * 64)
                            for i in range(start, min(samples, start + 20_000))])
        full = cache.counters().bytes
    cache = Cache(path, full, headroom=0.0, compression="none", sync=False)  # now full
    store = cache
    snap = store.snapshot(plan_parts=1)
    seqs = np.asarray(snap.seqs)
    lanes = [seqs[i::4] for i in range(4)]
    write_part(store.path, snap.lease_id, 0, lanes)
    read = np.unique(np.concatenate([lane[: len(lane) // 2] for lane in lanes]))
    for i, lane in enumerate(lanes):
        Releaser(cache.path, snap.lease_id, 0, i).release(len(lane) // 2)
    started = time.perf_counter()
    snap.release()
    lease_end = time.perf_counter() - started
    times = []
    for commit in range(commits + 1):
        started = time.perf_counter()
        cache.put_many([(f"n{commit:05d}{i:03d}", b"y" * 64) for i in range(64)])
        times.append(time.perf_counter() - started)
    with store.env.read() as txn:
        keys = b"".join(bytes(key) for key in
                        txn.cursor(db=store.env.dbs[DB_SAMPLES]).iternext(values=False))
    present = np.frombuffer(keys, dtype=">u8").astype(np.uint64)
    evicted = np.setdiff1d(seqs, present)
    took_read = int(np.isin(evicted, read).sum())
    cache.close()
    return {"lease_end_s": lease_end, "first_commit_s": times[0],
            "commit_s": statistics.median(times[1:]), "evicted": len(evicted),
            "evicted_read": took_read}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--commits", type=int, default=50)
    args = parser.parse_args()
    results = {policy: run(policy, args.samples, args.commits) for policy in POLICIES}
    print(f"{'policy':22s} {'lease end':>10s} {'1st commit':>11s} {'commit':>9s} "
          f"{'evicted':>8s} {'of them read':>13s}")
    for policy, row in results.items():
        print(f"{policy:22s} {row['lease_end_s'] * 1e3:8.1f}ms {row['first_commit_s'] * 1e3:9.1f}ms "
              f"{row['commit_s'] * 1e3:7.2f}ms {row['evicted']:8d} {row['evicted_read']:13d}")
    ratio = results["least-recently-read"]["commit_s"] / results["oldest"]["commit_s"]
    ok = (ratio <= 2.0 and results["least-recently-read"]["evicted_read"] == 0
          and results["oldest"]["evicted_read"] == results["oldest"]["evicted"])
    print(f"commit, least-recently-read / oldest: {ratio:.2f} (target <= 2); "
          f"least-recently-read took only unread samples, oldest only read ones: "
          f"{'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
