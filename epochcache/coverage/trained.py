"""What an epoch of ``epochcache run`` trained on: its manifest and its coverage, per rank.

A run records the samples of an epoch in two places once the model has kept them: the epoch's
manifest in the run directory (`epochcache.coverage.manifests`: the keys, in order) and the
cache's coverage ledger (`epochcache.coverage.ledger`: one more epoch for each sample). It
does so when a mid-epoch checkpoint covers part of the epoch (``train.checkpoint_every_s``)
and when the epoch ends, each time for the batches since the last time: before the checkpoint
is written, the manifest's record is appended and the coverage *staged*; once it is written,
the staged coverage is counted (`epochcache.coverage.staged`). So an epoch stopped and resumed
from its checkpoint records each of its samples once, whenever the job was killed (while it
wrote the checkpoint too), and an epoch a job dies in without a checkpoint records nothing (it
is trained again, from its start, on resume).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ..errors import CacheError
from ..store import SampleStore
from . import bucketed, coverage, staged
from .ledger import record_trained
from .manifests import ManifestWriter

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
        run: the run's key for staged coverage (`staged.run_key` of its directory).
    """

    def __init__(self, cache: SampleStore, loader: Any, epoch: int, *, batch_size: int,
                 run_dir: Path | None, rank: int, job: str, sources: list[str],
                 run: str) -> None:
        self.cache, self.loader, self.epoch = cache, loader, epoch
        self.batch_size, self.job, self.run = batch_size, job, run
        self.done = 0  # batches recorded
        self.trained = self.new = 0
        #: Staged and not counted yet: token -> seqs (the next checkpoint covers them).
        self.staged: dict[str, np.ndarray] = {}
        state = self._state()
        self.manifest = None if run_dir is None or state is None else ManifestWriter(
            cache, run_dir, epoch=epoch, rank=rank, lease=str(state.get("lease") or ""),
            position=int(state.get("position", 0)), sources=sources, lane=_lane(state))

    def _state(self) -> dict[str, Any] | None:
        # Not state_dict(): a state taken keeps the epoch's lease for a resume, and only a
        # checkpoint may say the epoch can be resumed (without one, a stop releases it).
        state = getattr(self.loader, "position_state", None)
        return None if state is None else dict(state())

    def stage(self, batches: int) -> str | None:
        """The first ``batches`` batches are trained, and the checkpoint about to be written
        (mid-epoch, or at the epoch's end) keeps them: append those not recorded yet to the
        manifest and stage their coverage; returns its token, for the checkpoint to name
        (None: nothing staged). Failures are logged, never raised: an audit record must not
        stop training."""
        if batches <= self.done:
            return None
        seqs = np.asarray(self.loader.seqs)[self.done * self.batch_size:
                                            batches * self.batch_size]
        self.done = batches
        try:
            if self.manifest is not None:
                state = self._state() or {}
                self.manifest.write(seqs, int(state.get("position", self.manifest.position)))
            token = staged.stage(self.cache, seqs, run=self.run, epoch=self.epoch, job=self.job)
        except (OSError, ValueError, lmdb.Error, CacheError) as exc:
            log.warning("epoch %d: could not record what it trained on (manifest, coverage): "
                        "%s", self.epoch, exc)
            return None
        self.staged[token] = seqs
        return token

    def commit(self) -> None:
        """The checkpoint that names the staged coverage is written: count it."""
        for token in list(self.staged):
            try:
                counted = staged.commit(self.cache, token)
            except (OSError, ValueError, lmdb.Error, CacheError) as exc:
                log.warning("epoch %d: could not count what it trained on in the coverage "
                            "ledger (%s); tried again after the next checkpoint, or by "
                            "--resume", self.epoch, exc)
                return
            del self.staged[token]
            self.trained += counted["trained"]
            self.new += counted["new"]

    def preview(self) -> dict[str, Any]:
        """What counting the staged coverage will add (``trained``, ``new``,
        ``unattributed``) and each ledger's summary then (``summaries``, by fingerprint)."""
        nothing: dict[str, Any] = {"trained": 0, "new": 0, "unattributed": 0, "summaries": {}}
        if not self.staged:
            return nothing
        try:
            return record_trained(self.cache, np.concatenate(list(self.staged.values())),
                                  epoch=self.epoch, job=self.job, commit=False)
        except (OSError, ValueError, lmdb.Error, CacheError) as exc:
            log.warning("epoch %d: could not read the coverage ledger: %s", self.epoch, exc)
            return nothing


def _lane(state: dict[str, Any]) -> dict[str, Any] | None:
    """The lane a loader state's positions count along (see `epochcache.coverage.manifests`)."""
    if "local_rank" not in state:
        return None
    return {"local_rank": int(state["local_rank"]),
            "local_world_size": int(state["local_world_size"]),
            "split": state.get("resumed")}


def coverage_row(cache: SampleStore, record: TrainedRecord) -> dict[str, Any]:
    """The epoch's line of ``metrics.jsonl`` on coverage: this rank's samples recorded
    (``trained``, ``new``: never trained before) and the cache's coverage after it, summed over
    sources (``covered`` of ``samples``, the epochs-per-sample ``histogram``, ``eta_s``). What
    is staged for the epoch's checkpoint counts as counted (it is, once that is written)."""
    pending = record.preview()
    report = coverage(cache)
    by_ledger = {row.get("fingerprint"): row for row in report["sources"]}
    for fingerprint, summary in pending["summaries"].items():
        # (a ledger not written yet: one node's, as a new ledger's header says)
        row = by_ledger.setdefault(fingerprint, {"eta_s": None, "num_nodes": 1,
                                                 "estimated": bool(summary.get("estimated"))})
        row.update(samples=int(summary["samples"]), covered=int(summary["covered"]),
                   histogram=bucketed(list(summary["histogram"])))
        row["share"] = math.ceil(row["samples"] / max(1, int(row["num_nodes"])))
    sources = list(by_ledger.values())
    covered = sum(row["covered"] for row in sources)
    samples = sum(row["samples"] for row in sources)
    histogram: dict[str, int] = {}
    for row in sources:
        for label, count in row["histogram"].items():
            histogram[label] = histogram.get(label, 0) + count
    etas = [row["eta_s"] for row in sources]
    return {"trained": record.trained + pending["trained"], "new": record.new + pending["new"],
            "covered": covered,
            "samples": samples, "fraction": round(covered / samples, 6) if samples else 0.0,
            # this node's part of the sources, which eta_s is the time to see
            "share": sum(row["share"] for row in sources),
            "num_nodes": max((row["num_nodes"] for row in sources), default=1),
            "estimated": any(row["estimated"] for row in sources),
            "histogram": histogram,
            "eta_s": None if not etas or None in etas else max(etas),
            "unattributed": report["unattributed"] + pending["unattributed"]}
