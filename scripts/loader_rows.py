"""The loader rows side by side: cache.epochs() against the machine's floor and ceiling, its
peers, and another commit.

    .venv/bin/python scripts/bench_loader.py --rows [--json F]      this checkout and the peers
    .venv/bin/python scripts/bench_loader.py --ab COMMIT [--json F] COMMIT (A) vs this checkout (B)
    .venv/bin/python scripts/bench.py --ab COMMIT                   the same, from bench.py

Rows, for 1 KiB, 64 KiB and 1 MiB random float32 ``.npy`` samples (stored raw, page cache warm):
``cache.epochs()`` with its default loader in process and with ``num_workers=2``, next to

* the *floor* (in process): in B's own process, over the same samples in the same order as its
  epochs, one read transaction per batch and a loop of LMDB gets copied into one preallocated
  batch buffer: what any loader of this cache must at least do;
* the *no-I/O DataLoader* (2 workers): a DataLoader over a dataset that returns a copy of one
  array per sample, batched the same way (``default_collate`` into shared memory): the
  DataLoader's own cost of handing batches of this shape from workers to the trainer;
* the peers of bench_loader.py (1 KiB and 64 KiB), each in process and with 2 workers: a Dataset
  of one file per sample, the plain LMDB Dataset (a ``get`` per ``__getitem__``), and a plain
  LMDB Dataset that reads a batch at once (DataLoader's ``__getitems__`` with py-lmdb's
  ``Cursor.getmulti``: what a careful hand-written reader does). "Best peer" is the faster of
  the first two with as many workers (the issue's measure); the batched one has a column of
  its own.

Each row is measured twice over: samples per second (what a training job sees) and CPU
microseconds per sample, of the process and its DataLoader workers (what the other jobs of a
shared machine disturb least). Before each round a core probe (scripts/machine.py) records how
many cores the benchmark could use.

Each side runs in a process of its own started with this venv's python and ``PYTHONPATH`` set to
its tree, so each imports its own epochcache and builds its own cache of the same samples: A is
COMMIT checked out into a temporary ``git worktree`` (no venv needed; removed afterwards), B this
checkout as it is on disk. The peers run in a third process. In each round every row runs, the
two sides of a row back to back as A, B, B, A (each side's figure of the round is the mean of its
two, so neither always runs first; the floor runs between B's two; the whole order is reversed
every other round); a rate is the median of its rounds and a ratio the median of its per-round
ratios, since these shared 2-core machines drift by up to 2x within minutes and a pair run back
to back drifts together. A figure whose rounds range wider than 2x is printed as that range,
without a median ("unstable"), and the targets (`TARGETS`) say so.
"""

from __future__ import annotations

import glob
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import lmdb
import numpy as np
from machine import core_probe
from torch.utils.data import DataLoader, Dataset

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BATCH = 64
KIB, MIB = 1024, 1024 * 1024
SIZES = (KIB, 64 * KIB, MIB)
#: Samples per size: epochs of 0.05-0.3 s in process (a row runs at least a second), and peers
#: with 2 workers that take a few seconds for their three passes (the rows' time is theirs).
SAMPLES = {KIB: 20_000, 64 * KIB: 4_000, MIB: 400}
QUICK = {KIB: 10_000, 64 * KIB: 800, MIB: 128}
#: The peers measured at a size (the Datasets up to 64 KiB: the issue's targets name them there).
PEERS = ("files", "lmdb", "lmdb_batched")
#: (label, numerator, denominator, at least): what the issue asks of B, as per-round ratios.
#: ``best/SIZE/wW`` is the best peer (files or plain LMDB) with as many workers.
TARGETS = (
    ("in process / floor, 64 KiB", "B/65536/w0", "floor/65536/w0", 0.8),
    ("in process / floor, 1 MiB", "B/1048576/w0", "floor/1048576/w0", 0.8),
    ("in process / best peer, 1 KiB", "B/1024/w0", "best/1024/w0", 1.2),
    ("2 workers / best peer with 2 workers, 64 KiB", "B/65536/w2", "best/65536/w2", 1.5),
    ("2 workers / best peer with 2 workers, 1 KiB", "B/1024/w2", "best/1024/w2", 1.2),
    ("2 workers / no-I/O DataLoader, 1 KiB", "B/1024/w2", "noio/1024/w2", 1.0),
    ("2 workers / no-I/O DataLoader, 64 KiB", "B/65536/w2", "noio/65536/w2", 1.0),
    ("2 workers / no-I/O DataLoader, 1 MiB", "B/1048576/w2", "noio/1048576/w2", 1.0),
)
_REPLY = "@@loader_rows "  # marks a server's replies among whatever else it prints


# -- the peers (also bench_loader.py's) -------------------------------------------------------


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def fast_npy(data: Any, floats: int) -> np.ndarray:
    """Peers get a fast decoder too (no np.load parsing): the data ends the record."""
    return np.frombuffer(data, np.float32, count=floats, offset=len(data) - floats * 4).copy()


class FileDataset(Dataset[Any]):
    def __init__(self, paths: list[str], floats: int) -> None:
        self.paths, self.floats = paths, floats

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        with open(self.paths[i], "rb") as f:
            return fast_npy(f.read(), self.floats)


class LmdbDataset(Dataset[Any]):
    """The plain LMDB peer: one read transaction and one get per sample."""

    def __init__(self, path: str, n: int, floats: int) -> None:
        self.path, self.n, self.floats = path, n, floats
        self.env: lmdb.Environment | None = None

    def __len__(self) -> int:
        return self.n

    def _env(self) -> lmdb.Environment:
        if self.env is None:
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False)
        return self.env

    def __getitem__(self, i: int) -> Any:
        with self._env().begin(buffers=True) as txn:
            return fast_npy(txn.get(b"%08d" % i), self.floats)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "n": self.n, "floats": self.floats, "env": None}


class LmdbBatchedDataset(LmdbDataset):
    """The plain LMDB peer reading a batch at once: DataLoader hands ``__getitems__`` the batch's
    indices; one transaction and one ``Cursor.getmulti`` for them all."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        with self._env().begin(buffers=True) as txn:
            pairs = txn.cursor().getmulti([b"%08d" % i for i in indices])
            return [fast_npy(value, self.floats) for _key, value in pairs]


class NoIODataset(Dataset[Any]):
    """The no-I/O DataLoader's dataset: a copy of one array per sample, nothing read."""

    def __init__(self, n: int, floats: int) -> None:
        self.n = n
        self.x = np.random.default_rng(0).standard_normal(floats).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.x.copy()


def peers_of(size: int, workers: int) -> tuple[str, ...]:
    """The peer rows measured at ``size`` with ``workers``."""
    return (PEERS if size <= 64 * KIB else ()) + (("noio",) if workers else ())


def samples(size: int, count: int) -> list[bytes]:
    """The benchmark's samples: ``count`` random float32 arrays of ``size`` bytes, the same on
    every call (random bit patterns: incompressible, stored raw)."""
    rng = np.random.default_rng(size)
    floats = size // 4
    return [npy(rng.integers(0, 2**32, floats, dtype=np.uint32).view(np.float32))
            for _ in range(count)]


def cpu_s() -> float:
    """CPU seconds of this process (all its threads) and of its live descendants (DataLoader
    workers, forked by it or by a forkserver it started): what a row costs, which a shared
    machine disturbs far less than the time it takes."""
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)  # children that ended, waited for
    total = time.process_time() + reaped.ru_utime + reaped.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    pending, seen = [os.getpid()], set()
    while pending:
        parent = pending.pop()
        for tasks in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(tasks) as f:
                    children = [int(pid) for pid in f.read().split()]
            except OSError:  # gone meanwhile
                continue
            for pid in children:
                if pid in seen:
                    continue
                seen.add(pid)
                pending.append(pid)
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


class Timer:
    """Samples counted over a timed stretch: samples per second and CPU microseconds per
    sample (of the process and its workers)."""

    def __init__(self) -> None:
        self.n, self.wall, self.cpu = 0, time.perf_counter(), cpu_s()

    def result(self) -> dict[str, float]:
        wall, cpu = time.perf_counter() - self.wall, cpu_s() - self.cpu
        return {"rate": self.n / wall, "cpu_us": cpu / self.n * 1e6}


def rate(loader: Any, min_s: float, passes: int = 2) -> dict[str, float]:
    """Over at least ``passes`` full passes and ``min_s`` seconds after a warm-up pass."""
    for _ in loader:
        pass
    done, timer = 0, Timer()
    while done < passes or time.perf_counter() - timer.wall < min_s:
        for batch in loader:
            timer.n += len(batch)
        done += 1
    return timer.result()


def ours_rate(cache: Any, min_s: float, epochs: int = 2, **kw: Any) -> dict[str, float]:
    """``cache.epochs()`` over at least ``epochs`` epochs and ``min_s`` seconds after a warm-up
    epoch (workers start, pages mapped); epoch boundaries included."""
    timer = Timer()
    for epoch, loader in cache.epochs(1 << 30, batch_size=BATCH, **kw):
        if epoch == 0:
            for _ in loader:
                pass
            timer = Timer()
            continue
        for batch in loader:
            timer.n += len(batch)
        if epoch >= epochs and time.perf_counter() - timer.wall >= min_s:
            return timer.result()  # before epochs() shuts its workers down
    raise AssertionError("unreachable")


# -- a side's process ---------------------------------------------------------------------------


class _Server:
    """What one process holds: the caches it built (ours) or the peers' files and LMDB."""

    def __init__(self) -> None:
        self.caches: dict[int, Any] = {}
        self.peers: dict[int, tuple[list[str], str, int]] = {}
        self.floor_keys: dict[int, list[list[bytes]]] = {}

    def where(self) -> str:
        import epochcache

        return os.path.dirname(os.path.dirname(os.path.abspath(epochcache.__file__)))

    def prepare(self, kind: str, root: str, size: int, count: int) -> None:
        if kind == "peers" and size > 64 * KIB:
            self.peers[size] = ([], "", count)  # the no-I/O DataLoader only
            return
        blobs = samples(size, count)
        if kind == "ours":
            from epochcache import Cache

            cache = Cache(os.path.join(root, f"ours-{size}"), "4GiB", sync=False)
            for start in range(0, count, 1000):
                cache.put_many([(f"train/{i:07d}.npy", blobs[i])
                                for i in range(start, min(count, start + 1000))])
            self.caches[size] = cache
            return
        files = []
        os.makedirs(os.path.join(root, f"files-{size}"))
        for i, blob in enumerate(blobs):
            files.append(os.path.join(root, f"files-{size}", f"{i:07d}.npy"))
            with open(files[-1], "wb") as f:
                f.write(blob)
        plain = os.path.join(root, f"plain-{size}")
        env = lmdb.open(plain, map_size=4 << 30)
        with env.begin(write=True) as txn:
            for i, blob in enumerate(blobs):
                txn.put(b"%08d" % i, blob)
        env.close()
        self.peers[size] = (files, plain, count)

    def measure(self, row: str, size: int, workers: int, min_s: float) -> dict[str, float]:
        if row == "ours":
            return ours_rate(self.caches[size], min_s, num_workers=workers)
        if row == "floor":
            return self.floor(size, min_s)
        files, plain, count = self.peers[size]
        floats = size // 4
        dataset: Dataset[Any] = (FileDataset(files, floats) if row == "files"
                                 else LmdbDataset(plain, count, floats) if row == "lmdb"
                                 else LmdbBatchedDataset(plain, count, floats) if row == "lmdb_batched"
                                 else NoIODataset(count, floats))
        return rate(DataLoader(dataset, BATCH, shuffle=True, num_workers=workers,
                               persistent_workers=workers > 0), min_s)


    def floor(self, size: int, min_s: float) -> dict[str, float]:
        """The floor: epochs()' samples in the order of its epochs 1 and 2, one read
        transaction per batch, a get and a copy of the array into one preallocated batch
        buffer per sample; timed like the rows (two passes and ``min_s`` after a warm-up)."""
        from epochcache.data.schedule import epoch_order
        from epochcache.store.records import DB_SAMPLES, seq_keys

        store = self.caches[size]
        env, db = store.env.lmdb_env, store.env.dbs[DB_SAMPLES]
        keys = self.floor_keys.get(size)
        if keys is None:
            with self.caches[size].dataset() as dataset:
                seqs = np.array(dataset.seqs)
            keys = self.floor_keys[size] = [seq_keys(epoch_order(seqs, epoch))
                                            for epoch in (1, 2)]
        nbytes = size  # the array's bytes: the end of each record
        out = memoryview(np.empty(BATCH * nbytes, np.uint8))

        def one_pass(order: list[bytes]) -> int:
            for start in range(0, len(order), BATCH):
                txn = env.begin(buffers=True)
                try:
                    pos = 0
                    for key in order[start : start + BATCH]:
                        record = txn.get(key, None, db)
                        out[pos : pos + nbytes] = record[len(record) - nbytes :]
                        pos += nbytes
                finally:
                    txn.abort()
            return len(order)

        one_pass(keys[0])
        done, timer = 0, Timer()
        while done < 2 or time.perf_counter() - timer.wall < min_s:
            timer.n += one_pass(keys[done % 2])
            done += 1
        return timer.result()


def serve() -> None:
    """Answer the driver's requests, one JSON line each, until stdin ends."""
    server = _Server()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply: dict[str, Any] = {"ok": getattr(server, request["op"])(*request["args"])}
        except Exception as exc:  # noqa: BLE001 - reported by the driver, which stops the run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(_REPLY + json.dumps(reply) + "\n")
        sys.stdout.flush()


class _Side:
    """The driver's handle on a side's process."""

    def __init__(self, name: str, tree: str) -> None:
        self.name, self.tree = name, tree
        env = dict(os.environ, PYTHONPATH=tree)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=tree)

    def call(self, op: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_REPLY):
                reply = json.loads(line[len(_REPLY):])
                if "error" in reply:
                    raise RuntimeError(f"side {self.name} ({self.tree}): {op}{args}: "
                                       f"{reply['error']}")
                return reply["ok"]
            sys.stdout.write(line)  # something the side printed
        raise RuntimeError(f"side {self.name} ({self.tree}) exited "
                           f"({self.proc.wait()}) during {op}{args}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the driver ---------------------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def describe_checkout() -> str:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    branch, commit = _git("rev-parse", "--abbrev-ref", "HEAD"), _git("rev-parse", "--short", "HEAD")
    return f"{branch} at {commit}" + (" + uncommitted changes" if dirty else "")


def run(ab: str | None = None, *, rounds: int = 3, sizes: tuple[int, ...] = SIZES,
        quick: bool = False, min_s: float = 1.0) -> dict[str, Any]:
    """Measure the rows for this checkout (and, with ``ab``, that commit); print the tables."""
    began = time.perf_counter()
    root = tempfile.mkdtemp(prefix="bench-rows-", dir=os.environ.get("EPOCHCACHE_BENCH_DIR"))
    tree_a = os.path.join(root, "tree-a")
    counts = QUICK if quick else SAMPLES
    sides: dict[str, _Side] = {}
    result: dict[str, Any] = {"rounds": rounds, "batch": BATCH, "cpus": os.cpu_count(),
                              "samples": {str(s): counts[s] for s in sizes},
                              "B": describe_checkout(), "measured": {}, "machine": []}
    try:
        names = ["B"]
        if ab is not None:
            _git("worktree", "add", "--detach", tree_a, ab)
            result["A"] = _git("-C", tree_a, "log", "-1", "--format=%h %s")[:100]
            names = ["A", "B"]
        for name in names:
            sides[name] = _Side(name, tree_a if name == "A" else REPO)
        sides["peers"] = _Side("peers", REPO)
        for name, side in sides.items():
            where = side.call("where")
            expected = tree_a if name == "A" else REPO
            if os.path.realpath(where) != os.path.realpath(expected):
                raise RuntimeError(f"side {name} imports epochcache from {where}, not {expected}")
        for size in sizes:
            print(f"preparing {counts[size]} samples of {size} bytes ...", flush=True)
            for name, side in sides.items():
                os.makedirs(os.path.join(root, name), exist_ok=True)
                side.call("prepare", "peers" if name == "peers" else "ours",
                          os.path.join(root, name), size, counts[size])
        # With two sides each row runs A, B, B, A in a round (the round's figure of a side is
        # the mean of its two): a run right after another's teardown measured up to 15% more
        # CPU with workers, so each side goes first as often as second. The floor runs in B's
        # process between B's two runs.
        order = [*names, *names[::-1]] if len(names) > 1 else names
        rows: list[tuple[str, str, int, int]] = []  # (side, row, size, workers)
        for size in sizes:
            for workers in (0, 2):
                ours = [(name, "ours", size, workers) for name in order]
                if workers == 0:
                    ours.insert(len(ours) // 2, ("B", "floor", size, 0))
                rows += ours
                rows += [("peers", peer, size, workers) for peer in peers_of(size, workers)]
        measured: dict[str, dict[str, list[float]]] = result["measured"]
        for rnd in range(rounds):
            probe = core_probe()
            result["machine"].append(probe)
            print(f"round {rnd + 1}/{rounds} (cores free {probe['cores_free']} of "
                  f"{probe['cores']}, load {probe['load_1m']}) ...", flush=True)
            this_round: dict[str, dict[str, list[float]]] = {}
            for side, row, size, workers in (rows if rnd % 2 == 0 else rows[::-1]):
                key = f"{side if row == 'ours' else row}/{size}/w{workers}"
                got = sides[side].call("measure", row, size, workers, min_s)
                for metric, value in got.items():
                    this_round.setdefault(key, {}).setdefault(metric, []).append(value)
            for key, metrics in this_round.items():
                for metric, values in metrics.items():
                    measured.setdefault(key, {}).setdefault(metric, []).append(
                        float(np.mean(values)))
    finally:
        for side in sides.values():
            side.close()
        if os.path.exists(tree_a):
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree_a],
                           check=False)
        shutil.rmtree(root, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - began, 1)
    add_best(result["measured"], sizes)
    result["targets"] = targets(result["measured"])
    report(result, names, sizes)
    return result


def add_best(m: dict[str, dict[str, list[float]]], sizes: tuple[int, ...]) -> None:
    """``best/SIZE/wW``: per round, the faster of the file-per-sample and plain LMDB peers
    (the lower CPU per sample), where they were measured."""
    for size in sizes:
        for workers in (0, 2):
            files, plain = m.get(f"files/{size}/w{workers}"), m.get(f"lmdb/{size}/w{workers}")
            if files is None or plain is None:
                continue
            m[f"best/{size}/w{workers}"] = {
                metric: [(max if metric == "rate" else min)(pair)
                         for pair in zip(files[metric], plain[metric])]
                for metric in files}


def _median(values: list[float]) -> float:
    return float(np.median(values))


def unstable(values: list[float]) -> bool:
    """Whether figures of the same measure range wider than 2x (then no median is reported)."""
    return len(values) > 1 and min(values) > 0 and max(values) > 2 * min(values)


def _ratio(a: list[float], b: list[float]) -> str:
    """The median of the per-round ratios a/b, and their range (only the range if unstable)."""
    ratios = [x / y for x, y in zip(a, b)]
    if unstable(ratios):
        return f"unstable: {min(ratios):.2f}x-{max(ratios):.2f}x"
    return f"{_median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def _inverse_ratio(a: list[float], b: list[float]) -> str:
    return _ratio(b, a)


def _value(values: list[float], digits: int) -> str:
    if unstable(values):
        return f"unstable: {min(values):,.{digits}f}-{max(values):,.{digits}f}"
    return f"{_median(values):,.{digits}f}"


def verdict(values: list[float], least: float) -> dict[str, Any]:
    """Whether per-round figures meet ``at least``: by their median, or where the rounds
    range wider than 2x only if every round or no round does ("unstable" otherwise)."""
    median = _median(values)
    if not unstable(values):
        said = "met" if median >= least else "NOT met"
    elif min(values) >= least:
        said = "met in every round (rounds range over 2x)"
    elif max(values) < least:
        said = "NOT met in any round (rounds range over 2x)"
    else:
        said = "unstable (rounds range over 2x)"
    return {"at_least": least, "median": round(median, 3),
            "range": [round(min(values), 3), round(max(values), 3)], "verdict": said}


def targets(m: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Each target of `TARGETS` that this run measured: B's per-round ratios of samples/s."""
    out = []
    for label, mine, theirs, least in TARGETS:
        if mine in m and theirs in m:
            ratios = [x / y for x, y in zip(m[mine]["rate"], m[theirs]["rate"])]
            out.append({"target": label, **verdict(ratios, least)})
    return out


def report(result: dict[str, Any], names: list[str], sizes: tuple[int, ...]) -> None:
    """Two tables: throughput (samples/s, what a training job sees), and CPU cost (CPU
    microseconds per sample, of the process and its workers: what a busy machine disturbs
    least); then the machine's state and the targets. Ratios are per round, A and B and the
    peers of a round run back to back."""
    m = result["measured"]
    print()
    if "A" in result:
        print(f"A = {result['A']}")
    print(f"B = {result['B']}")
    print(f"{result['rounds']} rounds, batches of {result['batch']}; each ratio is the median of "
          "its per-round ratios [their range], or only the range where it is wider than 2x; "
          "ceiling = in process the floor (LMDB gets copied into one batch buffer), with 2 "
          "workers the no-I/O DataLoader; best peer = the faster of the file-per-sample and "
          "plain LMDB Datasets with as many workers")
    for metric, title in (("rate", "samples/s"), ("cpu_us", "CPU us/sample")):
        # A ratio reads "how many times better": samples/s over samples/s, or the other
        # side's CPU per sample over this one's.
        better = _ratio if metric == "rate" else _inverse_ratio
        digits = 0 if metric == "rate" else 2
        head = (f"row ({title}, median)", "value", "vs ceiling", "vs best peer", "vs plain LMDB",
                "vs batched LMDB", "B/A" if "A" in names else "")
        rows: list[tuple[str, ...]] = []

        def versus(ours: list[float], key: str, metric: str = metric,
                   better: Any = better) -> str:
            return better(ours, m[key][metric]) if key in m else "-"

        for size in sizes:
            unit = f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"
            for workers in (0, 2):
                label = f"{unit}, {'in process' if workers == 0 else '2 workers'}"
                ceiling = f"floor/{size}/w0" if workers == 0 else f"noio/{size}/w2"
                for name in names:
                    ours = m[f"{name}/{size}/w{workers}"][metric]
                    rows.append((f"{label}: epochs() {name}", _value(ours, digits),
                                 versus(ours, ceiling), versus(ours, f"best/{size}/w{workers}"),
                                 versus(ours, f"lmdb/{size}/w{workers}"),
                                 versus(ours, f"lmdb_batched/{size}/w{workers}"),
                                 better(ours, m[f"A/{size}/w{workers}"][metric])
                                 if name == "B" and "A" in names else ""))
            rows.append((f"{unit} floor (in process)", _value(m[f"floor/{size}/w0"][metric], digits),
                         "", "", "", "", ""))
            rows.append((f"{unit} no-I/O DataLoader, 2 workers",
                         _value(m[f"noio/{size}/w2"][metric], digits), "", "", "", "", ""))
            for peer, peer_title in (("files", "file per sample"), ("lmdb", "plain LMDB"),
                                     ("lmdb_batched", "plain LMDB, batched")):
                if f"{peer}/{size}/w0" not in m:
                    continue
                values = [_value(m[f"{peer}/{size}/w{w}"][metric], digits) for w in (0, 2)]
                rows.append((f"{unit} peer: {peer_title}, in process / 2 workers",
                             " / ".join(values), "", "", "", "", ""))
        print()
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        for r in [head, *rows]:
            print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip())
    free = [probe["cores_free"] for probe in result["machine"]]
    loads = [probe["load_1m"] for probe in result["machine"]]
    print(f"\nmachine: {result['cpus']} cores; free per round (core probe) "
          f"{', '.join(f'{f:.2f}' for f in free)}; load {', '.join(f'{x:.1f}' for x in loads)}; "
          f"the rows took {result['seconds']:.0f} s")
    print("\ntargets (B, samples/s, per-round ratios):")
    for target in result["targets"]:
        print(f"  {target['target']}: {target['median']:.2f}x "
              f"[{target['range'][0]:.2f}-{target['range'][1]:.2f}], at least "
              f"{target['at_least']}x: {target['verdict']}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        raise SystemExit("run through scripts/bench_loader.py --rows or --ab COMMIT")
