"""What a trainer of ``epochcache run`` gets: its `RunContext`, and the loader wrapped
in a `TimedLoader` (which times the waits for batches and stops between two batches when
the run was asked to stop).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..config import EpochcacheConfig
from .checkpoint import MidEpoch, save_checkpoint
from .process_group import CPU, RunDevice
from .progress import TrainProgress, batch_len
from .signals import StopSignals


class RunContext:
    """What a trainer gets besides the loader: options, seed, and checkpointed state.

    Attributes:
        config: the validated config.
        options: ``train.options`` from the config.
        state: a dict the trainer may keep objects in across epochs.
        run_dir: where checkpoints, metrics and plots go.
        device: the ``torch.device`` to train on: ``cuda:LOCAL_RANK`` on a CUDA node (the
            current device already), else the CPU. Batches arrive in pinned memory on CUDA
            (unless ``loader.pin_memory`` says otherwise): copy them with
            ``.to(run.device, non_blocking=True)``.
    """

    def __init__(self, config: EpochcacheConfig, checkpoint: Mapping[str, Any] | None,
                 device: RunDevice = CPU) -> None:
        import torch

        self.config = config
        self.device = torch.device(device.name)
        self.options: dict[str, Any] = dict(config.train.options)
        self.seed = config.train.seed
        self.run_dir = Path(config.train.run_dir)
        self.state: dict[str, Any] = {}
        self._saved: Mapping[str, Any] = (checkpoint or {}).get("state", {})
        self._checkpointed: set[str] = set()

    def restore(self, name: str, obj: Any) -> Any:
        """Register ``obj`` (with ``state_dict``) for checkpoints; load it when resuming."""
        if name in self._saved:
            obj.load_state_dict(self._saved[name])
        self.state[name] = obj
        self._checkpointed.add(name)
        return obj

    def save_checkpoint(self, epoch: int, metrics: Mapping[str, Any],
                        resume: Mapping[str, Any] | None = None) -> Path:
        """Checkpoint after ``epoch`` (the last completed); ``resume``: where the epoch after
        it stands, for a mid-epoch checkpoint (see `MidEpoch`)."""
        payload: dict[str, Any] = {
            "epoch": epoch,
            "metrics": dict(metrics),
            "state": {name: self.state[name].state_dict() for name in sorted(self._checkpointed)},
        }
        if resume is not None:
            payload["resume"] = dict(resume)
        return save_checkpoint(self.run_dir, payload)


class TimedLoader:
    """Wraps a loader to measure how long the training loop waits for each batch, and to stop
    the epoch between two batches when a stop was requested (``stop``)."""

    def __init__(self, loader: Any, progress: TrainProgress | None = None,
                 stop: StopSignals | None = None, midepoch: MidEpoch | None = None) -> None:
        self.loader = loader
        self.wait_s = 0.0
        self.batches = 0
        self.progress = progress
        self.stop = stop or StopSignals()
        self.midepoch = midepoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self.midepoch is None:
            yield from self._batches()
            return
        with self.stop.deferring():  # a stop owes its checkpoint: a second Ctrl-C waits for it
            yield from self._batches()

    def _batches(self) -> Iterator[Any]:
        stop = self.stop
        stop.check()
        iterator = iter(self.loader)
        while True:
            start = time.perf_counter()
            if self.midepoch is not None:  # the last batch is trained on: checkpoint now?
                self.midepoch.at_boundary(self.batches)
            stop.check()
            try:
                batch = next(iterator)
            except StopIteration:
                self.wait_s += time.perf_counter() - start
                return
            stop.check()  # the batch is not trained on: the epoch is abandoned either way
            waited = time.perf_counter() - start
            self.wait_s += waited
            self.batches += 1
            progress = self.progress
            if progress is not None:  # plain fields, read by /metrics at scrape time
                progress.data_wait_s += waited
                progress.batches += 1
                progress.samples += batch_len(batch)
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
