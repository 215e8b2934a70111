"""``epochcache run``: YAML-configured training runs.

The run itself (:mod:`.job`: daemon, epochs, metrics, checkpoints, plots, the process group
under torchrun), what a trainer gets (:mod:`.context`), how a run stops on a signal
(:mod:`.signals`), its per-epoch figures (:mod:`.metrics`), its checkpoints and their agreement
across ranks (:mod:`.checkpoint`), and the wait for ``train.min_samples`` (:mod:`.fill_watch`).
"""

from __future__ import annotations

from .context import RunContext
from .job import (
    Run,
    add_config_parser,
    add_run_parser,
    check_entrypoint,
    ensure_demo_data,
    resolve_entrypoint,
    run_training,
)
from .signals import Terminated

__all__ = ["Run", "RunContext", "Terminated", "add_config_parser", "add_run_parser",
           "check_entrypoint", "ensure_demo_data", "resolve_entrypoint", "run_training"]
