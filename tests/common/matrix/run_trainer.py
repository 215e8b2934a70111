"""Trainer of the resume matrix for ``epochcache run`` (``train.entrypoint:
run_trainer:train_epoch``), one rank or several under torchrun.

The run checkpoints by itself (``train.checkpoint_every_s``: 0.2 s); the trainer pauses after
``EXIT_FROM`` batches of the stop epoch so that one checkpoint comes there, and reads where
the last checkpoint was from the loader (``loader.midepoch``) to place its stop: the first
batch past ``STOP_AT`` with a checkpoint behind it in the epoch. Under torchrun the ranks agree on every
checkpoint, so all of them stop at the same batch.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import trainer_io as tio


def train_epoch(run: Any, epoch: int, loader: Any) -> dict[str, float]:
    rank = int(os.environ.get("RANK", "0"))
    log = tio.Log(os.path.join(run.options["log"], f"rank{rank}.jsonl"))
    model = run.state.get("model") or run.restore("model", torch.nn.Linear(64, 1))
    opt = run.state.get("opt") or run.restore(
        "opt", torch.optim.SGD(model.parameters(), lr=0.01))
    cache = loader.dataset.reader.cache
    log.write(epoch=epoch, order=[tio.sample_id(cache.info(int(s)).key) for s in loader.seqs])
    midepoch = getattr(loader, "midepoch", None)
    stopped = False
    for i, batch in enumerate(loader):
        saved = midepoch.saved_batches if midepoch is not None else 0
        if saved == i and saved > 0:
            log.write(ckpt=True, epoch=epoch, batches=i)
            if tio.exits_after_checkpoint(epoch, i):
                log.write(exit=True, epoch=epoch, batches=i)
                sys.exit(0)  # a plain exit of the job, right after its checkpoint
        log.write(epoch=epoch, batch=i, ids=tio.ids(batch))
        tio.step(model, opt, batch)
        time.sleep(0.02)
        if epoch == tio.STOP_EPOCH and i + 1 == tio.EXIT_FROM:
            # Longer than train.checkpoint_every_s: the run checkpoints after this batch
            # whatever the machine's speed (others come every 0.2 s).
            time.sleep(0.3)
        if not stopped and i + 1 >= tio.STOP_AT and saved > 0 and tio.stop_due(epoch):
            stopped = True
            tio.stop_here(log, epoch, i + 1)
    return {"loss": 0.0}
