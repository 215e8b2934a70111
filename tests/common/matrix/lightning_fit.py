"""Trainer of the resume matrix: Lightning ``Trainer.fit`` (CPU, one device) on a
StatefulDataLoader over ``cache.stream()`` with 2 workers.

A callback saves ``last.ckpt`` every ``CKPT_EVERY`` batches of an epoch (Lightning stores the
loader's state in it); the resumed fit passes ``ckpt_path``. The training step takes its batch
from ``dataloader_iter``, so Lightning fetches no batch ahead and the saved loader state covers
exactly the batches trained on (docs/guide/resume.md, "cache.stream() with StatefulDataLoader").

argv: CACHE_DIR RUN_DIR
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import torch
import trainer_io as tio

from epochcache import Cache


def main() -> int:
    cache_dir, run_dir = sys.argv[1:3]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    warnings.simplefilter("ignore")  # Lightning's advice for real runs, torchdata's notices
    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader

    tio.preemptible()
    log = tio.Log(os.path.join(run_dir, "rank0.jsonl"))
    last = os.path.join(run_dir, "last.ckpt")

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 1)
            self.done = 0  # batches of the current epoch trained on
            self.restored = False
            self.exit_now = False

        def on_train_epoch_start(self) -> None:
            if not self.restored:
                self.done = 0
            self.restored = False

        def training_step(self, dataloader_iter: Any) -> Any:
            batch, _index, _loader = next(dataloader_iter)
            epoch = self.current_epoch
            log.write(epoch=epoch, batch=self.done, ids=tio.ids(batch))
            self.done += 1
            if tio.stops_at(epoch, self.done):
                tio.stop_here(log, epoch, self.done)
            return self.layer(torch.nan_to_num(batch)).pow(2).mean()

        def on_train_batch_end(self, *args: Any) -> None:
            if self.exit_now:
                log.write(exit=True, epoch=self.current_epoch, batches=self.done)
                self.trainer.should_stop = True  # fit returns; so does the script

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["matrix"] = {"epoch": self.current_epoch, "batches": self.done}

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.done = int(checkpoint["matrix"]["batches"])
            self.restored = True

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class EveryN(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if module.done % tio.CKPT_EVERY == 0:
                trainer.save_checkpoint(last)
                log.write(ckpt=True, epoch=module.current_epoch, batches=module.done)
                module.exit_now = tio.exits_after_checkpoint(module.current_epoch, module.done)

    cache = Cache(cache_dir)
    loader = StatefulDataLoader(cache.stream(seed=3), batch_size=tio.BATCH_SIZE, num_workers=2)
    trainer = L.Trainer(max_epochs=tio.EPOCHS, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=run_dir,
                        callbacks=[EveryN()])
    trainer.fit(Tiny(), loader, ckpt_path=last if os.path.exists(last) else None)
    log.write(done=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
