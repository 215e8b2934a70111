"""Repeated stop signals never cut a run's stop short, nor lose its checkpoint (issue 33, item 1).

Under a scheduler every rank gets SIGTERM more than once: Slurm signals every process of a job
(a cancel, a time limit, a requeue, ``scancel --signal`` of an ``srun`` step) and torchrun
forwards the SIGTERM it got to each rank again. The second one used to end the rank at once
(SIGTERM's default action was put back by the first), before the checkpoint of its stop: the
resume went back to the last periodic checkpoint and trained those batches twice. These tests
signal a real ``epochcache run`` twice, directly (tests/test_slurm.py does it through Slurm).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common.jobs import wait_for
from common.preempt import COMMON, check_exactly_once, holding, metrics_epochs, rows, write_config
from common.procs import Job
from test_run import cli, cli_env

from epochcache.run.signals import StopSignals

pytestmark = pytest.mark.timeout(300)


def _start(config: Path, tmp_path: Path, *args: str) -> Job:
    with open(tmp_path / f"run{len(args)}.err", "w") as err:
        return Job([sys.executable, "-m", "epochcache", "run", str(config), *args],
                   cwd=tmp_path, env=cli_env(pythonpath=COMMON), stdout=subprocess.DEVNULL,
                   stderr=err)


def test_a_second_sigterm_while_the_stop_checkpoint_is_written_loses_nothing(
        tmp_path: Path) -> None:
    """SIGTERM mid-epoch, then SIGTERM twice more while the stop's checkpoint is being written
    (a slow one, 1.5 s): the run finishes the checkpoint, says so and what arrived meanwhile,
    exits 143; the resume trains the rest of the epoch, none of it twice. Before the fix the
    second SIGTERM ended the run at once (exit -15) with only the epoch-0 checkpoint."""
    config = write_config(tmp_path, save_s=1.5)
    job = _start(config, tmp_path)
    try:
        wait_for(lambda: holding(tmp_path / "logs", 1) or job.popen.poll() is not None, 200,
                 "the run holding mid-epoch")
        job.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: any(r.get("saving") for r in rows(tmp_path / "logs", 0))
                 or job.popen.poll() is not None, 60, "the stop's checkpoint being written")
        job.popen.send_signal(signal.SIGTERM)
        job.popen.send_signal(signal.SIGTERM)
        code = job.popen.wait(60)
    finally:
        if job.popen.poll() is None:
            job.kill()
    err = (tmp_path / "run0.err").read_text()
    assert code == 143, f"exit {code}:\n{err[-3000:]}"
    assert "writing the checkpoint" in err and "SIGTERM again" in err, err[-3000:]
    assert "while the checkpoint of epoch 1 after 3 batches is being written" in err, err[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    result = cli("run", str(config), "--resume", cwd=tmp_path, env=cli_env(pythonpath=COMMON))
    assert result.returncode == 0, result
    report = check_exactly_once(tmp_path, 1, checkpoint)
    assert report.problems == [], report.problems
    assert report.checkpoint_batches == 3
    assert metrics_epochs(tmp_path / "run") == [0, 1, 2]


STOP_TWICE = """\
import logging, os, signal, sys, time
from epochcache.run.signals import StopSignals

logging.basicConfig(level=logging.INFO)
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
stop = StopSignals().install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)  # the handler runs between bytecodes: each signal on its own
os.kill(os.getpid(), signal.SIGTERM)
with stop.writing("the test's checkpoint"):
    os.kill(os.getpid(), signal.SIGINT if sys.argv[1] == "int" else signal.SIGTERM)
    for _ in range(20):
        time.sleep(0.01)
    print("WRITTEN", flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
except KeyboardInterrupt as exc:
    print("RAISED", type(exc).__name__, flush=True)
stop.restore()
print("ALIVE", stop.requested, stop.signum == signal.SIGTERM, stop.repeats, flush=True)
"""


@pytest.mark.parametrize("then", ["term", "int"])
def test_repeated_signals_are_noted_and_never_end_the_process(tmp_path: Path, then: str) -> None:
    """The cheap form of the above, in one process: SIGTERM, SIGTERM again, a SIGTERM or a
    Ctrl-C while a checkpoint is written; the process lives on, the request stays SIGTERM's,
    each repeat is logged; a Ctrl-C after the checkpoint stops at once (a person insisting)."""
    script = tmp_path / "twice.py"
    script.write_text(STOP_TWICE)
    result = subprocess.run([sys.executable, str(script), then], capture_output=True,
                            text=True, timeout=60, check=False, env=cli_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WRITTEN" in result.stdout, result.stdout + result.stderr
    assert "RAISED Terminated" in result.stdout, result.stdout + result.stderr
    assert "ALIVE True True 3" in result.stdout, result.stdout + result.stderr
    assert result.stderr.count("again") >= 2, result.stderr
    assert "while the test's checkpoint is being written" in result.stderr, result.stderr


def test_stop_signals_outside_the_main_thread_change_nothing() -> None:
    import threading

    found: list[StopSignals] = []
    thread = threading.Thread(target=lambda: found.append(StopSignals().install()))
    thread.start()
    thread.join()
    assert found and not found[0].requested and found[0].repeats == 0
