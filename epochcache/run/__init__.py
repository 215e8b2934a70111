"""``epochcache run``: YAML-configured training runs.

The run itself (`job`: daemon, epochs, metrics, checkpoints, plots, the process group
under torchrun), what a trainer gets and the turnover and metrics measured while it trains
(`context`), how a run stops on a signal (`signals`), its checkpoints and their agreement
across ranks (`checkpoint`), and the wait for ``train.min_samples`` (`fill_watch`).
"""

from __future__ import annotations

from .context import RunContext
from .job import (
    Run,
    check_entrypoint,
    ensure_demo_data,
    resolve_entrypoint,
    run_training,
)
from .signals import Terminated

__all__ = ["Run", "RunContext", "Terminated",
           "check_entrypoint", "ensure_demo_data", "resolve_entrypoint", "run_training"]
