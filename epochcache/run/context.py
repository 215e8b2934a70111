"""What a trainer of ``epochcache run`` gets, and what the run measures besides the loss.

A trainer gets its `RunContext` and the loader wrapped in a `TimedLoader`, which times the waits
for batches (into the run's `TrainProgress`) and stops between two batches when the run was
asked to stop.

**Turnover.** An epoch releases each batch's samples once it has trained on them (progressive
release, docs/guide/turnover.md), so once the cache is full the samplers replace what the epoch has
trained on while it goes on: the new data per epoch is about ``min(ingest rate x epoch time,
what the epoch trains on)``. `Turnover` reports, per epoch, the samples new to the
epoch's snapshot (sequence numbers above the previous snapshot's) and the fraction of the epoch
the samplers spent waiting for space (from their health documents, which lag by up to 2 s).
Samplers that wait most of an epoch bring samples faster than training uses them up; the log
says so once, and that a larger headroom would not bring more.

**Metrics.** With ``train.metrics_port`` the training process serves ``/metrics``
(prometheus-client) with the data-wait seconds, batches, samples and epoch, plus the last
epoch's turnover; values are plain fields updated once per batch and read at scrape time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import EpochcacheConfig
from ..epoch_record import GAUGES
from ..store import SampleStore
from ..units import format_size
from .checkpoint import MidEpoch, save_checkpoint
from .process_group import CPU, RunDevice
from .signals import StopSignals

log = logging.getLogger("epochcache.run")

#: Above this fraction of an epoch spent waiting on leases, the run log says how to raise it.
WAIT_HINT_FRACTION = 0.5


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
        # With mid-epoch checkpoints a stop owes one: a second Ctrl-C waits for it.
        with self.stop.deferring() if self.midepoch is not None else nullcontext():
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


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading dimension of a tensor/array, of the first value of a
    dict or of the first field of a tuple; the length of a list (of samples)."""
    for _ in range(4):  # nested dicts/tuples of fields
        if isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, tuple) and batch:
            batch = batch[0]
        else:
            break
    shape = getattr(batch, "shape", None)
    if shape:
        return int(shape[0])
    return len(batch) if isinstance(batch, list) else 1


@dataclass
class TrainProgress:
    """Counters of the training loop, read by `train_metrics` at scrape time."""

    data_wait_s: float = 0.0
    batches: int = 0
    samples: int = 0
    epoch: int = -1
    #: The last finished epoch's row (`epochcache.epoch_record`): its gauges.
    last_epoch: dict[str, Any] = field(default_factory=dict)


def train_metrics(progress: TrainProgress) -> Iterator[Any]:
    """The metric families of one scrape of the training side."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield CounterMetricFamily("epochcache_train_data_wait_seconds",
                              "Seconds the training loop waited for batches.",
                              value=progress.data_wait_s)
    yield CounterMetricFamily("epochcache_train_batches", "Batches the training loop took.",
                              value=progress.batches)
    yield CounterMetricFamily("epochcache_train_samples", "Samples the training loop took.",
                              value=progress.samples)
    yield GaugeMetricFamily("epochcache_train_epoch", "The epoch training now (-1 before "
                            "the first).", value=progress.epoch)
    for figure in GAUGES:  # the last finished epoch's figures (epochcache.epoch_record)
        assert figure.gauge is not None
        value = progress.last_epoch.get(figure.name)
        yield GaugeMetricFamily(figure.gauge, f"The last finished epoch: {figure.help}.",
                                value=0.0 if value is None else float(value))


@dataclass
class _Mark:
    time: float
    waits: dict[str, float]
    ingested_bytes: int


class Turnover:
    """Per-epoch turnover of one run (see the module docstring).

    Args:
        hint: log the hint when writers waited most of an epoch (one rank of a run does).
    """

    def __init__(self, hint: bool = True) -> None:
        self._last_seq: int | None = None
        self._hinted = not hint

    @staticmethod
    def mark(cache: SampleStore) -> _Mark:
        """What the samplers have waited so far, and what the cache has ingested."""
        waits = {name: float(doc.get("lease_wait_s", 0.0))
                 for name, doc in cache.tables.states("sampler/").items()}
        counters = cache.counters()
        return _Mark(time.monotonic(), waits, counters.bytes + counters.evicted_bytes)

    def measure(self, cache: SampleStore, start: _Mark, seqs: np.ndarray) -> dict[str, Any]:
        """``new_samples``, ``snapshot_samples`` and ``writer_wait_fraction`` (None without
        samplers) of the epoch that began at ``start`` and trained on ``seqs``."""
        end = self.mark(cache)
        elapsed = max(1e-9, end.time - start.time)
        waited = [end.waits[name] - start.waits[name] for name in end.waits if name in start.waits]
        fraction = None
        if waited:
            fraction = round(min(1.0, max(0.0, sum(waited) / len(waited) / elapsed)), 4)
        if len(seqs):
            newest = int(seqs.max())
            new = len(seqs) if self._last_seq is None else int(np.count_nonzero(seqs > self._last_seq))
            self._last_seq = newest
        else:
            new = 0
        row = {"new_samples": new, "snapshot_samples": int(len(seqs)),
               "writer_wait_fraction": fraction}
        self._hint(cache, row, end.ingested_bytes - start.ingested_bytes, elapsed)
        return row

    def _hint(self, cache: SampleStore, row: dict[str, Any], ingested: int, elapsed: float) -> None:
        fraction = row["writer_wait_fraction"]
        if self._hinted or fraction is None or fraction <= WAIT_HINT_FRACTION:
            return
        self._hinted = True
        log.info(
            "the samplers waited %.0f%% of the epoch (%.0fs) for space: they bring samples "
            "faster than training uses them up. Each sample an epoch trains on is released and "
            "replaced during the epoch (this epoch's snapshot had %d new samples of %d; %s "
            "ingested), so a larger cache.headroom would not bring more: turnover is bounded by "
            "what training reads. See docs/guide/turnover.md.",
            100 * fraction, elapsed, row["new_samples"], row["snapshot_samples"],
            format_size(ingested),
        )
