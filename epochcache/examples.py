"""The built-in example trainer: a small classifier on the demo data.

``epochcache run configs/demo.yaml`` trains it, so the default config trains something real and
its loss falls. It doubles as the reference for writing a trainer of your own::

    def train_epoch(run: RunContext, epoch: int, loader) -> dict[str, float]:
        model = run.restore("model", make_model())          # created once, restored on --resume
        optimizer = run.restore("optimizer", make_optimizer(model))
        for batch in loader: ...
        return {"loss": mean_loss}                           # logged, saved in metrics.jsonl

``run.restore(name, obj)`` registers ``obj`` (anything with ``state_dict``) for checkpoints and
loads it from the checkpoint when the run resumes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .run import RunContext


def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of a demo batch (tar layout: ``{"npy": images, "cls": labels}``)."""
    if not isinstance(batch, Mapping) or "npy" not in batch or "cls" not in batch:
        kind = type(batch).__name__ if not isinstance(batch, Mapping) else f"fields {sorted(batch)}"
        raise ValueError(
            f"epochcache.examples:train_epoch expects the demo data's tar layout ({{'npy', 'cls'}} "
            f"fields) but got a batch of {kind}; point train.entrypoint at your own trainer"
        )
    images = torch.as_tensor(batch["npy"]).float()
    return images.reshape(images.shape[0], -1), torch.as_tensor(batch["cls"]).long()


def train_epoch(run: RunContext, epoch: int, loader: Any) -> dict[str, float]:
    """One epoch of a two-layer MLP with SGD; returns the mean loss and accuracy."""
    options = {"lr": 0.05, "hidden": 64, "num_classes": 4, **run.options}
    total_loss, total_correct, seen = 0.0, 0, 0
    model: nn.Module | None = run.state.get("model")
    optimizer: torch.optim.Optimizer | None = run.state.get("optimizer")
    for batch in loader:
        inputs, labels = _split(batch)
        if model is None or optimizer is None:
            torch.manual_seed(run.seed)
            model = run.restore("model", nn.Sequential(
                nn.Linear(inputs.shape[1], int(options["hidden"])),
                nn.ReLU(),
                nn.Linear(int(options["hidden"]), int(options["num_classes"])),
            ))
            optimizer = run.restore("optimizer", torch.optim.SGD(model.parameters(), lr=float(options["lr"])))
        if "ddp" not in run.state and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Gradients are averaged across ranks; the bare model is what gets checkpointed.
            run.state["ddp"] = nn.parallel.DistributedDataParallel(model)
        logits = run.state.get("ddp", model)(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total_loss += float(loss.detach()) * len(labels)
        total_correct += int((logits.argmax(1) == labels).sum())
        seen += len(labels)
    if seen == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}
    return {"loss": total_loss / seen, "accuracy": total_correct / seen, "samples": seen}
