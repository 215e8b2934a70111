"""What an epoch of ``epochcache run`` trained on: its manifest and its coverage, per rank.

A run records the samples of an epoch in two places once the model has kept them: the epoch's
manifest in the run directory (`epochcache.store.manifests`: the keys, in order) and the
cache's coverage ledger (`epochcache.store.ledger`: one more epoch for each sample). It
does so when a mid-epoch checkpoint covers part of the epoch (``train.checkpoint_every_s``)
and when the epoch ends, each time for the batches since the last time. So an epoch stopped
and resumed from its checkpoint records each of its samples once, and an epoch a job dies in
without a checkpoint records nothing (it is trained again, from its start, on resume).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ..errors import CacheError
from ..store import SampleStore
from ..store.manifests import ManifestWriter

log = logging.getLogger(__name__)


class TrainedRecord:
    """Records the batches one epoch's loop has trained on, on this rank.

    Args:
        cache: the cache the epoch reads.
        loader: the epoch's [`EpochLoader`][epochcache.data.epoch_loader.EpochLoader].
        epoch: the epoch.
        batch_size: samples per batch (the loader's).
        run_dir: where the manifest goes; None writes none (``train.manifests: false``).
        rank: the global rank.
        job: what the coverage ledger names the job by.
        sources: the names of the config's ``sources:`` entries.
    """

    def __init__(self, cache: SampleStore, loader: Any, epoch: int, *, batch_size: int,
                 run_dir: Path | None, rank: int, job: str, sources: list[str]) -> None:
        self.cache, self.loader, self.epoch = cache, loader, epoch
        self.batch_size, self.job = batch_size, job
        self.done = 0  # batches recorded
        self.trained = self.new = 0
        state = self._state()
        self.manifest = None if run_dir is None or state is None else ManifestWriter(
            cache, run_dir, epoch=epoch, rank=rank, lease=str(state.get("lease") or ""),
            position=int(state.get("position", 0)), sources=sources)

    def _state(self) -> dict[str, Any] | None:
        state = getattr(self.loader, "state_dict", None)
        return None if state is None else dict(state())

    def cover(self, batches: int) -> None:
        """The first ``batches`` batches are trained and kept (a checkpoint or the epoch's
        end): record those not recorded yet. Failures are logged, never raised: an audit
        record must not stop training."""
        if batches <= self.done:
            return
        seqs = np.asarray(self.loader.seqs)[self.done * self.batch_size:
                                            batches * self.batch_size]
        self.done = batches
        try:
            if self.manifest is not None:
                state = self._state() or {}
                self.manifest.write(seqs, int(state.get("position", self.manifest.position)))
            counted = self.cache.record_trained(seqs, epoch=self.epoch, job=self.job)
            self.trained += counted["trained"]
            self.new += counted["new"]
        except (OSError, ValueError, lmdb.Error, CacheError) as exc:
            log.warning("epoch %d: could not record what it trained on (manifest, coverage): "
                        "%s", self.epoch, exc)


def coverage_row(cache: SampleStore, record: TrainedRecord) -> dict[str, Any]:
    """The epoch's line of ``metrics.jsonl`` on coverage: this rank's samples recorded
    (``trained``, ``new``: never trained before) and the cache's coverage after it, summed over
    sources (``covered`` of ``samples``, the epochs-per-sample ``histogram``, ``eta_s``)."""
    report = cache.coverage()
    sources = report["sources"]
    covered = sum(row["covered"] for row in sources)
    samples = sum(row["samples"] for row in sources)
    histogram: dict[str, int] = {}
    for row in sources:
        for label, count in row["histogram"].items():
            histogram[label] = histogram.get(label, 0) + count
    etas = [row["eta_s"] for row in sources]
    return {"trained": record.trained, "new": record.new, "covered": covered,
            "samples": samples, "fraction": round(covered / samples, 6) if samples else 0.0,
            # this node's part of the sources, which eta_s is the time to see
            "share": sum(row["share"] for row in sources),
            "num_nodes": max((row["num_nodes"] for row in sources), default=1),
            "estimated": any(row["estimated"] for row in sources),
            "histogram": histogram,
            "eta_s": None if not etas or None in etas else max(etas),
            "unattributed": report["unattributed"]}
