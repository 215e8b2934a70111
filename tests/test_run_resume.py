"""``epochcache run`` with ``train.checkpoint_every_s``: SIGKILL of the whole job mid-epoch,
then ``--resume``, continues the interrupted epoch exactly where its last checkpoint was: the
same snapshot, the same order, none of the samples before it again, none skipped, while the
daemon keeps turning the cache over (issue 21, item 4). Under torchrun with two ranks, both
resume at the same position with equal batch counts.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from common.procs import Job
from test_run import cli, cli_env

pytestmark = pytest.mark.timeout(300)

TRAINER = '''\
"""Logs each epoch's order and each batch's sample ids; dies where DIE_AT says."""
import json, os, sys, time
import torch


def _id(cache, seq):
    return int(cache.info(int(seq)).key.split("/")[-1].split(".")[0])


def train_epoch(run, epoch, loader):
    rank = int(os.environ.get("RANK", "0"))
    model = run.state.get("model") or run.restore("model", torch.nn.Linear(16, 1))
    opt = run.state.get("opt") or run.restore(
        "opt", torch.optim.SGD(model.parameters(), lr=0.01))
    cache = loader.dataset.reader.cache
    with open(os.path.join(run.options["log"], f"rank{rank}.jsonl"), "a") as log:
        log.write(json.dumps({"epoch": epoch, "order": [_id(cache, s) for s in loader.seqs],
                              "pid": os.getpid()}) + "\\n")
        die = os.environ.get("DIE_AT", "")
        for i, batch in enumerate(loader):
            log.write(json.dumps({"epoch": epoch, "batch": i,
                                  "ids": [int(v) for v in batch[:, 0]]}) + "\\n")
            log.flush()
            loss = model(torch.nan_to_num(batch.float())).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.05)
            if die == f"{epoch}:{i}":
                # One write: two ranks share the pipe, and print() writes "DIE" and its
                # newline separately under python -u ("DIEDIE\\n\\n" was read as one DIE).
                sys.stdout.write("DIE\\n")
                sys.stdout.flush()
                time.sleep(600)
    return {"loss": float(loss)}
'''


def _dataset(root: Path, count: int) -> None:
    root.mkdir(parents=True)
    for i in range(count):
        buf = io.BytesIO()
        np.save(buf, np.full(16, i, dtype=np.float32))
        (root / f"{i:06d}.npy").write_bytes(buf.getvalue())


def _config(tmp_path: Path) -> Path:
    config = {
        "source": {"url": (tmp_path / "data").as_uri(), "pattern": "*.npy"},
        # ~200 samples of ~200 B: the daemon keeps evicting what the epochs release
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "40KiB", "headroom": 0.05},
        "sampler": {"processes": 1, "concurrency": 4, "batch_size": 8,
                    "bandwidth_limit": "4KB"},
        "loader": {"batch_size": 10, "num_workers": 0},
        "train": {"epochs": 3, "min_samples": 150, "entrypoint": "resume_trainer:train_epoch",
                  "run_dir": str(tmp_path / "run"), "checkpoint_every_s": 0.2,
                  "options": {"log": str(tmp_path / "logs")}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rows(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _start(argv: list[str], tmp_path: Path, env: dict[str, str]) -> Job:
    return Job(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               text=True)


def _wait_to_die(job: Job, ranks: int) -> None:
    """Wait until every rank printed DIE, then SIGKILL the whole job (a node failure): every
    process of it, torchrun's ranks in their own sessions and the daemon's samplers too
    (``killpg`` of torchrun's group left the ranks running through the resume)."""
    proc = job.popen
    assert proc.stdout is not None
    seen = 0
    try:
        while seen < ranks:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"the run exited {proc.returncode}:\n"
                                     f"{proc.stderr.read()[-4000:]}")
            seen += line.count("DIE")
    finally:
        job.kill()


def _check_rank(log: Path, epoch: int, checkpoint: dict[str, Any], rank: int) -> int:
    rows = _rows(log)
    first_pid = rows[0]["pid"]
    order = next(r["order"] for r in rows if r.get("epoch") == epoch and "order" in r)
    before = [r for r in rows if r.get("epoch") == epoch and "ids" in r]
    resumed_at = next(i for i, r in enumerate(rows) if "pid" in r and r["pid"] != first_pid)
    after = [r for r in rows[resumed_at:] if r.get("epoch") == epoch and "ids" in r]
    state = checkpoint["resume"]["loaders"][str(rank)]
    done = checkpoint["resume"]["batches"]
    assert state["position"] == done * 10 and len(before) > done  # the kill came after it
    kept = [i for r in before[:done] for i in r["ids"]]
    redone = [i for r in after for i in r["ids"]]
    # Exactly the samples after the checkpoint, in the same order: none again, none skipped.
    assert kept + redone == order, (len(kept), len(redone), len(order))
    return len(after)


def test_sigkill_mid_epoch_then_resume_continues_exactly(tmp_path: Path) -> None:
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    env = cli_env({"DIE_AT": "1:12"}, pythonpath=tmp_path)
    run = _start([sys.executable, "-m", "epochcache", "run", str(config)], tmp_path, env)
    _wait_to_die(run, 1)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["resume"]["epoch"] == 1
    time.sleep(1.0)  # what nothing protects may be evicted meanwhile (a new daemon starts)
    result = cli("run", str(config), "--resume", cwd=tmp_path,
                 env=cli_env(pythonpath=tmp_path))
    assert result.returncode == 0, result
    _check_rank(tmp_path / "logs" / "rank0.jsonl", 1, checkpoint, 0)
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in metrics] == [0, 1, 2]


def test_two_ranks_resume_at_the_same_position(tmp_path: Path) -> None:
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "epochcache", "run", str(config)]
    env = cli_env({"DIE_AT": "1:6"}, pythonpath=tmp_path)
    job = _start(argv, tmp_path, env)
    _wait_to_die(job, 2)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert sorted(checkpoint["resume"]["loaders"]) == ["0", "1"]
    resumed = _start([*argv, "--resume"], tmp_path, cli_env(pythonpath=tmp_path))
    try:
        out, err = resumed.popen.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        resumed.kill()
        out, err = resumed.popen.communicate()
        raise AssertionError(f"the resumed job hung:\n{err[-4000:]}") from None
    assert resumed.popen.returncode == 0, err[-4000:]
    assert resumed.procs() == []  # it ended with all its processes
    counts = [_check_rank(tmp_path / "logs" / f"rank{rank}.jsonl", 1, checkpoint, rank)
              for rank in (0, 1)]
    assert counts[0] == counts[1]  # equal batch counts after the resume
