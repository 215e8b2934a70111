"""DataLoader workers never start holding a lock another thread of the trainer holds (issue 26,
item 1).

The event: ``epochs()`` forked the next loader's workers from its background build thread while
the training loop built its model, and ``torch.manual_seed`` there held
``torch.cuda._initialization_lock``; the worker, forked with it held, blocked in its own
``torch.manual_seed`` and the job hung at the next epoch's first batch (1 run in 6 of a 2-epoch
demo). The same with a user thread of the trainer that keeps taking torch's, numpy's and
logging's locks. Each trial runs under a deadline in a fresh interpreter started in a session
of its own; a hang fails the test and the whole session is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """\
import faulthandler, logging, sys, threading, time
import numpy as np, torch
import epochcache as ec

trials, workers, persistent, hammer = {trials}, {workers}, {persistent}, {hammer}
cache = ec.Cache({path!r}, capacity="64MiB")
cache.put_many([(f"k{{i:04d}}.npy", np.full(16, i, dtype=np.float32).tobytes())
                for i in range(512)])
logging.basicConfig(stream=open("/dev/null", "w"), level=logging.INFO)

stop = threading.Event()
def hammer_locks():  # a user thread: seeds torch, draws from numpy's global state, logs
    log = logging.getLogger("user")
    while not stop.is_set():
        torch.manual_seed(1)
        np.random.rand(4)
        log.info("tick")
if hammer:
    threading.Thread(target=hammer_locks, daemon=True).start()

for trial in range(trials):
    faulthandler.dump_traceback_later({deadline_s}, exit=True)
    seen = 0
    for epoch, loader in cache.epochs(num_epochs=2, batch_size=32, num_workers=workers,
                                      persistent_workers=persistent, decode=None,
                                      stall_s=None):
        if epoch == 0:  # the trainer builds its model: seeds torch, as the examples do
            for _ in range(5):
                torch.manual_seed(0)
        for batch in loader:
            seen += 1
    faulthandler.cancel_dump_traceback_later()
    assert seen == 32, seen
    print("TRIAL", trial, flush=True)
stop.set()
print("DONE", flush=True)
"""


def _run(tmp_path: Path, *, trials: int, workers: int = 1, persistent: bool = True,
         hammer: bool = False, deadline_s: float = 60.0) -> None:
    script = tmp_path / "trials.py"
    script.write_text(SCRIPT.format(path=str(tmp_path / "cache"), trials=trials,
                                    workers=workers, persistent=persistent, hammer=hammer,
                                    deadline_s=deadline_s))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=trials * deadline_s + 120)
    except subprocess.TimeoutExpired:
        out, err = "", "(timed out)"
    finally:
        # A worker blocked on an inherited lock outlives its trainer: end the whole session.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    done = out.count("TRIAL")
    assert proc.returncode == 0 and "DONE" in out, (
        f"hung or failed after {done} of {trials} trials (exit {proc.returncode}):\n"
        f"{err[-6000:]}")


def test_a_training_loop_seeding_torch_never_hangs_the_next_epoch(tmp_path: Path) -> None:
    _run(tmp_path, trials=40)


def test_workers_start_while_a_user_thread_takes_torch_numpy_and_logging_locks(
        tmp_path: Path) -> None:
    _run(tmp_path, trials=15, workers=2, hammer=True)


def test_fresh_workers_every_epoch_start_safely_too(tmp_path: Path) -> None:
    _run(tmp_path, trials=15, workers=2, persistent=False, hammer=True)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [True, False])
def test_two_hundred_trials(tmp_path: Path, persistent: bool) -> None:
    _run(tmp_path, trials=200, persistent=persistent)
    _run(tmp_path, trials=200, workers=2, persistent=persistent, hammer=True)
