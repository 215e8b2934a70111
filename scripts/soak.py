"""Soak test: a daemon and a trainer against moto's S3 server, with faults at random moments.

For ``--minutes`` (default 10) it runs ``epochcache daemon`` on a small cache (it turns over
every few seconds) with re-listing on, and a trainer process looping over ``cache.epochs()``.
At random moments it does one of:

* **kill sampler**: SIGKILL one sampler process (the daemon must restart it);
* **kill daemon**: SIGKILL the daemon alone, then start a new one (its samplers must follow);
* **restart s3**: SIGKILL the S3 server, leave it down 3-15 s, start it again on the same port;
* **bad objects**: write a corrupt ``.npy``, one larger than the cache and one whose key is
  longer than LMDB allows; the re-list picks them up (quarantined, quarantined, cached).

After every event it checks: stored bytes <= capacity + headroom (also polled between events),
``epochcache verify`` is clean, no process of a killed daemon is left, training and ingest make
progress within 60 s (of the S3 server coming back, for an outage), and no committed sample was
lost (every sample a check saw is still there, unchanged, unless it is older than the oldest
present one: eviction goes oldest first). It prints a table of the events survived and exits 1
if any check failed. Not part of ``scripts/test``. Usage::

    .venv/bin/python scripts/soak.py [--minutes 10] [--seed 0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from common.s3server import S3ServerProcess  # noqa: E402 - the moto server of the fault tests

from epochcache.errors import CacheError  # noqa: E402
from epochcache.status import collect_stats  # noqa: E402
from epochcache.store import SampleStore  # noqa: E402
from epochcache.store.records import (  # noqa: E402
    DB_SAMPLES,
    read_info,
    seq_of,
)

BUCKET = "soak"
SAMPLES = 1500
SAMPLE_BYTES = 4096
CAPACITY = 300 * (SAMPLE_BYTES + 200)  # ~300 samples: the cache turns over every few seconds
PROGRESS_S = 60.0
ORPHAN_S = 10.0
EVENTS = ("kill sampler", "kill daemon", "restart s3", "bad objects")

TRAINER = textwrap.dedent("""
    import json, os, sys, time
    from epochcache import Cache

    cache = Cache(sys.argv[1])
    out = sys.argv[2]
    batches = samples = 0

    def report(epoch):
        with open(out + ".tmp", "w") as f:
            json.dump({"batches": batches, "samples": samples, "epoch": epoch, "time": time.time()}, f)
        os.replace(out + ".tmp", out)

    for epoch, loader in cache.epochs(num_epochs=10**9, batch_size=16, num_workers=0,
                                      min_samples=100, seed=0):
        for batch in loader:
            time.sleep(0.005)  # a training step (and a machine shared with others)
            batches += 1
            samples += len(batch)
            if batches % 5 == 0:
                report(epoch)
        report(epoch)
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _npy(num_bytes: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.random.default_rng(seed).standard_normal(num_bytes // 4).astype(np.float32))
    return buffer.getvalue()


def _session_pids(session: int) -> list[int]:
    """Live processes of a session (the daemon starts one: its samplers are in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def _wait(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.2) -> float | None:
    """Seconds until ``predicate()`` is truthy, or None after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval_s)
    return None


@dataclass
class Tally:
    count: int = 0
    survived: int = 0
    worst_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class Soak:
    """Everything the soak runs: the S3 server, the daemon, the trainer, and the checks."""

    def __init__(self, workdir: Path, seed: int) -> None:
        self.workdir = workdir
        self.rng = random.Random(seed)
        self.objects = workdir / "objects"
        self.cache_dir = workdir / "cache"
        self.s3 = S3ServerProcess(_free_port(), self.objects, workdir / "s3server.log")
        self.daemon: subprocess.Popen[bytes] | None = None
        self.daemons = 0
        self.dead_sessions: list[int] = []
        self.trainer: subprocess.Popen[bytes] | None = None
        self.progress_path = workdir / "progress.json"
        self.seen: dict[int, tuple[str, int]] = {}  # seq -> (key, crc) at the last check
        self.max_inserted = 0
        self.bad = 0
        self.tallies = {name: Tally() for name in EVENTS}
        self.bytes_violations: list[str] = []

    # -- setup ------------------------------------------------------------------------------------

    def setup(self) -> None:
        root = self.objects / BUCKET / "ds"
        root.mkdir(parents=True)
        for i in range(SAMPLES):
            (root / f"sample-{i:06d}.npy").write_bytes(_npy(SAMPLE_BYTES, i))
        self.s3.start()
        options = {"key": "soak", "secret": "soak-secret", "endpoint_url": self.s3.endpoint,
                   "client_kwargs": {"region_name": "us-west-2"}}
        self.options = options
        self.config = self.workdir / "soak.yaml"
        self.config.write_text(yaml.safe_dump({
            "source": {"url": f"s3://{BUCKET}/ds", "pattern": "**.npy", "storage_options": options,
                       "timeout_s": 3, "connect_timeout_s": 1, "list_deadline_s": 5, "retries": 3,
                       "listing_ttl_s": 10},
            "cache": {"dir": str(self.cache_dir), "capacity": CAPACITY, "sync": False},
            "sampler": {"processes": 2, "concurrency": 8, "batch_size": 16},
        }))
        self.start_daemon()
        if _wait(lambda: self.stats()["samples"] >= 100, 120) is None:
            raise SystemExit(f"the daemon did not fill 100 samples:\n{self.daemon_logs()[-3000:]}")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        trainer_log = open(self.workdir / "trainer.log", "wb")  # noqa: SIM115 - lives with the run
        self.trainer = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(self.cache_dir), str(self.progress_path)],
            stdout=trainer_log, stderr=trainer_log, env=env, start_new_session=True)
        if _wait(lambda: self.progress()[0] > 0, 120) is None:
            raise SystemExit("the trainer made no progress; see trainer.log")

    def start_daemon(self) -> None:
        self.daemons += 1
        log = open(self.workdir / f"daemon{self.daemons}.log", "wb")  # noqa: SIM115
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "epochcache", "daemon", str(self.config)], stdout=log,
            stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        if _wait(self.samplers_alive, 60) is None:
            raise SystemExit(f"daemon {self.daemons} did not start its samplers:\n"
                             f"{self.daemon_logs()[-3000:]}")

    def daemon_logs(self) -> str:
        return (self.workdir / f"daemon{self.daemons}.log").read_text(errors="replace")

    # -- reading the cache ------------------------------------------------------------------------

    def _read(self, fn: Callable[[SampleStore], Any], default: Any = None) -> Any:
        try:
            cache = SampleStore(self.cache_dir, readonly=True)
        except CacheError:
            return default  # not created yet
        try:
            return fn(cache)
        finally:
            cache.close()

    def stats(self) -> dict[str, Any]:
        return self._read(lambda cache: collect_stats(cache), {"samples": 0, "inserted": 0})  # type: ignore[no-any-return]

    def state(self) -> dict[str, Any]:
        return self._read(lambda cache: cache.tables.get_state("daemon") or {}, {})  # type: ignore[no-any-return]

    def samplers_alive(self) -> bool:
        doc = self.state()
        samplers = doc.get("samplers") or {}
        return (self.daemon is not None and doc.get("pid") == self.daemon.pid and len(samplers) == 2
                and all(s.get("alive") for s in samplers.values()))

    def progress(self) -> tuple[int, int]:
        """(trainer batches, cache inserted)."""
        try:
            batches = int(json.loads(self.progress_path.read_text())["batches"])
        except (OSError, ValueError, KeyError):
            batches = 0
        return batches, int(self.stats()["inserted"])

    def check_bytes(self) -> None:
        s = self.stats()
        if s["bytes"] > s["capacity"] + s["headroom"]:
            self.bytes_violations.append(f"{s['bytes']} > {s['capacity']} + {s['headroom']}")

    # -- the checks after an event ----------------------------------------------------------------

    def check(self, since: float) -> list[str]:
        """Problems found after an event (empty: survived); ``since`` is when the remote was
        last healthy again (progress is due within 60 s of it)."""
        problems: list[str] = []
        self.check_bytes()
        if self.bytes_violations:
            problems.append("stored bytes over capacity + headroom: " + self.bytes_violations[-1])
        verify = subprocess.run([sys.executable, "-m", "epochcache", "verify", str(self.cache_dir)],
                                capture_output=True, text=True, check=False,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        if verify.returncode != 0:
            problems.append("verify: " + (verify.stdout + verify.stderr)[-500:])
        for session in self.dead_sessions:
            if _wait(lambda s=session: not _session_pids(s), ORPHAN_S) is None:
                problems.append(f"orphans of daemon {session}: {_session_pids(session)}")
        batches, inserted = self.progress()
        left = max(1.0, PROGRESS_S - (time.monotonic() - since))
        if _wait(lambda: self.progress()[0] > batches, left) is None:
            problems.append("training made no progress within 60 s")
        if _wait(lambda: self.progress()[1] > inserted, left) is None:
            problems.append("ingest made no progress within 60 s")
        problems += self.check_nothing_lost()
        if self.trainer is not None and self.trainer.poll() is not None:
            problems.append(f"the trainer exited with {self.trainer.returncode}")
        return problems

    def check_nothing_lost(self) -> list[str]:
        def read(cache: SampleStore) -> tuple[dict[int, tuple[str, int]], int, int]:
            present: dict[int, tuple[str, int]] = {}
            with cache.env.read() as txn:
                for raw, record in txn.cursor(db=cache.env.dbs[DB_SAMPLES]):
                    info = read_info(record)
                    present[seq_of(bytes(raw))] = (info.key, info.crc32)
            counters = cache.counters()
            return present, counters.evicted, counters.inserted

        present, evicted, inserted = self._read(read)
        problems = []
        if inserted < self.max_inserted:
            problems.append(f"inserted went back from {self.max_inserted} to {inserted}")
        self.max_inserted = max(self.max_inserted, inserted)
        oldest = min(present) if present else evicted
        lost = [seq for seq in self.seen if seq >= oldest and present.get(seq) != self.seen[seq]]
        if lost:
            problems.append(f"{len(lost)} committed samples lost or changed, e.g. seq {lost[:5]}")
        if present and sorted(present) != list(range(oldest, oldest + len(present))):
            problems.append("present samples are not one contiguous run (a sample was lost)")
        self.seen = present
        return problems

    # -- events -----------------------------------------------------------------------------------

    def kill_sampler(self) -> float:
        doc = self.state()
        victim = int(self.rng.choice(list(doc["samplers"].values()))["pid"])
        restarts = sum(s.get("restarts", 0) for s in doc["samplers"].values())
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()

        def restarted() -> bool:
            now = self.state().get("samplers", {})
            return sum(s.get("restarts", 0) for s in now.values()) > restarts and self.samplers_alive()

        if _wait(restarted, 30) is None:
            raise RuntimeError("the daemon did not restart the killed sampler within 30 s")
        return time.monotonic() - start

    def kill_daemon(self) -> float:
        assert self.daemon is not None
        session = self.daemon.pid
        os.kill(session, signal.SIGKILL)
        self.daemon.wait()
        self.dead_sessions.append(session)
        start = time.monotonic()
        if _wait(lambda: not _session_pids(session), ORPHAN_S) is None:
            raise RuntimeError(f"samplers outlived their daemon: {_session_pids(session)}")
        self.start_daemon()
        return time.monotonic() - start

    def restart_s3(self) -> float:
        """Seconds from the server's return until ingest resumes (the checks then ask for
        training and ingest progress within 60 s of its return as well)."""
        self.s3.kill()
        down_until = time.monotonic() + self.rng.uniform(3, 15)
        while time.monotonic() < down_until:
            self.check_bytes()
            time.sleep(0.5)
        inserted = self.progress()[1]
        self.s3.start()
        took = _wait(lambda: self.progress()[1] > inserted, PROGRESS_S)
        if took is None:
            raise RuntimeError("ingest did not resume within 60 s of the S3 server's return")
        return took

    def bad_objects(self) -> float:
        import s3fs

        self.bad += 1
        fs = s3fs.S3FileSystem(**self.options)
        # 700+ bytes (LMDB keys stop at 511), in segments a local file system takes (the
        # server's objects are also kept on disk, to survive its restarts).
        long_key = f"long-{self.bad}/" + "/".join(["k" * 200] * 3) + "/x.npy"
        objects = {
            f"corrupt-{self.bad}.npy": b"\x93NUMPY this is not an array",
            f"huge-{self.bad}.npy": _npy(2 * CAPACITY, 10_000 + self.bad),  # never fits
            long_key: _npy(SAMPLE_BYTES, 20_000 + self.bad),
        }
        for key, data in objects.items():
            path = self.objects / BUCKET / "ds" / key  # survives server restarts
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            fs.pipe_file(f"{BUCKET}/ds/{key}", data)
        start = time.monotonic()
        pending = {f"corrupt-{self.bad}.npy", f"huge-{self.bad}.npy"}
        cached = False

        def quarantined() -> set[str]:
            return self._read(lambda cache: {row["key"] for row in cache.quarantined(1000)}, set())  # type: ignore[no-any-return]

        def handled() -> bool:
            nonlocal cached
            # Polled often: the cache turns over in seconds, the long key may not stay long.
            cached = cached or bool(self._read(lambda cache: long_key in cache))
            return cached and pending <= quarantined()

        if _wait(handled, 90, interval_s=0.1) is None:
            raise RuntimeError(f"within 90 s: long key cached {cached}, quarantined "
                               f"{sorted(pending & quarantined())} of {sorted(pending)}")
        return time.monotonic() - start

    # -- the run ----------------------------------------------------------------------------------

    def run(self, minutes: float) -> bool:
        self.setup()
        self.check_nothing_lost()
        end = time.monotonic() + minutes * 60
        actions = {"kill sampler": self.kill_sampler, "kill daemon": self.kill_daemon,
                   "restart s3": self.restart_s3, "bad objects": self.bad_objects}
        while time.monotonic() < end:
            pause_until = time.monotonic() + self.rng.uniform(5, 20)
            while time.monotonic() < pause_until:
                self.check_bytes()
                time.sleep(0.5)
            name = self.rng.choice(EVENTS)
            tally = self.tallies[name]
            tally.count += 1
            print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)
            try:
                started = time.monotonic()
                recovery = actions[name]()
                # Progress is due within 60 s of the event's end (the server's return).
                problems = self.check(since=started + recovery if name == "restart s3"
                                      else time.monotonic())
            except (RuntimeError, OSError) as exc:
                recovery, problems = 0.0, [str(exc)]
            tally.worst_s = max(tally.worst_s, recovery)
            if problems:
                tally.failures += problems
                print("   FAILED: " + "; ".join(problems), flush=True)
            else:
                tally.survived += 1
        return self.report()

    def report(self) -> bool:
        leftovers = [pid for session in self.dead_sessions for pid in _session_pids(session)]
        if leftovers:
            self.bytes_violations.append(f"processes of killed daemons still running: {leftovers}")
        print()
        print(f"{'event':<14} {'count':>5} {'survived':>8} {'worst recovery':>15}")
        for name, tally in self.tallies.items():
            print(f"{name:<14} {tally.count:>5} {tally.survived:>8} {tally.worst_s:>14.1f}s")
        s = self.stats()
        print(f"\ncache: {s['samples']} samples, {s['inserted']} inserted, {s['evicted']} evicted, "
              f"{s['quarantined']} quarantined; daemons started {self.daemons}; trainer batches "
              f"{self.progress()[0]}")
        ok = all(t.count == t.survived for t in self.tallies.values()) and not self.bytes_violations
        failures: dict[str, Any] = {n: t.failures for n, t in self.tallies.items() if t.failures}
        if self.bytes_violations:
            failures["between events"] = self.bytes_violations
        print("all events survived; after each: bytes <= capacity + headroom, verify clean, no "
              "orphans, training and ingest progress within 60 s, nothing committed lost"
              if ok else "FAILURES: " + json.dumps(failures, indent=1))
        return ok

    def close(self) -> None:
        for proc in (self.trainer, self.daemon):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        self.s3.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the run's files here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="epochcache-soak-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        soak = Soak(workdir, args.seed)
        try:
            ok = soak.run(args.minutes)
        finally:
            soak.close()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
