"""Ctrl-C and SIGTERM stop ``epochcache run`` cleanly at any moment (issue 20, item 5).

Every run is a real ``python -m epochcache run`` subprocess in its own session, interrupted by a
real signal: SIGINT to its process group (a terminal's Ctrl-C), SIGTERM to its process group
(torchrun and Slurm signal the whole group, DataLoader workers included) or SIGTERM to the run
alone (Kubernetes, ``kill``). Moments: start-up (the demo data being written), the first epoch's
DataLoader workers starting, mid-epoch, and the epoch boundary; each is found by a condition (a
log line, a file the trainer writes), never by a sleep. The run must exit 130/143 with its
one-line message, print no traceback (``Traceback``, ``Exception ignored``, ``Exception in
thread``), leave no process behind and release its lease.

The signal handler used to raise wherever the main thread was: into DataLoader start-up (the
workers, told by the same Ctrl-C, died half-way through their queues), and between a remap-lock
entry of the store and its ``try`` (a later map resize then waits forever for that entry).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from common.procs import kill_job
from common.writer import fill
from test_run import (
    Result,
    assert_verifies,
    cli_env,
    demo_config,
    descendants,
    read_metrics,
    status_json,
    still_running,
    write_yaml,
)

from epochcache import Cache

STOP_MESSAGE = "stopping (the last checkpoint is kept; continue with --resume)"
TRACEBACK_WORDS = ("Traceback", "Exception ignored", "Exception in thread")

MARKING_TRAINER = '''\
"""Writes a file at one moment of the run (options: moment, marker), else the example trainer."""
import os
import time

from epochcache.examples import train_epoch as example_epoch


def _mark(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def train_epoch(run, epoch, loader):
    moment, marker = run.options["moment"], run.options["marker"]
    if epoch == 0 and moment == "workers":
        _mark(marker)  # the first epoch's DataLoader workers are starting now

    def batches():
        for index, batch in enumerate(loader):
            if epoch == 0 and moment == "mid-epoch" and index == 1:
                _mark(marker)
            time.sleep(float(run.options["sleep_s"]))
            yield batch

    result = example_epoch(run, epoch, batches())
    if epoch == 0 and moment == "boundary":
        _mark(marker)  # the run now writes metrics and the checkpoint, then the next epoch
    return result
'''

GATE_TRAINER = '''\
"""SIGTERM lands between a remap-lock begin_read's entry and its try (options: report)."""
import atexit
import signal
import threading

from epochcache.examples import train_epoch as example_epoch
from epochcache.store import remap_lock


def _report(path):
    lock = remap_lock.LOCK
    left = len(lock._active)
    # A map resize waits until no other thread has a transaction open.
    done = threading.Event()
    threading.Thread(target=lambda: (lock.remap(lambda: None), done.set()), daemon=True).start()
    done.wait(20)
    with open(path, "w") as f:
        f.write(f"entries left {left}, remap {'done' if done.is_set() else 'waits forever'}")


def train_epoch(run, epoch, loader):
    atexit.register(_report, run.options["report"])
    lock = remap_lock.LOCK
    enter = lock.enter
    armed = []

    def enter_then_signal():
        enter()
        if armed and threading.current_thread() is threading.main_thread():
            armed.clear()
            # A real SIGTERM, to the main thread, which runs the handler right here.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    lock.enter = enter_then_signal

    def batches():
        for index, batch in enumerate(loader):
            if index == 2:
                armed.append(True)  # the next batch's read (in process: num_workers 0)
            yield batch

    return example_epoch(run, epoch, batches())
'''


class _Lines:
    """Collects a pipe's lines on a thread; waits for one that contains a text."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not any(text in line for line in self.lines):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line with {text!r} (exit {proc.poll()}):\n"
                                         + "".join(self.lines)[-4000:])
                self._cond.wait(0.1)

    def text(self, timeout_s: float = 30) -> str:
        self._thread.join(timeout_s)
        return "".join(self.lines)


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], _Lines, _Lines]:
    # As from a terminal: SIGINT not ignored in the run (a test started from a background job
    # of a shell inherits it ignored, and so would the run).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epochcache", "run", "cfg.yaml"], cwd=tmp_path,
            env=cli_env(pythonpath=tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    return proc, _Lines(proc.stdout), _Lines(proc.stderr)


def _wait_for_file(path: Path, proc: subprocess.Popen[str], err: _Lines, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} (exit {proc.poll()}):\n{err.text(0)[-4000:]}")
        time.sleep(0.02)


def _send(proc: subprocess.Popen[str], how: str) -> int:
    """Signal the run as ``how`` says; returns the exit status expected."""
    if how == "group-int":
        os.killpg(proc.pid, signal.SIGINT)
        return 130
    if how == "group-term":
        os.killpg(proc.pid, signal.SIGTERM)
        return 143
    os.kill(proc.pid, signal.SIGTERM)
    return 143


def _assert_no_traceback(result: Result) -> None:
    text = result.stdout + result.stderr
    for word in TRACEBACK_WORDS:
        at = text.find(word)
        assert at < 0, f"{word!r} in the output of {result.args}:\n{text[max(0, at - 3000):at + 5000]}"


def _interrupt_run(tmp_path: Path, moment: str, how: str, workers: int = 2,
                   sleep_s: float = 0.2) -> None:
    """One run, one signal at ``moment`` (each batch takes ``sleep_s``); checks everything
    a clean stop promises."""
    (tmp_path / "marking_trainer.py").write_text(MARKING_TRAINER)
    marker = tmp_path / "moment.reached"
    config = demo_config(
        tmp_path,
        loader={"num_workers": workers, "stall_s": 60},
        train={"epochs": 3, "entrypoint": "marking_trainer:train_epoch",
               "options": {"moment": moment, "marker": str(marker), "sleep_s": sleep_s}},
    )
    write_yaml(tmp_path / "cfg.yaml", config)
    proc, out, err = _start(tmp_path)
    try:
        if moment == "start-up":
            err.wait_for("writing the demo dataset", proc, timeout_s=120)
        else:
            _wait_for_file(marker, proc, err, timeout_s=180)
        tree = descendants(proc.pid)
        expected = _send(proc, how)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_job(proc)
            proc.wait()
    result = Result(["run", "cfg.yaml", f"({moment}, {how})"], proc.returncode, out.text(),
                    err.text())
    assert proc.returncode == expected, result
    _assert_no_traceback(result)
    assert STOP_MESSAGE in result.stderr, result
    # A group signal reaches the samplers too: stopped, not crashed, so never restarted.
    assert "restarting it" not in result.stderr, result

    deadline = time.monotonic() + 30
    while still_running(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not still_running(tree), f"left running: {still_running(tree)}\n{result}"

    cache_dir, run_dir = tmp_path / "demo-cache", tmp_path / "runs" / "demo"
    if (run_dir / "metrics.jsonl").exists():  # every finished epoch has its row, no other
        rows = read_metrics(run_dir)
        assert [row["epoch"] for row in rows] == list(range(len(rows))), rows
    if cache_dir.exists():
        stats = status_json(cache_dir, tmp_path)
        # None left, not even for a resume: without train.checkpoint_every_s nothing can
        # continue the epoch (on 3c6d3cb a stopped epoch's lease stayed 1800 s: the run's
        # manifest writer had taken a resume state, which keeps it).
        assert stats["lease_details"] == [], (stats["lease_details"], result)
        assert_verifies(cache_dir, tmp_path)


@pytest.mark.parametrize(
    ("moment", "how"),
    [
        ("start-up", "group-int"),  # used to exit 1: a traceback from plotting a run not begun
        ("workers", "group-int"),  # the tracebacks of the issue: workers killed mid-start-up
        ("mid-epoch", "group-term"),  # torchrun and Slurm signal the whole group
        ("boundary", "term"),
    ],
)
def test_a_signal_at_any_moment_stops_the_run_cleanly(tmp_path: Path, moment: str,
                                                      how: str) -> None:
    _interrupt_run(tmp_path, moment, how)


def test_a_group_sigterm_during_a_long_step_stops_the_samplers_without_restarts(
        tmp_path: Path) -> None:
    """The samplers of a run are in its process group: SIGTERM to the group (torchrun,
    Slurm, ``timeout``) stops them at once, while the run stops at the end of its step. The
    daemon thread restarted them meanwhile ("exited with 0; restarting it in 0.5s")."""
    _interrupt_run(tmp_path, "mid-epoch", "group-term", sleep_s=3.0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["group-int", "group-term", "term"])
@pytest.mark.parametrize("moment", ["start-up", "workers", "mid-epoch", "boundary"])
@pytest.mark.parametrize("round_", range(3))
def test_every_signal_at_every_moment_three_times(tmp_path: Path, moment: str, how: str,
                                                  round_: int) -> None:
    _interrupt_run(tmp_path, moment, how)


def test_sigterm_inside_a_store_read_leaves_the_remap_lock_open(tmp_path: Path) -> None:
    """SIGTERM delivered right after a read transaction's remap-lock entry, before its ``try``:
    the run used to raise there, the entry was never left, and a later map resize (any
    thread's ``set_mapsize``) waited for it forever. Now the run stops at the next batch."""
    (tmp_path / "gate_trainer.py").write_text(GATE_TRAINER)
    report = tmp_path / "remap_lock.report"
    config = demo_config(tmp_path, train={"epochs": 2, "entrypoint": "gate_trainer:train_epoch",
                                          "options": {"report": str(report)}})
    write_yaml(tmp_path / "cfg.yaml", config)
    proc, out, err = _start(tmp_path)
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            kill_job(proc)
            proc.wait()
    result = Result(["run", "cfg.yaml"], proc.returncode, out.text(), err.text())
    assert proc.returncode == 143, result
    _assert_no_traceback(result)
    assert report.read_text() == "entries left 0, remap done", result


def _worker_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def test_epochs_closed_in_the_first_epoch_shut_every_worker_down(tmp_path: Path) -> None:
    """With persistent workers the second loader's workers start with the first epoch and wait
    for the next epoch's plan. epochs() closed before that plan (a run stopped in its first
    epoch) left that loader's iterator half-built: its workers ran on, and the garbage
    collector finalised its queues in any order, which printed ``Exception in thread
    QueueFeederThread ... Bad file descriptor``. Now every worker is shut down by close()."""
    path = str(tmp_path / "c")
    fill(path, 0, 64)
    cache = Cache(path, sync=False)
    before = _worker_pids()
    gc.disable()  # what close() leaves running must not be cleaned up by chance
    try:
        epochs = cache.epochs(3, batch_size=8, num_workers=1, persistent_workers=True)
        _epoch, loader = next(epochs)
        next(iter(loader))  # the first batch is out
        deadline = time.monotonic() + 60  # both loaders' workers started
        while len(_worker_pids() - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_worker_pids() - before) == 2, _worker_pids()
        epochs.close()  # type: ignore[attr-defined]
        left = _worker_pids() - before
        assert not left, f"DataLoader workers still running after close(): {left}"
    finally:
        gc.enable()
        gc.collect()
        cache.close()


WORKER_SCRIPT = """
import os, signal, subprocess, sys
import torch
from epochcache.run.signals import quiet_worker, shelter_forkserver


class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, index):
        return os.getpid()


if __name__ == "__main__":
    context = sys.argv[1]
    if context == "forkserver":
        shelter_forkserver()  # as the run does before its first worker
        from multiprocessing import forkserver

        with open(f"/proc/{forkserver._forkserver._forkserver_pid}/status") as f:
            blocked = int(f.read().split("SigBlk:")[1].split()[0], 16)
        print("forkserver blocks", [sig.name for sig in (signal.SIGINT, signal.SIGTERM)
                                    if blocked & (1 << (sig - 1))], flush=True)
    loader = torch.utils.data.DataLoader(Pids(), batch_size=None, num_workers=1,
                                         worker_init_fn=quiet_worker,
                                         multiprocessing_context=context)
    iterator = iter(loader)
    pid = next(iterator)
    subprocess.run(["kill", "-INT", str(pid)], check=True, timeout=30)
    # Prefetching holds a few batches: fifty more are made after the signal.
    assert {next(iterator) for _ in range(50)} == {pid}
    worker = iterator._workers[0]
    worker.terminate()  # DataLoader's last resort for a worker that does not stop
    worker.join(60)
    print("exit code", worker.exitcode, flush=True)
    iterator._shutdown_workers()
"""


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_run_workers_ignore_ctrl_c_and_still_end_on_sigterm(tmp_path: Path, context: str) -> None:
    """A run's DataLoader worker (``quiet_worker``) keeps serving through SIGINT, and still ends
    on SIGTERM (DataLoader's ``terminate()``), also when it was forked by the sheltered
    forkserver, which blocks SIGINT and SIGTERM (a group SIGTERM ended it, and every worker
    start after that failed half-way) and starts its processes so."""
    script = tmp_path / "workers.py"
    script.write_text(WORKER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), context], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 0: torch's handler, for its parent's SIGTERM; -15: the forkserver's child, killed by it
    expected = "exit code 0" if context == "fork" else "exit code -15"
    assert expected in proc.stdout, proc.stdout + proc.stderr
    if context == "forkserver":
        assert "forkserver blocks ['SIGINT', 'SIGTERM']" in proc.stdout, proc.stdout


WORKER_DEATHS = """\
import os, signal, subprocess, sys, time
import numpy as np
from torch.utils.data import DataLoader, Dataset
from epochcache.run.signals import StopSignals


class Slow(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.05)
        return np.zeros(4)


if __name__ == "__main__":
    stop = StopSignals().install()
    it = iter(DataLoader(Slow(), batch_size=2, num_workers=2))  # torch's SIGCHLD handler is set
    next(it)
    # A group SIGTERM from outside (a worker exits quietly on its parent's SIGTERM only): the
    # run's stop request, and its workers' end.
    pids = [os.getpid()] + [worker.pid for worker in it._workers]
    subprocess.run(["kill", "-TERM", *map(str, pids)], check=True)
    try:
        for _ in range(40):  # the run's clean-up: a lease released, a log line written
            time.sleep(0.05)
            print("cleaning up", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print("RAISED", exc, flush=True)
        sys.exit(3)
    assert stop.requested
    print("CLEAN", flush=True)
"""


def test_workers_that_a_group_sigterm_ends_do_not_raise_into_the_runs_clean_up(
        tmp_path: Path) -> None:
    """A group SIGTERM ends the run's DataLoader workers at once, and torch's SIGCHLD handler
    raised their deaths from wherever the run's main thread was: inside a log call of its
    clean-up, a 'Logging error' traceback in the output (test_a_group_sigterm_during_a_long_step
    failed on it in a full run). Once the run has been asked to stop, their deaths no longer
    raise; the loader still says so where it is read."""
    script = tmp_path / "deaths.py"
    script.write_text(WORKER_DEATHS)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path, check=False)
    assert result.returncode == 0 and "CLEAN" in result.stdout, result.stdout + result.stderr
