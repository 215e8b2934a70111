"""Stall watchdog: a slow sample dumps the stalled process's stacks and names the sample key.

These batches are slow, not stuck: ``stall_action="warn"`` reports and goes on (the default,
``raise``, ends the job: tests/test_stall_raise.py)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
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
                                       multiprocessing_context="spawn", stall_action="warn"):
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
    with cache.dataset(transform=_slow_on_seven, stall_s=0.4, stall_file=str(report),
                       stall_action="warn") as ds:
        assert int(ds[7][0]) == 7
    text = report.read_text()
    assert "STALL in training process" in text and "s/0000007.npy" in text
    assert "_slow_on_seven" in text


def test_slow_read_on_the_raw_npy_fast_path_names_the_key(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The fast path stores only the record's LMDB key per sample; the report resolves it.
    # Raw 4 KiB arrays take that path; the stall is injected into its per-record check (the
    # one call in the loop besides LMDB's get) for sample 7, standing in for a page fault on a
    # stuck disk.
    from epochcache.data.raw import NpyTemplate
    from epochcache.store.records import HEADER

    fill(str(tmp_path / "c"), 0, 16, floats=1024)
    cache = Cache(tmp_path / "c", sync=False)
    report = tmp_path / "stall.log"
    real_of = NpyTemplate.of

    def slow_template(record: memoryview) -> NpyTemplate | None:
        template = real_of(record)
        if template is not None:
            real_check, key_end = template.check, template.lo + 4

            def slow_check(record: memoryview) -> tuple[object, ...]:
                if bytes(record[HEADER.size : key_end]).endswith(b"0000007.npy"):
                    time.sleep(1.5)
                return real_check(record)

            template.check = slow_check
        return template

    monkeypatch.setattr(NpyTemplate, "of", staticmethod(slow_template))
    for _epoch, loader in cache.epochs(1, batch_size=4, stall_s=0.4, stall_file=str(report),
                                       shuffle=False, stall_action="warn"):
        batches = list(loader)
        assert len(batches) == 4 and isinstance(batches[0], torch.Tensor)  # the fast path
    text = report.read_text()
    assert "STALL in training process" in text and "'s/0000007.npy'" in text
    assert "slow_check" in text and "_read_npy_batch" in text  # the stack shows where


def test_a_key_that_cannot_be_resolved_still_gets_a_report() -> None:
    from epochcache.data.stall import Activity

    activity = Activity("batch")
    activity.key, activity.resolve = b"\x00" * 8, lambda token: 1 / 0  # type: ignore[assignment]
    assert "ZeroDivisionError" in activity.describe_key()
    activity.resolve = lambda token: "a/b.npy"
    assert activity.describe_key() == "'a/b.npy'"


SLOW_START = """\
import time
time.sleep(3.0)  # a heavy import in each spawned worker (a model, a tokenizer, CUDA)


def identity(x):
    return x
"""


def test_a_stall_report_during_a_workers_start_up_does_not_kill_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stall report asks each worker for its stacks with a real-time signal, whose default
    action ends a process: a spawned worker still importing (its handler not yet armed) was
    killed by the report ('DataLoader worker exited unexpectedly', seen on a busy machine).
    The report skips a worker that cannot answer yet and says so; with ``warn`` the epoch
    then trains."""
    (tmp_path / "slow_start_mod.py").write_text(SLOW_START)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the spawned worker imports it too
    import slow_start_mod  # type: ignore[import-not-found]

    fill(str(tmp_path / "c"), 0, 8)
    cache = Cache(tmp_path / "c", sync=False)
    report = tmp_path / "stall.log"
    for _epoch, loader in cache.epochs(1, batch_size=4, num_workers=1,
                                       transform=slow_start_mod.identity, stall_s=0.5,
                                       stall_file=str(report), shuffle=False,
                                       multiprocessing_context="spawn", stall_action="warn"):
        assert sum(len(b) for b in loader) == 8
    text = report.read_text()
    assert "STALL in training process" in text
    assert "cannot dump its stacks yet" in text, text[-3000:]
