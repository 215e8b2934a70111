"""``epochcache run``: per-epoch turnover (samples new to each snapshot, the fraction of the
epoch writers waited on leases) in the run log, metrics.jsonl and ``status``, the hint when
writers waited most of an epoch, and the training side's /metrics (train.metrics_port).

A real run: the daemon's samplers fill a small cache from a ``file://`` dataset much larger than
it, while a trainer takes its time over each epoch. Each epoch releases what it has trained on
(progressive release), and the samplers, far faster than the trainer, replace it during the
epoch: most of each snapshot is new, and they still wait most of the epoch (for training).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families
from test_run import cli, cli_env, read_metrics, status_json

from epochcache.demo import write_demo_data

pytestmark = pytest.mark.timeout(240)

SCRAPING_TRAINER = '''\
"""Sleeps over each batch (a slow model), and reads its own /metrics after each epoch."""
import time
import urllib.request


def train_epoch(run, epoch, loader):
    batches = 0
    for batch in loader:
        time.sleep(float(run.options["sleep_s"]))
        batches += 1
    port = run.config.train.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        (run.run_dir / f"metrics-{epoch}.txt").write_bytes(response.read())
    return {"loss": 0.0, "batches_seen": batches}
'''


def scrape_file(path: Path) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(path.read_text())
            for s in family.samples}


def test_turnover_is_reported_and_the_headroom_hint_given_once(tmp_path: Path) -> None:
    (tmp_path / "scraping_trainer.py").write_text(SCRAPING_TRAINER)
    write_demo_data((tmp_path / "data").as_uri(), 3000, "files", sample_bytes=1024)
    port = free_port()
    config = {
        "source": {"url": (tmp_path / "data").as_uri(), "pattern": "*.npy"},
        # ~180 samples fit; the headroom (10%) holds ~18, which bounded each epoch's new
        # samples before progressive release
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "200KiB", "headroom": 0.1},
        "sampler": {"processes": 1, "concurrency": 4, "batch_size": 8},
        "loader": {"batch_size": 16, "num_workers": 0},
        "train": {"epochs": 3, "min_samples": 150, "entrypoint": "scraping_trainer:train_epoch",
                  "run_dir": "run", "options": {"sleep_s": 0.5}, "metrics_port": port},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    result = cli("run", "cfg.yaml", cwd=tmp_path, env=cli_env(pythonpath=tmp_path))
    assert result.returncode == 0, result
    logs = result.stdout + result.stderr

    rows = read_metrics(tmp_path / "run")
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    first, later = rows[0], rows[1:]
    assert first["new_samples"] == first["snapshot_samples"] > 0  # everything is new at first
    for row in later:
        # What the previous epoch trained on was replaced while it ran: far more than the
        # headroom's ~18 samples (the bound before progressive release).
        assert row["new_samples"] > 100, row
        assert row["snapshot_samples"] >= 150
        assert row["writer_wait_fraction"] > 0.5, row  # the samplers wait for training
    assert "new to the snapshot" in logs and "writers waited" in logs
    # The hint: once, saying why the samplers waited and that headroom would not help.
    assert logs.count("faster than training uses them up") == 1, logs[-4000:]
    assert "a larger cache.headroom would not bring more" in logs

    stats = status_json(tmp_path / "cache", tmp_path)
    assert [row["epoch"] for row in stats["turnover"]] == [0, 1, 2]
    assert stats["turnover"][-1]["new_samples"] == rows[-1]["new_samples"]
    assert stats["turnover"][-1]["writer_wait_fraction"] == rows[-1]["writer_wait_fraction"]

    # The training side's /metrics, as the trainer read it after epochs 0 and 2.
    after0, after2 = (scrape_file(tmp_path / "run" / f"metrics-{n}.txt") for n in (0, 2))
    assert after0["epochcache_train_epoch"] == 0 and after2["epochcache_train_epoch"] == 2
    assert after0["epochcache_train_batches_total"] == rows[0]["batches_seen"]
    assert after2["epochcache_train_batches_total"] == sum(r["batches_seen"] for r in rows)
    assert after2["epochcache_train_samples_total"] == sum(r["snapshot_samples"] for r in rows)
    assert 0 <= after2["epochcache_train_data_wait_seconds_total"] < 30
    assert after2["epochcache_train_epoch_new_samples"] == rows[1]["new_samples"]  # epoch 1's


def test_train_metrics_port_without_prometheus_client_exits_2(tmp_path: Path) -> None:
    fake = tmp_path / "no_prometheus"
    fake.mkdir()
    (fake / "prometheus_client.py").write_text("raise ImportError('not installed (simulated)')\n")
    config = {
        "source": {"url": (tmp_path / "data").as_uri()},
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "1MiB"},
        "train": {"metrics_port": free_port()},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    result = cli("run", "cfg.yaml", cwd=tmp_path, env=cli_env(pythonpath=fake), timeout_s=60)
    assert result.returncode == 2, result
    assert "train.metrics_port: serving /metrics needs prometheus-client" in result.stderr
    assert not (tmp_path / "cache").exists()  # nothing was started
