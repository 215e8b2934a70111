"""`epochcache run` under torchrun: one node with two ranks sharing the node's cache.

torchrun (``python -m torch.distributed.run --standalone``) starts two real ranks with the gloo
backend. Only local rank 0 runs the node's daemon, only rank 0 writes the run directory, every
rank trains the same number of batches, and the loss still falls.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_run import RUN_TIMEOUT_S, cli_env, demo_config, read_metrics, status_json, write_yaml


def test_run_under_torchrun_two_ranks_share_one_daemon(tmp_path: Path) -> None:
    config = demo_config(tmp_path, train={"epochs": 2, "min_samples": 300})
    cfg = write_yaml(tmp_path / "ddp.yaml", config)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "epochcache", "run", str(cfg),
    ]
    proc = subprocess.run(
        argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S * 2
    )
    output = f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, output
    assert "joined the torchrun job: rank 1 of 2" in proc.stdout + proc.stderr, output

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
