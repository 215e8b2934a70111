"""Scale benchmark: how each cost grows with the number of keys (issue 22, item 6).

For N = 10^4, 10^5 and 10^6 keys (10^7 with ``--large``), on this machine, with a manifest on
``file://`` (no objects needed: the cache is filled with the manifest's keys directly):

* manifest load: a fresh process lists the source through its manifest (parse, sort, save the
  listing): seconds, and the process's memory per key (anonymous RSS after, less before);
* listing load: a fresh process reads the saved listing, as every sampler does at its start;
* daemon: ``epochcache daemon`` (2 samplers) over the filled cache: seconds from its start until
  both samplers are idle (every key found cached), the RSS (anonymous) of the daemon and of
  each sampler, and the CPU they use while idle over ``--idle-s`` seconds (from /proc, in
  clock ticks: over 20 s the resolution is 0.05% of a core; 0 means less);
* the first snapshot after opening the cache, the epoch plan (the epoch's permutation),
  ``stats()`` (in process) and ``epochcache status --json`` (a command, interpreter start
  included);
* ``epochcache verify``'s check of every sample, in process: seconds per GB stored (samples of
  256 bytes: per-sample costs dominate);
* eviction: samples per second evicting the oldest 5,000.

Each cost's growth is the slope of log(cost) against log(N) (least squares over the sizes),
printed next to its target (1: linear, 0: flat), with the per-key figures at the largest N.
Writes ``bench_scale.json`` and ``bench_scale.png`` (the curves) under ``--out``.

Usage: .venv/bin/python scripts/bench_scale.py [--sizes 1e4,1e5,1e6] [--large] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_BYTES = 256

# a fresh process: its anonymous memory before and after holding the listing
_LOAD = r"""
import json, sys, time
from epochcache.ingest.layouts import (SourceSpec, listing_cached, open_source, read_listing,
                                       source_fingerprint)

def memory():
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f
                if l.startswith(("RssAnon", "VmRSS", "VmHWM"))}

mode, url, cache_dir = sys.argv[1:4]
source = open_source(SourceSpec(url=url, manifest="keys.txt", checks=()))
before = memory()
start = time.perf_counter()
if mode == "manifest":
    listing = listing_cached(source, cache_dir)
else:
    listing = read_listing(cache_dir, source_fingerprint(source.spec))
seconds = time.perf_counter() - start
after = memory()
held = listing.table if hasattr(listing, "table") else listing.refs  # before issue 22: refs
# VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec
peak = after["VmHWM"] - before["VmRSS"]
print(json.dumps({"seconds": seconds, "keys": len(held), "peak_bytes": peak,
                  "anon_bytes": after["RssAnon"] - before["RssAnon"]}))
"""


def proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(("RssAnon", "RssFile", "VmRSS")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def write_manifest(remote: Path, n: int) -> None:
    remote.mkdir(parents=True, exist_ok=True)
    with open(remote / "keys.txt", "w") as out:
        out.writelines("".join(f"d{i // 1000:05d}/s{i:08d}.bin\n"
                              for i in range(start, min(n, start + 100_000))) for start in range(0, n, 100_000))


def load(mode: str, remote: Path, cache_dir: Path) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", _LOAD, mode, remote.as_uri(), str(cache_dir)],
                            capture_output=True, text=True, env=ENV, check=True)
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def fill(cache_dir: Path, n: int) -> float:
    from epochcache import Cache

    rng = np.random.default_rng(0)
    started = time.perf_counter()
    with Cache(cache_dir, capacity=4 * n * SAMPLE_BYTES + 2**30, sync=False) as cache:
        for lo in range(0, n, 20_000):
            blob = rng.bytes(SAMPLE_BYTES * min(20_000, n - lo))
            cache.put_many((f"d{i // 1000:05d}/s{i:08d}.bin",
                            blob[(i - lo) * SAMPLE_BYTES:(i - lo + 1) * SAMPLE_BYTES])
                           for i in range(lo, min(n, lo + 20_000)))
    return time.perf_counter() - started


def median_time(fn: Any, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def in_process_costs(cache_dir: Path) -> dict[str, float]:
    from epochcache import Cache
    from epochcache.data.schedule import epoch_order

    out: dict[str, float] = {}
    with Cache(cache_dir) as cache:
        started = time.perf_counter()
        snapshot = cache.snapshot(epoch=0)
        out["snapshot_s"] = time.perf_counter() - started
        out["plan_s"] = median_time(lambda: epoch_order(snapshot.seqs, 1, seed=0), 3)
        snapshot.release()
        out["stats_s"] = median_time(cache.stats)
        out["stored_gb"] = cache.counters().bytes / 1e9
    return out


def verify_seconds(cache_dir: Path) -> float:
    """``epochcache verify``'s work, in process (the command adds ~1 s of interpreter start)."""
    from epochcache.store.verify import verify_cache

    started = time.perf_counter()
    report = verify_cache(str(cache_dir))
    seconds = time.perf_counter() - started
    if not report.ok:
        raise RuntimeError(f"verify found problems: {report.as_dict()}")
    return seconds


def command_s(*args: str) -> float:
    def run() -> None:
        subprocess.run([sys.executable, "-m", "epochcache", *args], capture_output=True,
                       env=ENV, check=False)
    return median_time(run, 3)


def daemon_idle(workdir: Path, remote: Path, cache_dir: Path, idle_s: float) -> dict[str, Any]:
    import yaml

    from epochcache import Cache

    config = workdir / "daemon.yaml"
    config.write_text(yaml.safe_dump({
        "source": {"url": remote.as_uri(), "manifest": (remote / "keys.txt").as_uri(),
                   "checks": []},
        "cache": {"dir": str(cache_dir), "capacity": 4 * 10**9, "sync": False},
        "sampler": {"processes": 2},
    }))
    log = open(workdir / "daemon.log", "wb")  # noqa: SIM115 - closed below
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "epochcache", "daemon", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, env=ENV,
                            start_new_session=True)
    try:
        pids: list[int] = []
        deadline = started + 1800
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}: see {log.name}")
            with Cache(cache_dir, readonly=True) as cache:
                states = cache.tables.states("sampler/")
            if len(states) == 2 and all(s.get("idle") == "complete" for s in states.values()):
                pids = [int(s["pid"]) for s in states.values()]
                break
            time.sleep(0.2)
        if not pids:
            raise RuntimeError("the samplers did not go idle")
        to_idle = time.monotonic() - started
        time.sleep(2)  # the last pass's batches settle
        everyone = [proc.pid, *pids]
        before = {pid: cpu_s(pid) for pid in everyone}
        time.sleep(idle_s)
        used = {pid: cpu_s(pid) - before[pid] for pid in everyone}
        memory = {pid: proc_status(pid) for pid in everyone}
        return {
            "start_to_idle_s": to_idle,
            "daemon_anon": memory[proc.pid]["RssAnon"],
            "daemon_rss": memory[proc.pid]["VmRSS"],
            "sampler_anon": max(memory[pid]["RssAnon"] for pid in pids),
            "sampler_rss": max(memory[pid]["VmRSS"] for pid in pids),
            "daemon_idle_cpu": used[proc.pid] / idle_s,
            "sampler_idle_cpu": max(used[pid] for pid in pids) / idle_s,
        }
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def eviction_rate(cache_dir: Path, n: int) -> float:
    """Samples per second evicting the oldest 5,000 (the same count at every N)."""
    from epochcache import Cache

    count = min(5000, n // 2)
    with Cache(cache_dir) as cache:
        stored = cache.counters().bytes
        started = time.perf_counter()
        result = cache.evict(limit_bytes=stored - count * SAMPLE_BYTES - 1)
        seconds = time.perf_counter() - started
    return float(result.count) / seconds


def measure(n: int, out: Path, idle_s: float) -> dict[str, Any]:
    workdir = out / f"n{n}"
    shutil.rmtree(workdir, ignore_errors=True)
    remote, cache_dir = workdir / "remote", workdir / "cache"
    write_manifest(remote, n)
    cache_dir.mkdir(mode=0o700)  # the listing is saved in it before the cache is made
    row: dict[str, Any] = {"n": n}
    manifest = load("manifest", remote, cache_dir)
    row["manifest_load_s"] = manifest["seconds"]
    row["manifest_peak_bytes"] = manifest["peak_bytes"]
    listing = load("listing", remote, cache_dir)
    row["listing_load_s"] = listing["seconds"]
    row["listing_anon_bytes"] = listing["anon_bytes"]
    row["fill_s"] = fill(cache_dir, n)
    row.update(in_process_costs(cache_dir))
    row["status_cmd_s"] = command_s("status", str(cache_dir), "--json")
    row["verify_s_per_gb"] = verify_seconds(cache_dir) / row["stored_gb"]
    row.update(daemon_idle(workdir, remote, cache_dir, idle_s))
    row["evictions_per_s"] = eviction_rate(cache_dir, n)
    print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return row


#: cost, column, unit, target slope (growth), and a target on the per-key or absolute value
COSTS: list[tuple[str, str, str, float, str]] = [
    ("manifest load (parse, sort, save)", "manifest_load_s", "s", 1.0, ""),
    ("listing load (each sampler's start)", "listing_load_s", "s", 1.0, ""),
    ("listing memory in a process", "listing_anon_bytes", "B", 1.0, "<= 64 B/key"),
    ("daemon start to idle (2 samplers)", "start_to_idle_s", "s", 1.0, ""),
    ("daemon RSS (anonymous)", "daemon_anon", "B", 0.0, "<= 64 B/key"),
    ("sampler RSS (anonymous)", "sampler_anon", "B", 1.0, "<= 64 B/key"),
    ("idle CPU, daemon", "daemon_idle_cpu", "core", 0.0, "<= 1% of a core"),
    ("idle CPU, each sampler", "sampler_idle_cpu", "core", 0.0, "<= 1% of a core"),
    ("first snapshot after opening", "snapshot_s", "s", 1.0, "< 1 s at 1M"),
    ("epoch plan (permutation)", "plan_s", "s", 1.0, ""),
    ("stats() in process", "stats_s", "s", 0.0, ""),
    ("`status --json` command", "status_cmd_s", "s", 0.0, ""),
    ("`verify` per GB stored", "verify_s_per_gb", "s/GB", 0.0, ""),
    ("eviction throughput", "evictions_per_s", "/s", 0.0, ""),
]


def slope(ns: list[int], values: list[float]) -> float:
    pairs = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v > 0]
    if len(pairs) < 2:
        return float("nan")
    x, y = np.array(pairs).T
    return float(np.polyfit(x, y, 1)[0])


def per_key(rows: list[dict[str, Any]], column: str) -> float:
    """Bytes per key between the smallest and the largest N (what a key adds)."""
    lo, hi = rows[0], rows[-1]
    return float(hi[column] - lo[column]) / float(hi["n"] - lo["n"])


def fmt(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / 2**20:.1f} MiB"
    if unit == "core":
        return f"{100 * value:.2f}%"
    if unit == "/s":
        return f"{value:,.0f}"
    return f"{value:.4g}"


def table(rows: list[dict[str, Any]]) -> str:
    ns = [row["n"] for row in rows]
    head = ["cost"] + [f"N={n:.0e}".replace("e+0", "e") for n in ns] + ["slope", "target",
                                                                        "at largest N"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, column, unit, target, value_target in COSTS:
        values = [float(row[column]) for row in rows]
        extra = ""
        if value_target.endswith("B/key"):
            extra = f"{per_key(rows, column):.1f} B/key ({value_target})"
        elif unit == "core":
            extra = f"{100 * values[-1]:.2f}% ({value_target})"
        elif value_target:
            extra = f"{values[-1]:.3g} s ({value_target})"
        lines.append("| " + " | ".join([name] + [fmt(v, unit) for v in values]
                                         + [f"{slope(ns, values):.2f}", f"{target:g}", extra])
                     + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [row["n"] for row in rows]
    fig, axes = plt.subplots(4, 4, figsize=(16, 13))
    for ax, (name, column, unit, target, _) in zip(axes.flat, COSTS):
        values = [float(row[column]) for row in rows]
        shown = [(n, v) for n, v in zip(ns, values) if v > 0]  # 0: below the resolution
        if shown:
            xs, ys = zip(*shown)
            ax.loglog(xs, ys, "o-", label="measured")
            ref = [ys[0] * (n / xs[0]) ** target for n in xs]
            ax.loglog(xs, ref, "--", color="grey", label=f"slope {target:g}")
        ax.set_title(f"{name}\nslope {slope(ns, values):.2f}", fontsize=9)
        ax.set_xlabel("keys")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(COSTS):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e4,1e5,1e6")
    parser.add_argument("--large", action="store_true", help="add N = 10^7")
    parser.add_argument("--idle-s", type=float, default=20.0,
                        help="seconds the idle daemon's CPU is measured over")
    parser.add_argument("--out", type=Path, default=Path("/tmp/epochcache-bench-scale"))
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")] + ([10**7] if args.large else [])
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(n, args.out, args.idle_s) for n in sizes]
    (args.out / "bench_scale.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    try:
        plot(rows, args.out / "bench_scale.png")
        print(f"curves: {args.out / 'bench_scale.png'}")
    except ImportError:
        print("(no matplotlib: no curves written; pip install 'epochcache[plot]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
