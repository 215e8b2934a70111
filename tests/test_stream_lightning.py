"""cache.stream() under a real PyTorch Lightning Trainer: the cache grows between epochs and
each epoch trains on all of it, with DataLoader workers and without.

Lightning never calls set_epoch on an IterableDataset: with workers, each epoch's workers take
and share the snapshot themselves; without, Lightning's iter() in the main process does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from common.writer import fill
from torch.utils.data import DataLoader

from epochcache import Cache

pytestmark = [
    # Lightning's advice for real runs (more workers, a logger, ...): not what is tested here.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # lightning on torch 2.13 pytree
]


class _Tiny:
    """Built lazily: importing lightning costs ~2 s, paid only by this module's tests."""

    @staticmethod
    def make(cache_dir: str) -> Any:
        import lightning as L

        class Tiny(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(64, 1)
                self.seen: dict[int, list[int]] = {}

            def training_step(self, batch: torch.Tensor, _index: int) -> torch.Tensor:
                self.seen.setdefault(self.current_epoch, []).extend(int(v) for v in batch[:, 0])
                return self.layer(torch.nan_to_num(batch)).pow(2).mean()

            def on_train_epoch_end(self) -> None:
                # The samplers' part: 20 new samples arrive before the next epoch.
                fill(cache_dir, 1000 + 20 * self.current_epoch, 20)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=1e-3)

        return Tiny()


@pytest.mark.parametrize("workers", [2, 0])
def test_lightning_fit_sees_the_cache_grow_between_epochs(tmp_path: Path, workers: int) -> None:
    import lightning as L

    path = str(tmp_path / "c")
    fill(path, 0, 100)
    cache = Cache(path, sync=False)
    model = _Tiny.make(path)
    loader = DataLoader(cache.stream(seed=0), batch_size=16, num_workers=workers)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(model, loader)
    assert sorted(model.seen) == [0, 1, 2]
    for epoch, ids in model.seen.items():
        # every sample cached at the epoch's start, once: 100, then 120, then 140
        expected = list(range(100)) + list(range(1000, 1000 + 20 * epoch))
        assert sorted(ids) == expected, epoch
    assert model.seen[0] != model.seen[1][:100]  # reshuffled per epoch
    assert cache.leases() == []
