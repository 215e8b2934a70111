"""Several jobs, one cache (issue 28, item 5): a sweep of training jobs on one node sharing
one daemon and cache.

Two ``epochcache run`` jobs, one fast and one slow, attach to one ``epochcache daemon`` (real
processes). Each keeps its own snapshots and leases; the cache keeps turning over while the
slow job is mid-epoch (eviction waits for it only for the samples it has not read yet, which
it then reads, never missing one); ``status`` shows each job with its pid, run directory,
epoch and the samples it still protects; each job's metrics say what turnover it saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.daemonproc import wait_running
from test_run import cli_env
from test_run_resume import _dataset

pytestmark = pytest.mark.timeout(300)

TRAINER = '''\
"""Reads every batch of the epoch, slowly as options.sleep_s says; at options.hold's epoch
and batch it waits for the test's go-file (so that the test sees it there, however busy the
machine)."""
import os
import time


def train_epoch(run, epoch, loader):
    batches = 0
    hold = run.options["hold"]
    for batch in loader:
        batches += 1
        if epoch == hold["epoch"] and batches == hold["batch"]:
            deadline = time.monotonic() + 200
            while not os.path.exists(hold["file"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(float(run.options["sleep_s"]))
    return {"loss": 0.0, "batches_read": batches}
'''


def _config(tmp_path: Path, name: str, epochs: int, sleep_s: float,
            hold_at: tuple[int, int]) -> Path:
    config = {
        "source": {"url": (tmp_path / "data").as_uri(), "pattern": "*.npy"},
        # ~200 samples of ~200 B; the daemon brings ~20 a second: the cache turns over
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "40KiB", "headroom": 0.05},
        "sampler": {"processes": 1, "concurrency": 4, "batch_size": 8,
                    "bandwidth_limit": "4KB"},
        "loader": {"batch_size": 10, "num_workers": 0},
        "train": {"epochs": epochs, "min_samples": 150, "entrypoint": "sweep_trainer:train_epoch",
                  "run_dir": str(tmp_path / name), "seed": len(name),
                  "options": {"sleep_s": sleep_s, "hold": {
                      "epoch": hold_at[0], "batch": hold_at[1],
                      "file": str(tmp_path / f"{name}.go")}}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _status(tmp_path: Path) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "epochcache", "status", str(tmp_path / "cache"),
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_runs_share_one_daemon_and_cache(tmp_path: Path, start_daemon: Any) -> None:
    _dataset(tmp_path / "data", 600)
    (tmp_path / "sweep_trainer.py").write_text(TRAINER)
    # Each job holds at one batch until the test has seen what it looks for there: the fast
    # one in epoch 0 until status showed it (its 8 epochs take ~2 s: status calls on a busy
    # machine missed it), the slow one mid-epoch 1 until the cache turned over under it.
    fast_cfg = _config(tmp_path, "fast", epochs=8, sleep_s=0.01, hold_at=(0, 1))
    slow_cfg = _config(tmp_path, "slow", epochs=3, sleep_s=0.25, hold_at=(1, 5))
    daemon = start_daemon(fast_cfg)  # the node's daemon, shared by both jobs
    wait_running(daemon, tmp_path / "cache")
    env = cli_env(pythonpath=tmp_path)
    jobs = {name: subprocess.Popen([sys.executable, "-m", "epochcache", "run", str(cfg)],
                                   cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, cfg in (("slow", slow_cfg), ("fast", fast_cfg))}
    try:
        seen: dict[str, dict[str, Any]] = {}
        evicted_during_slow_epoch = False
        deadline = time.monotonic() + 240
        held_at: int | None = None  # evictions when the slow job was seen held mid-epoch 1
        while any(job.poll() is None for job in jobs.values()):
            assert time.monotonic() < deadline, "the jobs did not finish"
            stats = _status(tmp_path)
            for job in stats["jobs"]:
                name = Path(str(job.get("run_dir", ""))).name
                if name in jobs and job["pid"] == jobs[name].pid:
                    seen.setdefault(name, job)
                    if name == "fast":
                        (tmp_path / "fast.go").touch()
                    if name == "slow" and job["epoch"] == 1 and job["unread"] > 0:
                        # The slow job is mid-epoch, protecting what it has not read: the
                        # cache turns over all the same (what it read, and what the fast
                        # job's snapshots no longer need, is evicted).
                        if held_at is None:
                            held_at = stats["evicted"]
                        elif stats["evicted"] > held_at:
                            evicted_during_slow_epoch = True
                            (tmp_path / "slow.go").touch()
            time.sleep(0.3)
        outputs = {name: job.communicate(timeout=60) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait(30)
    for name, job in jobs.items():
        assert job.returncode == 0, f"{name}: {outputs[name][1][-4000:]}"
        assert "attaching to the daemon" in outputs[name][1]
    assert set(seen) == {"fast", "slow"}, seen  # status showed each job, by its pid
    assert seen["slow"]["pid"] != seen["fast"]["pid"]
    assert evicted_during_slow_epoch
    fast, slow = _metrics(tmp_path / "fast"), _metrics(tmp_path / "slow")
    assert [row["epoch"] for row in fast] == list(range(8))
    assert [row["epoch"] for row in slow] == list(range(3))
    # Every batch of every epoch was read: nothing a job had not read was evicted under it.
    for row in fast + slow:
        assert row["batches_read"] == row["batches"] > 0
    # Each job sees the cache turn over: its later epochs train on samples its earlier ones
    # had not (the fast one sees fewer new ones per epoch: ingest is shared, epochs short).
    assert sum(row["new_samples"] for row in slow[1:]) > 0
    assert sum(row["new_samples"] for row in fast[1:]) > 0
