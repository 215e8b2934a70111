"""Trainer of the resume matrix: ``cache.stream()`` under torchdata's StatefulDataLoader.

Every ``CKPT_EVERY`` batches it saves ``dl.state_dict()`` with its model; it resumes with
``dl.load_state_dict(...)``, or, resumed with another number of workers
(``RESUME_WORKERS``), with ``stream.load_state_dict(...)`` (the rest of every worker's lane
dealt anew). The stream's workers release each chunk once read (progressive).

argv: CACHE_DIR RUN_DIR NUM_WORKERS [RESUME_WORKERS]
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import trainer_io as tio

from epochcache import Cache


def main() -> int:
    cache_dir, run_dir, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    warnings.simplefilter("ignore")  # torchdata's deprecation notices
    from torchdata.stateful_dataloader import StatefulDataLoader

    tio.preemptible()
    log = tio.Log(os.path.join(run_dir, "rank0.jsonl"))
    path = os.path.join(run_dir, "checkpoint.pkl")
    saved = tio.load(path)
    model = torch.nn.Linear(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache = Cache(cache_dir)
    regroup = saved and len(sys.argv) > 4 and int(sys.argv[4]) != workers
    if regroup:
        workers = int(sys.argv[4])
    stream = cache.stream(seed=3)
    dl = StatefulDataLoader(stream, batch_size=tio.BATCH_SIZE, num_workers=workers)
    start = done = 0
    if saved:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if regroup:  # another num_workers: the stream takes the loader's whole state
            stream.load_state_dict(saved["loader"])
        else:
            dl.load_state_dict(saved["loader"])
        start, done = int(saved["epoch"]), int(saved["batches"])
    for epoch in range(start, tio.EPOCHS):
        for batch in dl:
            log.write(epoch=epoch, batch=done, ids=tio.ids(batch))
            tio.step(model, opt, batch)
            done += 1
            if done % tio.CKPT_EVERY == 0:
                tio.save(path, {"model": model.state_dict(), "opt": opt.state_dict(),
                                "loader": dl.state_dict(), "epoch": epoch, "batches": done})
                log.write(ckpt=True, epoch=epoch, batches=done)
                if tio.exits_after_checkpoint(epoch, done):
                    log.write(exit=True, epoch=epoch, batches=done)
                    return 0
            if tio.stops_at(epoch, done):
                tio.stop_here(log, epoch, done)
        tio.save(path, {"model": model.state_dict(), "opt": opt.state_dict(),
                        "loader": dl.state_dict(), "epoch": epoch + 1, "batches": 0})
        log.write(ckpt=True, epoch=epoch + 1, batches=0)
        done = 0
    log.write(done=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
