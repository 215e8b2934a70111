"""`epochcache run` under torchrun: one node with two ranks sharing the node's cache.

torchrun (``python -m torch.distributed.run --standalone``) starts two real ranks with the gloo
backend. Only local rank 0 runs the node's daemon, only rank 0 writes the run directory, every
rank trains the same number of batches, and the loss still falls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run import RUN_TIMEOUT_S, demo_config, read_metrics, status_json, torchrun, write_yaml


def test_run_under_torchrun_two_ranks_share_one_daemon(tmp_path: Path) -> None:
    """Also: what concerns the node is said once, not by every rank (issue 37, item 4: one
    warning 16 times in the two-node simulation of docs/howto/multi-node.md): a cache
    directory others can read, a source smaller than ``train.min_samples``."""
    config = demo_config(tmp_path, source={"demo_samples": 400},
                         train={"epochs": 2, "min_samples": 500})
    (tmp_path / "demo-cache").mkdir(mode=0o755)
    (tmp_path / "demo-cache").chmod(0o755)
    cfg = write_yaml(tmp_path / "ddp.yaml", config)
    status, output = torchrun(cfg, cwd=tmp_path, timeout_s=RUN_TIMEOUT_S * 2)
    assert status == 0, output[-8000:]
    assert "joined the torchrun job: rank 1 of 2" in output, output[-8000:]
    assert output.count("the whole source (this node's share of it) is cached") == 1, output
    assert output.count("is readable by other users") == 1, output

    rows = read_metrics(tmp_path / "runs/demo")
    assert [row["epoch"] for row in rows] == [0, 1], rows  # written once, by rank 0
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    # Each rank trained its half of the node's snapshot: fewer batches than the whole would take.
    for row in rows:
        assert 0 < row["batches"] <= -(-row["snapshot_samples"] // 64), row

    stats = status_json(tmp_path / "demo-cache", cwd=tmp_path)
    daemon = stats["daemon"]
    assert daemon is not None and daemon["stopped"], json.dumps(daemon)
    assert len(daemon["samplers"]) == 1  # one daemon for the node (sampler.processes: 1)
    assert stats["leases"] == 0 and stats["samples"] > 0


@pytest.mark.slow  # two torchrun jobs, 32 CPU seconds; test_ddp_failures resumes ranks from rank 0's checkpoint
def test_resume_without_a_shared_run_dir_agrees_on_rank_0s_checkpoint(tmp_path: Path) -> None:
    """Each rank has its own run directory (as on nodes without a shared filesystem): only rank
    0's holds the checkpoint. Rank 1 started again at epoch 0 while rank 0 resumed at 1, and
    the two waited for each other's epochs forever."""
    config = demo_config(tmp_path, train={"epochs": 2, "min_samples": 300,
                                          "run_dir": "runs/r${LOCAL_RANK}"})
    cfg = write_yaml(tmp_path / "ddp.yaml", config)
    status, logs = torchrun(cfg, "--epochs", "1", cwd=tmp_path, timeout_s=RUN_TIMEOUT_S)
    assert status == 0, logs[-4000:]
    assert not (tmp_path / "runs/r1/checkpoint.pt").exists()  # rank 1 writes nothing
    status, logs = torchrun(cfg, "--resume", cwd=tmp_path, timeout_s=90)
    assert status == 0, logs[-6000:]
    assert [row["epoch"] for row in read_metrics(tmp_path / "runs/r0")] == [0, 1]
    # Which checkpoint each node used is in the log: rank 1 received rank 0's.
    assert "--resume: epoch 1 from rank 0's checkpoint" in logs, logs[-6000:]
    assert "rank 0 (node 0) read it; rank 1 (node 0) received it from rank 0" in logs, logs[-6000:]


@pytest.mark.slow
def test_run_under_torchrun_twenty_times_without_an_abort(tmp_path: Path) -> None:
    """The torchrun run of the first test, 20 times. It used to fail about 1 run in 6: rank 1
    aborted at exit ("terminate called without an active exception") when a background thread
    of epochs() dropped the last reference to the gloo process groups while the main thread
    finalized the interpreter. Process groups are now destroyed and dropped on the training
    thread, and epochs()' background lanes hold no task while idle and are joined."""
    failures = []
    for i in range(20):
        workdir = tmp_path / f"run{i}"
        config = demo_config(workdir, train={"epochs": 2, "min_samples": 300})
        if i:  # one demo dataset for all runs (absolute path): each run its own cache
            config["source"]["url"] = str(tmp_path / "run0" / "demo-data" / "tar")
        status, logs = torchrun(write_yaml(workdir / "ddp.yaml", config), cwd=workdir,
                                timeout_s=RUN_TIMEOUT_S)
        if status != 0 or "terminate called" in logs:
            failures.append(f"run {i}: exit {status}\n{logs[-3000:]}")
    assert not failures, f"{len(failures)} of 20 runs failed:\n" + "\n".join(failures)
