"""The trainer of the preemption tests (tests/test_stop_signals.py, tests/test_slurm.py).

Each rank appends what it trains to ``options.log/rank<R>.jsonl``: at each epoch's start the
order of its part (sample ids), then every batch's sample ids, with its pid and Slurm job id
and restart count. It holds once (a file in the log directory remembers it) after the batch
``options.hold`` (``"EPOCH:BATCH"``) until the run is asked to stop, for at most ``hold_s``:
a preemption then lands mid-epoch, between two batches, wherever the test sends it from.
``options.save_s`` makes a checkpoint written after a stop request take that long (and log a
``saving`` row first), so a signal can be sent while it is being written.

A sample's id is its array's value (tests/common/preempt.py writes the dataset).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch


def _stop_request() -> Any:
    """The run's stop request (`epochcache.run.signals.StopSignals`, whose handler is SIGTERM's),
    read before any signal arrives."""
    return getattr(signal.getsignal(signal.SIGTERM), "__self__", None)


class _Log:
    def __init__(self, directory: str) -> None:
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.path = os.path.join(directory, f"rank{self.rank}.jsonl")

    def write(self, **row: Any) -> None:
        row.update(pid=os.getpid(), job=os.environ.get("SLURM_JOB_ID"),
                   restart=os.environ.get("SLURM_RESTART_COUNT"), time=time.time())
        with open(self.path, "a") as f:  # one write a row: a kill leaves at most a torn line
            f.write(json.dumps(row) + "\n")


class SlowSave:
    """Checkpointed state whose ``state_dict`` takes ``seconds`` once a stop is requested."""

    def __init__(self, seconds: float, stop: Any, log: _Log) -> None:
        self.seconds, self.stop, self.log = seconds, stop, log
        self.saves = 0

    def state_dict(self) -> dict[str, int]:
        if self.seconds and self.stop is not None and self.stop.requested:
            self.log.write(saving=True)
            time.sleep(self.seconds)
        self.saves += 1
        return {"saves": self.saves}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.saves = int(state["saves"])


def _ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def train_epoch(run: Any, epoch: int, loader: Any) -> dict[str, float]:
    options = run.options
    log = _Log(options["log"])
    stop = _stop_request()
    model = run.state.get("model") or run.restore("model", torch.nn.Linear(8, 1))
    opt = run.state.get("opt") or run.restore(
        "opt", torch.optim.SGD(model.parameters(), lr=0.01))
    if "slow" not in run.state:
        run.restore("slow", SlowSave(float(options.get("save_s", 0)), stop, log))
    cache = loader.dataset.reader.cache
    order = [int(cache.info(int(seq)).key.split("/")[-1].split(".")[0]) for seq in loader.seqs]
    log.write(epoch=epoch, order=order)
    held = os.path.join(options["log"], f"held-rank{log.rank}")
    loss = torch.zeros(())
    for i, batch in enumerate(loader):
        log.write(epoch=epoch, batch=i, ids=_ids(batch))
        loss = model(batch.float() / 64).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if options.get("hold") == f"{epoch}:{i}" and not os.path.exists(held):
            open(held, "w").close()
            log.write(hold=True, epoch=epoch, batch=i)
            deadline = time.monotonic() + float(options.get("hold_s", 120))
            while time.monotonic() < deadline and not (stop is not None and stop.requested):
                time.sleep(0.02)
    return {"loss": float(loss.detach())}
