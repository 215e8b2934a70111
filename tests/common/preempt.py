"""A small run to preempt, and the check that its resume trained the interrupted epoch exactly
once (tests/test_stop_signals.py, tests/test_slurm.py; the trainer is preempt_trainer.py).

The dataset is ``SAMPLES`` ``.npy`` files whose arrays hold their id; the cache holds all of it,
so every epoch's snapshot is the whole dataset. ``checkpoint_every_s`` is an hour: no periodic
checkpoint is written mid-epoch, so a resume that continues the interrupted epoch exactly can
only come from the checkpoint written on the stop.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

COMMON = Path(__file__).resolve().parent
SAMPLES = 64
BATCH = 4
EPOCHS = 3
HOLD_EPOCH = 1
HOLD_BATCH = 2  # the stop lands after batch 2 (3 batches) of epoch 1


def write_dataset(root: Path, count: int = SAMPLES) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        buf = io.BytesIO()
        np.save(buf, np.full(8, i, dtype=np.float32))
        (root / f"{i:06d}.npy").write_bytes(buf.getvalue())


def preempt_config(tmp: Path, *, save_s: float = 0.0, resume: str | bool = False,
                   hold: bool = True, hold_s: float = 120.0) -> dict[str, Any]:
    """The run's config: data, cache, run and log directories under ``tmp``."""
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    if not (tmp / "data").exists():
        write_dataset(tmp / "data")
    options: dict[str, Any] = {"log": str(tmp / "logs"), "save_s": save_s, "hold_s": hold_s}
    if hold:
        options["hold"] = f"{HOLD_EPOCH}:{HOLD_BATCH}"
    return {
        "source": {"url": (tmp / "data").as_uri(), "pattern": "*.npy"},
        "cache": {"dir": str(tmp / "cache"), "capacity": "1MiB"},
        "sampler": {"processes": 1, "concurrency": 4},
        "loader": {"batch_size": BATCH, "num_workers": 0},
        "train": {"epochs": EPOCHS, "min_samples": SAMPLES,
                  "entrypoint": "preempt_trainer:train_epoch", "run_dir": str(tmp / "run"),
                  "checkpoint_every_s": 3600, "plot": False, "options": options,
                  **({"resume": resume} if resume else {})},
    }


def write_config(tmp: Path, **kwargs: Any) -> Path:
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(preempt_config(tmp, **kwargs), sort_keys=False))
    return path


def rows(log_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = log_dir / f"rank{rank}.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed job
            pass
    return found


def holding(log_dir: Path, ranks: int) -> bool:
    """Whether every rank holds at its stop point (or has held)."""
    return all(any(row.get("hold") for row in rows(log_dir, rank)) for rank in range(ranks))


@dataclass
class Resumed:
    """What the first job trained of the interrupted epoch, and the resumed job."""

    first_batches: int  # of each rank, in the first job
    checkpoint_batches: int  # what the checkpoint after the stop covers
    problems: list[str]


def check_exactly_once(tmp: Path, ranks: int, checkpoint: dict[str, Any] | None) -> Resumed:
    """Check each rank's log: the interrupted epoch's samples trained exactly once across the
    two jobs (the first job's batches, then the resumed job's), in the epoch's order, and the
    checkpoint after the stop (when given) covers every batch the first job trained."""
    problems: list[str] = []
    mid = (checkpoint or {}).get("resume") or {}
    covered = int(mid.get("batches", 0))
    if checkpoint is not None and mid.get("epoch") != HOLD_EPOCH:
        problems.append(f"the checkpoint after the stop is not one of epoch {HOLD_EPOCH}'s "
                        f"middle (epoch {checkpoint.get('epoch')} done, resume {mid or None}): "
                        "the stop's checkpoint was not written")
    first_batches = -1
    for rank in range(ranks):
        log = rows(tmp / "logs", rank)
        if not log:
            problems.append(f"rank {rank}: no log")
            continue
        first_pid = log[0]["pid"]
        later = next((i for i, row in enumerate(log) if row["pid"] != first_pid), len(log))
        first, second = log[:later], log[later:]
        order = next(row["order"] for row in first if row.get("epoch") == HOLD_EPOCH
                     and "order" in row)
        trained_first = [i for row in first if row.get("epoch") == HOLD_EPOCH and "ids" in row
                         for i in row["ids"]]
        trained_after = [i for row in second if row.get("epoch") == HOLD_EPOCH and "ids" in row
                         for i in row["ids"]]
        batches = sum(1 for row in first if row.get("epoch") == HOLD_EPOCH and "ids" in row)
        first_batches = batches
        if trained_first + trained_after != order:
            twice = sorted(k for k, n in Counter(trained_first + trained_after).items() if n > 1)
            skipped = sorted(set(order) - set(trained_first + trained_after))
            problems.append(f"rank {rank}: epoch {HOLD_EPOCH} not trained exactly once in order: "
                            f"{batches} batches before the stop, {len(trained_after) // BATCH} "
                            f"after; {len(twice)} samples twice, {len(skipped)} skipped")
        if covered and covered != batches:
            problems.append(f"rank {rank}: the checkpoint covers {covered} batches, the first "
                            f"job trained {batches}")
        ends = Counter(row["epoch"] for row in log if "order" in row)
        if second and sorted(row["epoch"] for row in second if "order" in row) != list(
                range(HOLD_EPOCH, EPOCHS)):
            problems.append(f"rank {rank}: the resumed job trained epochs {dict(ends)}")
    return Resumed(first_batches, covered, problems)


def metrics_epochs(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["epoch"] for line in path.read_text().splitlines() if line.strip()]
