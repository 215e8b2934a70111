"""The built-in example trainers: a small CNN on the demo images, an MLP on the npy demo data.

``epochcache run configs/demo.yaml`` trains :func:`train_image_classifier` (JPEG images of ten
shapes, with augmentation); ``configs/demo-npy.yaml`` trains :func:`train_epoch` (an MLP on
float arrays). They double as the reference for writing a trainer of your own::

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


def _images_and_labels(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)`` of an image batch: ``fields: [jpg, cls]`` tuples or field dicts."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        images, labels = batch
    elif isinstance(batch, Mapping) and "cls" in batch and len(batch) == 2:
        labels = batch["cls"]
        images = next(value for name, value in batch.items() if name != "cls")
    else:
        raise ValueError(
            "epochcache.examples:train_image_classifier expects (image, label) batches: set "
            "loader.fields: [\"jpg;png\", \"cls\"] and loader.image: torch"
        )
    images = torch.as_tensor(images)
    if images.ndim != 4:
        raise ValueError(f"expected a batch of images (B, C, H, W), got shape {tuple(images.shape)}")
    if images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = images.permute(0, 3, 1, 2)  # HWC arrays (loader.image: numpy)
    return images, torch.as_tensor(labels).long()


def make_cnn(num_classes: int, width: int = 16) -> nn.Module:
    """A small VGG-style CNN: four conv-BN-ReLU blocks (three halving the size), global pooling."""
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, width), nn.MaxPool2d(2), *block(width, 2 * width), nn.MaxPool2d(2),
        *block(2 * width, 4 * width), nn.MaxPool2d(2), *block(4 * width, 4 * width),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes),
    )


def train_image_classifier(run: RunContext, epoch: int, loader: Any) -> dict[str, float]:
    """One epoch of a small CNN with augmentation (random resized crop, flip, normalise).

    Options (``train.options``): ``lr`` (AdamW, default 0.005), ``size`` (crop side, 48),
    ``min_scale`` (smallest crop area, 0.35), ``width`` (channels of the first block, 16),
    ``num_classes`` (10). Returns the mean loss and the accuracy on the augmented batches.
    """
    from .augment import augment_batch

    options = {"lr": 0.005, "size": 48, "min_scale": 0.35, "width": 16, "num_classes": 10,
               **run.options}
    model: nn.Module | None = run.state.get("model")
    if model is None:
        torch.manual_seed(run.seed)
        model = run.restore("model", make_cnn(int(options["num_classes"]), int(options["width"])))
        run.restore("optimizer", torch.optim.AdamW(model.parameters(), lr=float(options["lr"]),
                                                   weight_decay=1e-4))
    optimizer: torch.optim.Optimizer = run.state["optimizer"]
    if "ddp" not in run.state and torch.distributed.is_available() and torch.distributed.is_initialized():
        run.state["ddp"] = nn.parallel.DistributedDataParallel(model)
    net = run.state.get("ddp", model)
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + epoch)
    model.train()
    total_loss, total_correct, seen = 0.0, 0, 0
    for batch in loader:
        images, labels = _images_and_labels(batch)
        inputs = augment_batch(images, int(options["size"]),
                               scale=(float(options["min_scale"]), 1.0), generator=generator)
        logits = net(inputs)
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
