"""``epochcache run``: YAML-configured training runs.

The run itself (`job`: daemon, epochs, metrics, checkpoints, plots), what a trainer gets and
what the run measures while it trains (`context`), how a run stops on a signal (`signals`),
its checkpoints and their agreement across ranks (`checkpoint`), the rank's device and the
process group under torchrun (`process_group`), and what it checks before training: its
sources, the wait for ``train.min_samples`` (`startup`).
"""

from __future__ import annotations

from .context import RunContext
from .job import Run, ensure_demo_data, run_training
from .signals import Terminated

# RunContext and Terminated: trainers' type hints (docs/howto/runs.md), callers' except.
__all__ = ["Run", "RunContext", "Terminated", "ensure_demo_data", "run_training"]
