"""What every trainer of the resume matrix shares (tests/test_resume_matrix.py): its log, its
checkpoints, and where and how it stops.

Each trainer appends one JSON row per event to ``rank<R>.jsonl`` in its run directory: the
epoch's order where the loader exposes it, each batch's sample ids (a sample's id is the first
value of its array), each checkpoint once it is written, and the stop point. The environment
says what to do:

* ``MATRIX_PHASE``: ``first`` (the job that is stopped) or ``resume``;
* ``MATRIX_STOP``: how the first job stops. At the stop point (``STOP_AT`` batches into
  epoch ``STOP_EPOCH``, a few batches after a checkpoint) the trainer logs ``stop`` and then,
  for ``exit_in_step``, calls ``os._exit(1)``; otherwise it waits there until the test has
  signalled or killed the job and created the file ``MATRIX_GO``. ``exit_after_checkpoint``:
  the trainer returns normally right after its first checkpoint at or past ``EXIT_FROM``
  batches of that epoch.

SIGTERM raises ``SystemExit(143)`` in the trainers of user loops, as a preemptible job's
script does (Lightning keeps that handler and runs its own beside it); ``epochcache run`` has
its own.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from typing import Any

PHASE = os.environ.get("MATRIX_PHASE", "first")
STOP = os.environ.get("MATRIX_STOP", "none")
GO = os.environ.get("MATRIX_GO", "")
EPOCHS = 3
STOP_EPOCH = 1
STOP_AT = int(os.environ.get("MATRIX_STOP_AT", "11"))
EXIT_FROM = int(os.environ.get("MATRIX_EXIT_FROM", "8"))
#: User loops checkpoint every this many batches of an epoch.
CKPT_EVERY = 4
BATCH_SIZE = 10
#: How long a trainer waits at its stop point for the test before giving up (never reached
#: unless the test died: then the trainer must not outlive it).
WAIT_S = 600.0

#: Stops the trainer waits at for the test to act.
WAITS = ("sigterm", "sigint", "kill_all", "kill_trainer")


class Log:
    """The trainer's JSON-lines log; each row one write, flushed (a SIGKILL loses none)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the trainer

    def write(self, **row: Any) -> None:
        row.setdefault("pid", os.getpid())
        row["phase"] = PHASE
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()


def ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def sample_id(key: str) -> int:
    """The id in a sample's key (``000123.npy``, ``s/0000123.npy``)."""
    return int(key.rsplit("/", 1)[-1].split(".")[0])


def _terminated(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def preemptible() -> None:
    """SIGTERM ends the script as an exception (its ``finally`` blocks run), as in a job
    written to be preempted."""
    signal.signal(signal.SIGTERM, _terminated)


def stop_due(epoch: int) -> bool:
    """The first job stops in ``epoch`` (at its stop point)."""
    return PHASE == "first" and epoch == STOP_EPOCH and STOP in (*WAITS, "exit_in_step")


def stops_at(epoch: int, batches: int) -> bool:
    """The first job stops here (after training ``batches`` batches of ``epoch``)."""
    return stop_due(epoch) and batches == STOP_AT


def stop_here(log: Log, epoch: int, batches: int) -> None:
    """The stop point: log it, then exit or wait for the test (see the module docstring)."""
    log.write(stop=True, epoch=epoch, batches=batches)
    if STOP == "exit_in_step":
        os._exit(1)
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(GO):
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.02)


def exits_after_checkpoint(epoch: int, batches: int) -> bool:
    """The first job returns right after the checkpoint it just wrote."""
    return (PHASE == "first" and STOP == "exit_after_checkpoint" and epoch == STOP_EPOCH
            and batches >= EXIT_FROM)


def save(path: str, payload: dict[str, Any]) -> None:
    """Write a checkpoint atomically (a kill mid-save leaves the previous one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return dict(pickle.load(f))
    except FileNotFoundError:
        return {}


def step(model: Any, opt: Any, batch: Any) -> None:
    """One training step of a tiny model (the samples are random floats: NaNs zeroed)."""
    import torch

    loss = model(torch.nan_to_num(batch.float())).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
