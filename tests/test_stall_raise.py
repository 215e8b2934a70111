"""A stall ends the job instead of hanging it (issue 26, item 2).

The event: a DataLoader worker stuck for good (a deadlocked transform, a lock inherited held, a
read that never returns). The watchdog printed the trainer's stacks after ``stall_s``, not the
worker's, and the job then waited until a person killed it. Now the report holds the stacks of
the trainer and of each worker, names the worker that owes the batch, and the loop fails with a
``StallError`` naming the epoch, batch, sample key and worker; ``epochcache status`` shows the
stalled trainer meanwhile. Each case runs in a subprocess under a deadline: a hang fails it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common.writer import fill

SCRIPT = """
import json, sys, threading, time
import numpy as np
from torch.utils.data import DataLoader
import epochcache as ec

path, report, case = sys.argv[1], sys.argv[2], sys.argv[3]
cache = ec.Cache(path)
stuck = threading.Event()

def stuck_on_seven(x):
    if int(x[0]) == 7:
        print("STUCK", flush=True)
        stuck.wait()  # a deadlock: nothing will ever set it
    return x

def stuck_collate(samples):
    if any(int(x[0]) == 7 for x in samples):
        print("STUCK", flush=True)
        stuck.wait()
    return samples

lock = threading.Lock()
def deadlocked_start(worker_id):  # a worker start-up that waits on a lock held forever
    print("STUCK", flush=True)
    lock.acquire()

try:
    if case == "epochs-transform":
        for epoch, loader in cache.epochs(1, batch_size=4, num_workers=2, shuffle=False,
                                          transform=stuck_on_seven, stall_s=1.5,
                                          stall_file=report):
            for batch in loader:
                pass
    elif case == "epochs-silent":  # stuck in collate: past the reader's own watch
        for epoch, loader in cache.epochs(1, batch_size=4, num_workers=2, shuffle=False,
                                          collate_fn=stuck_collate, stall_s=1.5,
                                          stall_file=report):
            for batch in loader:
                pass
    elif case == "epochs-start":
        lock.acquire()
        for epoch, loader in cache.epochs(1, batch_size=4, num_workers=1, stall_s=1.5,
                                          stall_file=report, worker_init_fn=deadlocked_start):
            for batch in loader:
                pass
    elif case == "stream-workers":
        stream = cache.stream(transform=stuck_on_seven, shuffle=False, stall_s=1.5,
                              stall_file=report)
        for batch in DataLoader(stream, batch_size=4, num_workers=2):
            pass
    elif case == "in-process":
        with cache.dataset(transform=stuck_on_seven, stall_s=1.5, stall_file=report) as ds:
            for i in range(len(ds)):
                ds[i]
    print("NO ERROR", flush=True)
except ec.StallError as exc:
    print("STALLERROR", json.dumps(str(exc)), flush=True)
"""


def _run(tmp_path: Path, case: str) -> tuple[str, str]:
    path = str(tmp_path / "c")
    fill(path, 0, 16)
    report = tmp_path / "stall.log"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, str(script), path, str(report), case],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        out, err = "", "(hung: the stall did not end the job)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            left = True
        except ProcessLookupError:
            left = False
        proc.wait()
    assert "STALLERROR" in out, f"exit {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    assert not left, "a process of the job was left behind"  # the stuck workers were stopped
    message = json.loads(out.split("STALLERROR", 1)[1].strip().splitlines()[0])
    return message, report.read_text()


def test_a_deadlocked_transform_in_a_worker_ends_the_epoch(tmp_path: Path) -> None:
    message, report = _run(tmp_path, "epochs-transform")
    # The worker's own watchdog names the sample; the trainer's names the batch and worker.
    assert "DataLoader worker" in message and "s/0000007.npy" in message
    assert "STALL in DataLoader worker" in report and "stuck_on_seven" in report


def test_a_trainer_waiting_for_a_silent_worker_ends_the_epoch(tmp_path: Path) -> None:
    """The worker has no watchdog of its own (stuck before its reader runs, or in code no
    watch covers): the trainer's report names the batch and the worker that owes it, and
    has each worker dump its stacks."""
    message, report = _run(tmp_path, "epochs-silent")
    assert "epoch 0 batch 1" in message and "waiting for DataLoader worker" in message
    assert "s/0000004.npy" in message  # the batch's first sample key
    assert "STALL in training process" in report and "its stacks follow" in report
    assert "stuck_collate" in report  # the worker's own stack: where it is stuck


def test_a_worker_stuck_at_start_up_ends_the_job(tmp_path: Path) -> None:
    message, report = _run(tmp_path, "epochs-start")
    assert "epoch 0 (starting its DataLoader workers)" in message
    assert "deadlocked_start" in report  # its stack, dumped by the worker itself


def test_a_stream_worker_stuck_raises_in_the_training_loop(tmp_path: Path) -> None:
    message, report = _run(tmp_path, "stream-workers")
    assert "s/0000007.npy" in message and "DataLoader worker" in message
    assert "stuck_on_seven" in report


def test_a_stuck_read_in_process_raises(tmp_path: Path) -> None:
    message, report = _run(tmp_path, "in-process")
    assert "s/0000007.npy" in message and "training process" in message
    assert "stuck_on_seven" in report


@pytest.mark.parametrize("action", ["warn"])
def test_status_shows_a_stalled_trainer(tmp_path: Path, action: str) -> None:
    from common.procs import spawn_script

    path = str(tmp_path / "c")
    fill(path, 0, 16)
    stalled = spawn_script(tmp_path, "stalled", """
        import sys, threading
        import epochcache as ec
        def stuck(x):
            if int(x[0]) == 3:
                print("STUCK", flush=True)
                threading.Event().wait()
            return x
        with ec.Cache(sys.argv[1]).dataset(transform=stuck, stall_s=0.5,
                                           stall_action=sys.argv[2]) as ds:
            [ds[i] for i in range(len(ds))]
        """, path, action)
    try:
        stalled.wait_line("STUCK", 60)
        from epochcache import Cache
        from epochcache.status import collect_stats

        cache = Cache(path)
        stats: dict[str, object] = {}
        for _ in range(100):  # the record appears once the report is out (0.5 s)
            stats = collect_stats(cache)
            if stats["stalls"]:
                break
            time.sleep(0.1)
        (stall,) = stats["stalls"]  # type: ignore[misc]
        assert stall["pid"] == stalled.pid and "s/0000003.npy" in stall["key"]
        result = subprocess.run([sys.executable, "-m", "epochcache", "status", path],
                                capture_output=True, text=True, timeout=120, check=False)
        assert "stalled" in result.stdout and "s/0000003.npy" in result.stdout, result
    finally:
        stalled.close()
