"""``epochcache run --resume`` on another number of ranks per node (issue 28, item 1).

A job under torchrun checkpoints mid-epoch (``train.checkpoint_every_s``) and every process of
it is killed (torchrun starts its ranks in sessions of their own: the whole process tree is
killed, and none is left); the daemon keeps turning the cache over while the job is down. It
comes back with another ``--nproc-per-node``: what all ranks trained in the interrupted epoch
before the checkpoint and after the resume is the node's epoch exactly once, and every rank of
the resumed job trains the same number of batches. On e3fb5d3 the epoch started afresh ("was
checkpointed mid-epoch by 2 ranks, this run has 1").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from common.procs import Job
from conftest import free_port
from test_run import cli_env, torchrun
from test_run_resume import TRAINER, _config, _dataset, _rows

from epochcache.coverage.manifests import epoch_keys

pytestmark = pytest.mark.timeout(400)


def _start(nproc: int, config: Path, tmp_path: Path, die_at: str) -> Job:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "-m", "epochcache", "run", str(config)]
    return Job(argv, cwd=tmp_path, env=cli_env({"DIE_AT": die_at}, pythonpath=tmp_path),
               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_to_die(job: Job, ranks: int) -> None:
    proc = job.popen
    assert proc.stdout is not None
    seen, lines = 0, []
    try:
        while seen < ranks:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"the run exited {proc.returncode}:\n"
                                     + "".join(lines[-60:]))
            lines.append(line)
            seen += line.count("DIE")
    finally:
        job.kill()  # every process of the job (torchrun's ranks have sessions of their own)


def _lines(log: Path) -> list[dict[str, Any]]:
    return _rows(log) if log.exists() else []


def _epoch(rows: list[dict[str, Any]], epoch: int) -> tuple[list[int], list[list[int]]]:
    """A rank's lane in ``epoch`` and the batches it trained of it, from its log rows."""
    lane = next((r["order"] for r in rows if r.get("epoch") == epoch and "order" in r), [])
    return lane, [r["ids"] for r in rows if r.get("epoch") == epoch and "ids" in r]


@pytest.mark.parametrize(("before", "after"), [
    (2, 1),
    pytest.param(1, 2, marks=pytest.mark.slow),
])
def test_resume_on_another_number_of_ranks_trains_the_epoch_once(
        tmp_path: Path, before: int, after: int) -> None:
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    settings = yaml.safe_load(config.read_text())
    settings["train"]["epochs"] = 2  # killed in epoch 1; the resumed run ends with it
    config.write_text(yaml.safe_dump(settings))
    job = _start(before, config, tmp_path, "1:6" if before > 1 else "1:12")
    _wait_to_die(job, before)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    mid: dict[str, Any] = checkpoint["resume"]
    assert mid["epoch"] == 1 and sorted(mid["loaders"]) == [str(r) for r in range(before)]
    ranks = max(before, after)
    logs = [tmp_path / "logs" / f"rank{r}.jsonl" for r in range(ranks)]
    written = [len(_lines(log)) for log in logs]  # the resumed job appends to these
    time.sleep(1.0)  # what nothing protects may be evicted meanwhile (a new daemon starts)
    status, output = torchrun(config, "--resume", cwd=tmp_path, nproc=after, timeout_s=240,
                              pythonpath=tmp_path)
    assert status == 0, output[-6000:]

    was = [_epoch(_lines(log)[:n], 1) for log, n in zip(logs[:before], written)]
    now = [_epoch(_lines(log)[n:], 1)[1] for log, n in zip(logs[:after], written)]
    epoch = sorted(i for lane, _batches in was for i in lane)  # the node's epoch
    done = mid["batches"]
    assert all(len(batches) > done for _lane, batches in was)  # killed after the checkpoint
    kept = [i for _lane, batches in was for batch in batches[:done] for i in batch]
    redone = [i for batches in now for batch in batches for i in batch]
    # Each sample of the interrupted epoch once: none twice, none skipped.
    assert sorted(kept + redone) == epoch, (len(kept), len(redone), len(epoch))
    counts = {len(batches) for batches in now}
    assert len(counts) == 1 and counts != {0}, counts  # equal batch counts, none empty
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in metrics] == [0, 1]
    row = metrics[1]
    assert row["resume_continued"] == len(redone) and row["resume_departed"] == 0
    assert row["resume_batches"] == counts.pop()
    # The epoch's manifest (every rank's file) lists each sample once: what the ranks kept
    # before the stop and what the resumed ranks trained (issue 33, item 5: after 2 -> 1 it
    # dropped every key the continuing rank had trained before the stop).
    listed = [int(key.split(".")[0]) for key in epoch_keys(tmp_path / "run", 1)]
    assert sorted(listed) == epoch, (len(listed), len(set(listed)), len(epoch))
    for rank in range(max(before, after)):
        mine = [int(key.split(".")[0]) for key in epoch_keys(tmp_path / "run", 1, rank)]
        kept_mine = [i for batch in was[rank][1][:done] for i in batch] if rank < before else []
        now_mine = [i for batch in now[rank] for i in batch] if rank < after else []
        assert mine == kept_mine + now_mine, (rank, len(mine), len(kept_mine), len(now_mine))


@pytest.mark.slow
def test_two_nodes_to_one_counts_the_departed_nodes_rest(tmp_path: Path) -> None:
    """Two nodes (two torchrun agents, a cache each) killed mid-epoch; the job comes back on
    node 0 alone: node 0 trains its rest once, node 1's rest (its disk is gone) is counted in
    the log and in metrics.jsonl."""
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    settings = yaml.safe_load(config.read_text())
    settings["train"]["epochs"] = 2
    settings["cache"]["dir"] = str(tmp_path / "cache${GROUP_RANK:-0}")  # a cache per node
    config.write_text(yaml.safe_dump(settings))
    port = free_port()
    nodes = []
    for node in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--master-port", str(port), "-m", "epochcache", "run", str(config)]
        nodes.append(Job(argv, cwd=tmp_path, env=cli_env({"DIE_AT": "1:6"},
                                                          pythonpath=tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        _wait_to_die(nodes[0], 1)
    finally:
        for job in nodes[1:]:
            job.kill()
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    mid: dict[str, Any] = checkpoint["resume"]
    assert sorted(mid["loaders"]) == ["0", "1"]
    gone = mid["loaders"]["1"]
    shutil.rmtree(tmp_path / "cache1")  # node 1 does not come back
    logs = [tmp_path / "logs" / f"rank{r}.jsonl" for r in range(2)]
    written = len(_lines(logs[0]))
    status, output = torchrun(config, "--resume", cwd=tmp_path, nproc=1, timeout_s=240,
                              pythonpath=tmp_path)
    assert status == 0, output[-6000:]

    lane, batches = _epoch(_lines(logs[0])[:written], 1)
    _lane, now = _epoch(_lines(logs[0])[written:], 1)
    kept = [i for batch in batches[: mid["batches"]] for i in batch]
    assert sorted(kept + [i for batch in now for i in batch]) == sorted(lane)
    rest = gone["lane"] - gone["position"]
    assert rest > 0
    row = [json.loads(line) for line in
           (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert row["resume_departed"] == rest and row["resume_departed_nodes"] == 1
    assert f"{rest} samples of the interrupted epoch were left on 1 node that" in output, (
        output[-4000:])
