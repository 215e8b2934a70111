"""Trainer of the resume matrix: ``cache.epochs()`` in a user loop with 2 DataLoader workers.

Every ``CKPT_EVERY`` batches it saves ``loader.state_dict()`` with its model and keeps the
epoch's lease for a resume; it resumes with ``cache.epochs(..., resume=state)``. Release is
the default, progressive: each batch may be evicted once the loop asks for the next one.

argv: CACHE_DIR RUN_DIR
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import trainer_io as tio

from epochcache import Cache


def main() -> int:
    cache_dir, run_dir = sys.argv[1:3]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tio.preemptible()
    log = tio.Log(os.path.join(run_dir, "rank0.jsonl"))
    path = os.path.join(run_dir, "checkpoint.pkl")
    saved = tio.load(path)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    resume = saved.get("loader")
    start = int(resume["epoch"]) if resume else int(saved.get("next_epoch", 0))
    cache = Cache(cache_dir)
    for epoch, loader in cache.epochs(tio.EPOCHS - start, batch_size=tio.BATCH_SIZE, seed=7,
                                      num_workers=2, start_epoch=start, resume=resume):
        log.write(epoch=epoch, order=[tio.sample_id(cache.info(int(s)).key)
                                      for s in loader.seqs])
        done = int(saved["batches"]) if resume and epoch == start else 0
        for batch in loader:
            log.write(epoch=epoch, batch=done, ids=tio.ids(batch))
            tio.step(model, opt, batch)
            done += 1
            if done % tio.CKPT_EVERY == 0:
                state = loader.state_dict()
                loader.keep_for_resume(1800.0)
                tio.save(path, {"model": model.state_dict(), "opt": opt.state_dict(),
                                "loader": state, "epoch": epoch, "batches": done})
                log.write(ckpt=True, epoch=epoch, batches=done, lease=state["lease"])
                if tio.exits_after_checkpoint(epoch, done):
                    log.write(exit=True, epoch=epoch, batches=done)
                    return 0
            if tio.stops_at(epoch, done):
                tio.stop_here(log, epoch, done)
        tio.save(path, {"model": model.state_dict(), "opt": opt.state_dict(),
                        "next_epoch": epoch + 1})
        log.write(ckpt=True, epoch=epoch + 1, batches=0)
    log.write(done=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
