"""The image demo end to end: ``epochcache run configs/demo.yaml`` as a subprocess on a fresh
directory writes JPEG shards, the rate-limited sampler grows the cache, which then fills and turns
over, and the CNN learns without reaching 100%.

The default test runs the real configs/demo.yaml made smaller (1,500 images, an 800 KiB cache,
12 short epochs: ~10 s); the slow one runs it exactly as shipped (about a minute), and checks
the data wait too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_run import Result, assert_no_traceback, assert_png, cli, write_yaml

REPO = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(
    r"epoch (\d+): loss ([\d.]+), .* data wait ([\d.]+)%, cache [^(]+\((\d+) samples\), "
    r"evicted (\d+)")


def _demo_config(**changes: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for section, values in changes.items():
        config[section].update(values)
    return config


def _epoch_lines(result: Result) -> list[tuple[int, float, float, int, int]]:
    rows = []
    for line in (result.stderr + result.stdout).splitlines():
        match = EPOCH_LINE.search(line)
        if match:
            epoch, loss, wait, samples, evicted = match.groups()
            rows.append((int(epoch), float(loss), float(wait), int(samples), int(evicted)))
    return rows


def _check_run(workdir: Path, result: Result, epochs: int, grows: bool) -> list[dict[str, Any]]:
    assert result.returncode == 0, result
    assert_no_traceback(result)
    assert sorted((workdir / "demo-data" / "shapes").glob("shard-*.tar")), "no shards written"
    lines = _epoch_lines(result)
    assert [row[0] for row in lines] == list(range(epochs)), result
    samples = [row[3] for row in lines]
    evicted = [row[4] for row in lines]
    if grows:
        # Throttled (the shipped demo), the cache grows over the first epoch(s), then is capped
        # and evicts. Unthrottled, whether it is already full when epoch 0's snapshot is taken
        # depends on the machine's load (it was, beside two busy processes).
        assert samples[0] < max(samples), lines
    assert samples[0] >= 100, lines  # train.min_samples
    first_eviction = next((i for i, count in enumerate(evicted) if count), None)
    assert first_eviction is not None, lines
    capped = samples[first_eviction:]  # full: within a shard's commit of capacity + headroom
    assert min(capped) >= 0.85 * max(samples), lines
    # Continuous turnover: once full, every epoch evicts what the last one trained on while the
    # sampler keeps ingesting (before progressive release only at epoch boundaries, and only
    # the headroom's worth).
    assert all(count > 0 for count in evicted[first_eviction + 1 :]), lines
    metrics = [json.loads(line) for line in
               (workdir / "runs" / "demo" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [row["accuracy"] for row in metrics]
    losses = [row["loss"] for row in metrics]
    assert 0.3 <= accuracy[-1] and all(a <= 0.999 for a in accuracy), accuracy
    assert accuracy[-1] > accuracy[0] and losses[-1] < losses[0], metrics
    assert_png(workdir / "runs" / "demo" / "run.png")
    return metrics


@pytest.mark.timeout(480)
def test_image_demo_fills_turns_over_and_learns(tmp_path: Path) -> None:
    # Made small, with wide margins whatever the machine's load: training starts at 100 images
    # (one shard), an unthrottled sampler fills capacity + headroom (~400 images) a shard at a
    # time within a few seconds, and 12 epochs of 600 samples (0.2-1 s each) go on well past
    # that, turning the cache over (1,500 images, ~360 fit). Accuracy reached 0.43-0.47 by
    # epoch 10 in trials (the test asks for 0.3).
    config = _demo_config(
        source={"demo_samples": 1500},
        cache={"capacity": "800KiB"},  # ~360 images
        sampler={"bandwidth_limit": None},  # one shard of 100 images at a time
        loader={"num_workers": 0},
        train={"epochs": 12, "min_samples": 100, "samples_per_epoch": 600,
               "options": {"lr": 0.005, "size": 32, "width": 12, "min_scale": 0.5}},
    )
    write_yaml(tmp_path / "demo.yaml", config)
    # ~10 s on an idle 2-core machine (24 epochs of 1,000 took 138 s beside a suite and two CPU
    # hogs): a deadline, not a speed target.
    result = cli("run", "demo.yaml", cwd=tmp_path, timeout_s=420)
    _check_run(tmp_path, result, 12, grows=False)


@pytest.mark.slow
def test_shipped_demo_config(tmp_path: Path) -> None:
    write_yaml(tmp_path / "demo.yaml", (REPO / "configs" / "demo.yaml").read_text())
    result = cli("run", "demo.yaml", cwd=tmp_path, timeout_s=300)
    metrics = _check_run(tmp_path, result, 6, grows=True)
    # The loader keeps up once the first epoch has started its workers.
    assert all(row["data_wait_fraction"] < 0.10 for row in metrics[1:]), metrics
