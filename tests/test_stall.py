"""Stall watchdog: a slow sample dumps the stalled process's stacks and names the sample key."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from common.writer import fill
from epochcache import Cache


def _slow_on_seven(x: np.ndarray) -> np.ndarray:
    if int(x[0]) == 7:
        time.sleep(1.5)  # a "stuck" transform
    return x


def test_slow_sample_in_a_worker_reports_stack_and_key(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 16)
    cache = Cache(tmp_path / "c", sync=False)
    report = tmp_path / "stall.log"
    for _epoch, loader in cache.epochs(1, batch_size=4, num_workers=1, transform=_slow_on_seven,
                                       stall_s=0.4, stall_file=str(report), shuffle=False,
                                       multiprocessing_context="spawn"):
        assert sum(len(b) for b in loader) == 16
    text = report.read_text()
    assert "STALL in DataLoader worker 0" in text
    assert "s/0000007.npy" in text  # the key it was on
    assert "_slow_on_seven" in text and "test_stall.py" in text  # the faulthandler stack
    assert "finished after" in text


def test_slow_sample_in_process(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 8)
    cache = Cache(tmp_path / "c", sync=False)
    report = tmp_path / "stall.log"
    with cache.dataset(transform=_slow_on_seven, stall_s=0.4, stall_file=str(report)) as ds:
        assert int(ds[7][0]) == 7
    text = report.read_text()
    assert "STALL in training process" in text and "s/0000007.npy" in text
    assert "_slow_on_seven" in text
