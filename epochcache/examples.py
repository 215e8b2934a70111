"""The built-in example trainers: a small CNN on the demo images, an MLP on the npy demo data.

``epochcache run configs/demo.yaml`` trains `train_image_classifier` (JPEG images of ten
shapes, with augmentation); ``configs/demo-npy.yaml`` trains `train_epoch` (an MLP on
float arrays). They double as the reference for writing a trainer of your own::

    def train_epoch(run: RunContext, epoch: int, loader) -> dict[str, float]:
        model = run.restore("model", make_model())          # created once, restored on --resume
        optimizer = run.restore("optimizer", make_optimizer(model))
        for batch in loader: ...
        return {"loss": mean_loss}                           # logged, saved in metrics.jsonl

``run.restore(name, obj)`` registers ``obj`` (anything with ``state_dict``) for checkpoints and
loads it from the checkpoint when the run resumes.

On a CUDA node the model lives on ``run.device`` (the rank's GPU, already the current device),
is wrapped in DistributedDataParallel with that device under torchrun, and batches are copied
to it with ``non_blocking=True`` (the run pins them). Losses and counts add up on the device,
read once per epoch: a ``float()`` per batch would wait for the GPU at every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from .run import RunContext


def _wrap_ddp(run: RunContext, model: nn.Module) -> nn.Module:
    """``model`` in DistributedDataParallel under torch.distributed (created once; gradients
    averaged across ranks), else itself; the bare model is what gets checkpointed."""
    if "ddp" not in run.state and torch.distributed.is_available() \
            and torch.distributed.is_initialized():
        device_ids = [run.device] if run.device.type == "cuda" else None  # a CPU module: None
        run.state["ddp"] = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    return cast(nn.Module, run.state.get("ddp", model))


class _Totals:
    """Loss and accuracy summed on the device, read once at the end of an epoch."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = 0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        self.loss += loss.detach().double() * len(labels)
        self.correct += (logits.detach().argmax(1) == labels).sum()
        self.seen += len(labels)

    def result(self) -> dict[str, float]:
        if self.seen == 0:
            return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}
        return {"loss": float(self.loss) / self.seen, "accuracy": int(self.correct) / self.seen,
                "samples": self.seen}


def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of a demo batch: the tar layout's ``{"npy": images, "cls": labels}``,
    or ``(inputs, labels)`` tuples (``loader.fields: [npy, cls]``)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        batch = {"npy": batch[0], "cls": batch[1]}
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
    device = run.device
    totals = _Totals(device)
    model: nn.Module | None = run.state.get("model")
    optimizer: torch.optim.Optimizer | None = run.state.get("optimizer")
    for batch in loader:
        inputs, labels = _split(batch)
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if model is None or optimizer is None:
            torch.manual_seed(run.seed)
            # On the device before the optimizer exists: its state follows the parameters.
            model = run.restore("model", nn.Sequential(
                nn.Linear(inputs.shape[1], int(options["hidden"])),
                nn.ReLU(),
                nn.Linear(int(options["hidden"]), int(options["num_classes"])),
            )).to(device)
            optimizer = run.restore("optimizer", torch.optim.SGD(model.parameters(), lr=float(options["lr"])))
        logits = _wrap_ddp(run, model)(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        totals.add(loss, logits, labels)
    return totals.result()


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
    device = run.device
    model: nn.Module | None = run.state.get("model")
    if model is None:
        torch.manual_seed(run.seed)
        model = run.restore("model", make_cnn(int(options["num_classes"]), int(options["width"])))
        model.to(device)  # before the optimizer exists: its state follows the parameters
        run.restore("optimizer", torch.optim.AdamW(model.parameters(), lr=float(options["lr"]),
                                                   weight_decay=1e-4))
    optimizer: torch.optim.Optimizer = run.state["optimizer"]
    net = _wrap_ddp(run, model)
    # Crop and flip parameters come from a CPU generator, so they are the same on any device.
    generator = torch.Generator().manual_seed(run.seed * 1_000_003 + epoch)
    model.train()
    totals = _Totals(device)
    for batch in loader:
        images, labels = _images_and_labels(batch)
        # uint8 images travel (a quarter of float32's bytes); augmenting runs on the device.
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        inputs = augment_batch(images, int(options["size"]),
                               scale=(float(options["min_scale"]), 1.0), generator=generator)
        logits = net(inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        totals.add(loss, logits, labels)
    return totals.result()
