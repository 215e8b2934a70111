"""``epochcache run CONFIG [--resume]``: a YAML-configured training run.

The run validates the whole config and reaches the source before anything starts (bad config or
unreachable source: exit 2), writes the demo dataset on first use when ``source.demo_samples`` is
set, starts the sampler daemon in this process (or attaches to one already filling the cache),
waits for ``train.min_samples``, then calls the trainer named by ``train.entrypoint`` once per
epoch through [`Cache.epochs`][epochcache.Cache.epochs]. After each epoch it logs loss, samples, cache fill,
evictions and the data-wait fraction, appends them to ``metrics.jsonl`` and checkpoints to the
run directory; ``--resume`` continues at the next epoch (mid-epoch, from a checkpoint of
``train.checkpoint_every_s``). Ctrl-C (or SIGTERM) stops cleanly at the next batch
(`epochcache.run.signals`): the daemon stopped if the run started it, the last checkpoint kept,
the epoch's lease left for the resume if a checkpoint named it, else released (what a stop
keeps: docs/guide/resume.md, "Every stop is a resume point"). On a CUDA node each rank trains
on its own GPU (``RunContext.device``; `epochcache.run.process_group`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..config import EpochcacheConfig
from ..coverage.manifests import TrainedSpans, coverage_row
from ..epoch_record import history_row, log_line
from ..errors import ConfigError, DaemonAlreadyRunning
from ..ingest.health import describe_requests, request_delta, request_totals
from ..ingest.prometheus import MetricsServer, require_prometheus
from ..ingest.supervisor import DaemonLock, Supervisor
from ..options import LoaderOptions
from ..paths import check_writable
from ..placement import Placement
from ..redact import redact_url
from ..store import SampleStore
from ..store.plumbing import append_history
from .checkpoint import MidEpoch, checkpointed_coverage, loader_states, resume_checkpoint
from .context import RunContext, TimedLoader, TrainProgress, Turnover, train_metrics
from .process_group import CPU, RunDevice
from .signals import Interrupted, StopSignals, Terminated, quiet_worker, shelter_forkserver
from .startup import check_run_sources

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
TrainFn = Callable[["RunContext", int, Any], Mapping[str, Any]]


def check_entrypoint(spec: str) -> None:
    """Check that the module of ``package.module:function`` exists, without importing it (a
    trainer imports torch, which takes seconds: a bad source must fail before that).

    Raises:
        ConfigError: the module cannot be found (the message names ``train.entrypoint``).
    """
    module_name = spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except (ImportError, ValueError) as exc:  # a parent package fails to import
        raise ConfigError(f"train.entrypoint: cannot import {module_name!r} ({exc}); check the "
                          "module path") from exc
    if not found:
        raise ConfigError(f"train.entrypoint: cannot import {module_name!r} (No module named "
                          f"{module_name!r}); check the module path")


def resolve_entrypoint(spec: str) -> TrainFn:
    """Import ``package.module:function``; raise ConfigError naming ``train.entrypoint``."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"train.entrypoint: cannot import {module_name!r} ({exc}); check the module path") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"train.entrypoint: {module_name!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def ensure_demo_data(config: EpochcacheConfig) -> None:
    """Write the demo dataset at each source's url whose ``demo_samples`` is set and where
    nothing is there."""
    from ..demo import write_demo_data
    from ..ingest.remote import open_fs, translate_errors

    for entry in config.source_entries():
        source = entry.config
        samples = source.demo_samples
        if samples is None:
            continue
        shown = redact_url(source.url)
        with translate_errors(shown):  # unreachable: SourceUnavailable (exit 2), not a traceback
            fs, root = open_fs(source.url, source.storage_options, timeout_s=source.timeout_s,
                               connect_timeout_s=source.connect_timeout_s)
            if fs.exists(root) and fs.ls(root):
                continue
        log.info("writing the demo dataset (%d samples) to %s", samples, shown)
        layout = "tar" if source.layout == "tar" else "files"
        write_demo_data(source.url, samples, layout, source.storage_options,  # type: ignore[arg-type]
                        kind=source.demo_kind)


def _loader_options(config: EpochcacheConfig, device: RunDevice = CPU) -> LoaderOptions:
    # Workers leave Ctrl-C and a stranger's SIGTERM to the run, which stops them in order.
    return dataclasses.replace(config.loader_options(cuda=device.is_cuda),
                               worker_init_fn=quiet_worker)


def _local_sources(config: EpochcacheConfig) -> set[str]:
    """The labels of the sources read from this machine's filesystem (no GETs)."""
    from fsspec.utils import get_protocol

    from ..ingest.health import source_label

    return {source_label(entry.name) for entry in config.source_entries()
            if get_protocol(str(entry.config.url)) in ("file", "local")}


class Run:
    """One training run: daemon (started or attached), epochs, metrics, checkpoints, plots."""

    def __init__(self, config: EpochcacheConfig, *, resume: bool | str = False,
                 is_main: bool = True, node_rank: int = 0, stop: StopSignals | None = None,
                 rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.config = config
        self.stop = stop or StopSignals()
        self.device = CPU  # run_training sets the rank's device once torch is imported
        self.resume = resume
        self.is_main = is_main  # global rank 0: the one that writes the run directory
        self.node_rank = node_rank
        self.rank, self.world_size = rank, world_size
        self.local_rank = local_rank  # 0: the rank that says what concerns the node, once
        self.run_dir = Path(config.train.run_dir)
        check_entrypoint(config.train.entrypoint)
        self._train_fn: TrainFn | None = None  # imported once the source is known to be there
        self.daemon: Supervisor | None = None
        self._daemon_thread: threading.Thread | None = None
        self._daemon_status: int | None = None
        self._daemon_error: BaseException | None = None
        self.metrics: list[dict[str, Any]] = []
        self.progress = TrainProgress()
        self.turnover = Turnover(hint=is_main)
        self.metrics_server: MetricsServer | None = None
        self.started_at = time.time()  # staged coverage older than this is an earlier attempt's

    def serve_metrics(self, local_rank: int = 0) -> None:
        """Serve the training side's /metrics when ``train.metrics_port`` is set (the port
        plus the local rank: each rank of a node serves its own)."""
        train = self.config.train
        if train.metrics_port is None:
            return
        port = train.metrics_port + local_rank if train.metrics_port else 0
        progress = self.progress
        self.metrics_server = MetricsServer(lambda: train_metrics(progress), train.metrics_host,
                                            port, "train.metrics_port")

    @property
    def train_fn(self) -> TrainFn:
        """The trainer (imported on first use: it imports torch)."""
        if self._train_fn is None:
            self._train_fn = resolve_entrypoint(self.config.train.entrypoint)
        return self._train_fn

    def start_daemon(self) -> None:
        """Start the samplers unless a daemon already fills this cache (then attach to it)."""
        cache_dir = str(self.config.cache.dir)
        if DaemonLock.is_held(cache_dir):
            log.info("attaching to the daemon already filling %s", cache_dir)
            return
        daemon = Supervisor(self.config)
        try:
            # Takes the daemon lock before opening the cache with the config's capacity, then
            # lists the source: raises SourceUnavailable before anything starts.
            daemon.prepare()
        except DaemonAlreadyRunning:
            log.info("attaching to the daemon that just started filling %s", cache_dir)
            return
        self.daemon = daemon
        self._daemon_thread = threading.Thread(target=self._run_daemon, name="epochcache-daemon",
                                               daemon=True)
        self._daemon_thread.start()

    def _run_daemon(self) -> None:
        daemon = self.daemon
        if daemon is None:
            return
        try:
            self._daemon_status = daemon.run()
        except BaseException as exc:  # reported by daemon_exit() and logged here
            self._daemon_error = exc
            log.error("the daemon stopped on %s: %s", type(exc).__name__, exc, exc_info=exc)

    def daemon_exit(self) -> str | None:
        """None while the daemon this run started runs; else how it ended, with its cause."""
        thread = self._daemon_thread
        if thread is None or thread.is_alive():
            return None
        if self._daemon_error is not None:
            return f"{type(self._daemon_error).__name__}: {self._daemon_error}"
        failure = self.daemon.failure if self.daemon is not None else None
        return f"exit status {self._daemon_status}" + (f" ({failure})" if failure else "")

    def stop_daemon(self) -> None:
        if self.daemon is not None and self._daemon_thread is not None:
            self.daemon.stop()
            self._daemon_thread.join()
            self.daemon = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None

    def train(self) -> int:
        # Under DDP every rank resumes from rank 0's checkpoint: ranks that computed their own
        # start epoch (run directories not shared) waited for each other's epochs forever.
        checkpoint = resume_checkpoint(self.run_dir, self.node_rank) if self.resume else None
        start = 0 if checkpoint is None else int(checkpoint["epoch"]) + 1
        loader_state = loader_states(checkpoint)
        if loader_state is not None:  # the interrupted epoch, from its positions
            start = int(checkpoint["resume"]["epoch"])  # type: ignore[index]
        total = self.config.train.epochs
        if self.resume == "auto" and self.is_main:
            what = (f"no checkpoint in {self.run_dir}: starting at epoch 0" if checkpoint is None
                    else f"resuming at epoch {start}")
            log.info("train.resume: auto: %s%s", what, _restart_note(os.environ))
        if self.resume and (checkpoint is not None or self.resume != "auto"):
            self.metrics = _read_metrics(self.run_dir / METRICS, before=start, rewrite=self.is_main)
            if checkpoint is None and self.is_main:
                log.warning("--resume: no checkpoint in %s; starting at epoch 0", self.run_dir)
        cfg = self.config.cache
        cache = SampleStore(cfg.dir, capacity=cfg.capacity, headroom=cfg.headroom_bytes,
                            eviction=cfg.eviction)
        self._settle_coverage(cache, checkpoint)
        if start >= total:
            cache.close()
            log.info("all %d epochs are done (checkpoint of epoch %d)", total, start - 1)
            return 0
        context = RunContext(self.config, checkpoint, self.device)
        loader_options = _loader_options(self.config, self.device)
        try:
            # The wait ends with an error naming train.min_samples (or starts on a smaller,
            # wholly cached source) as soon as the number is known to be out of reach.
            from ..data.schedule import wait_for_samples
            from .startup import FillWatch

            watch = FillWatch(cache, loader_options.min_samples,
                              self.daemon_exit if self._daemon_thread is not None else None,
                              announce=self.local_rank == 0)

            def judge(count: int) -> bool:
                self.stop.check()  # polled every 0.5 s: Ctrl-C ends the wait
                return watch(count)

            wanted = loader_options.min_samples
            loader_options = dataclasses.replace(
                loader_options,
                min_samples=min(wanted, wait_for_samples(cache, wanted, judge=judge)))
            self.stop.check()
        except BaseException:
            cache.close()
            raise
        from ..data.epochs import epochs_of
        from .process_group import barrier

        epochs = epochs_of(cache, total - start, self.config.loader.reader_options(),
                           self.config.epoch_options(), loader_options, start_epoch=start,
                           resume=loader_state)
        try:
            for epoch, loader in epochs:
                self.stop.check()  # a stop requested at the epoch boundary: no new epoch
                spans = self._run_epoch(cache, context, epoch, loader)
                barrier()  # rank 0's checkpoint of the epoch is written before any rank...
                spans.commit()  # ... counts what it covers (coverage/staged.py)
                self.stop.check()  # before the next epoch is waited for
        finally:
            close = getattr(epochs, "close", None)
            if close is not None:
                close()  # releases the leases of the current and the prepared epoch
            from ..status import forget_trainer

            forget_trainer(cache)  # no longer a trainer of this cache (status)
            cache.close()
        return 0

    def _run_epoch(self, cache: SampleStore, context: RunContext, epoch: int,
                   loader: Any) -> TrainedSpans:
        before = cache.counters()
        requests_before = request_totals(cache)
        mark = self.turnover.mark(cache)
        self.progress.epoch = epoch
        every = self.config.train.checkpoint_every_s
        midepoch = None if every is None else MidEpoch(
            context, loader, epoch, every_s=every, grace_s=self.config.cache.resume_grace_s,
            stop=self.stop, rank=self.rank, is_main=self.is_main)
        spans = self._trained_spans(cache, loader, epoch)
        if midepoch is not None:
            midepoch.on_save, midepoch.on_saved = spans.stage, spans.commit
        timed = TimedLoader(loader, self.progress, self.stop, midepoch)
        started = time.perf_counter()
        from .process_group import mean_across_ranks

        result = mean_across_ranks(dict(self.train_fn(context, epoch, timed) or {}))
        elapsed = time.perf_counter() - started
        spans.stage(timed.batches)  # the epoch is done: what its checkpoint will cover
        after = cache.counters()
        dataset = getattr(loader, "dataset", None)
        turnover = self.turnover.measure(cache, mark, getattr(dataset, "seqs", np.empty(0)))
        row = {
            "epoch": epoch,
            **result,
            "snapshot_samples": len(getattr(loader, "seqs", ())),
            "batches": timed.batches,
            "ranks": self.world_size,
            "epoch_s": round(elapsed, 3),
            "data_wait_fraction": round(timed.wait_s / elapsed, 4) if elapsed > 0 else 0.0,
            "cache_samples": after.samples,
            "cache_bytes": after.bytes,
            "evicted": after.evicted - before.evicted,
            **turnover,
            "coverage": coverage_row(cache, spans),
            # what the epoch cost the remote, per source (the samplers' counters: see
            # docs/howto/monitoring.md), and in all
            "requests": (requests := request_delta(requests_before, request_totals(cache))),
            "remote_requests": sum(int(v["gets"] + v["heads"] + v["lists"])
                                   for v in requests.values()),
            "remote_bytes": sum(int(v["bytes"]) for v in requests.values()),
            # what the reads counted, DataLoader workers included (epoch_record's tallies)
            **(loader.tallies() if hasattr(loader, "tallies") else {}),
            # a resumed epoch: what it continued, and what it could not (counted, not silent)
            **(getattr(loader, "resume_report", None) or {}),
            "time": time.time(),
        }
        self.metrics.append(row)
        self.progress.last_epoch = row  # the training side's /metrics serve its gauges
        if not self.is_main:
            return spans
        append_history(cache, history_row(row))
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(row) + "\n")
        with self.stop.writing(f"the checkpoint of epoch {epoch}"):
            context.save_checkpoint(epoch, row)
        log.info("%s", log_line(row))
        local = _local_sources(self.config)
        for name, values in sorted(requests.items()):
            log.info("epoch %d: %s %s: %s", epoch, "local" if name in local else "remote", name,
                     describe_requests(values, local=name in local, epoch=True))
        return spans

    def _settle_coverage(self, cache: SampleStore, checkpoint: dict[str, Any] | None) -> None:
        """Count the coverage an earlier attempt of this run staged and its checkpoint covers
        (it was killed before counting it), drop what no checkpoint covers (trained again)."""
        from ..coverage.staged import run_key, settle

        first, named = checkpointed_coverage(checkpoint if self.resume else None)
        settle(cache, run_key(self.run_dir), lambda epoch, token: epoch < first or token in named,
               before=self.started_at)

    def _trained_spans(self, cache: SampleStore, loader: Any, epoch: int) -> TrainedSpans:
        """The epoch's manifest and coverage recorder; and this trainer noted for ``status``."""
        from ..status import note_trainer

        run_dir = self.run_dir.resolve()
        note_trainer(cache, run_dir=str(run_dir), rank=self.rank, epoch=epoch)
        names = [entry.name for entry in self.config.source_entries() if entry.name]
        from ..coverage.staged import run_key

        return TrainedSpans(cache, loader, epoch, batch_size=self.config.loader.batch_size,
                             run_dir=run_dir if self.config.train.manifests else None,
                             rank=self.rank, job=f"{run_dir} rank {self.rank}", sources=names,
                             run=run_key(run_dir))

    def write_plots(self) -> Path | None:
        from ..plot import INSTALL_HINT, available, plot_run

        if not available():  # matplotlib is an extra
            log.info("matplotlib is not installed: no plot (%s)", INSTALL_HINT)
            return None
        from ..coverage import history as coverage_history

        cache = SampleStore(self.config.cache.dir, readonly=True)
        try:
            history = cache.history()
        finally:
            cache.close()
        out = self.run_dir / "run.png"
        plot_run(self.metrics, history, out, title=f"epochcache run: {self.run_dir}",
                 coverage=coverage_history(cache.path))
        return out


def _restart_note(environ: Mapping[str, str]) -> str:
    """Which run of a requeued Slurm job this is (empty outside one)."""
    restart = environ.get("SLURM_RESTART_COUNT", "").strip()
    if not restart:
        return ""
    return f" (Slurm job {environ.get('SLURM_JOB_ID', '?')}, restart {restart})"


def _read_metrics(path: Path, before: int, rewrite: bool = True) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in rows if row.get("epoch", 0) < before]
    if rewrite:
        path.write_text("".join(json.dumps(row) + "\n" for row in kept))  # drop epochs redone after a crash
    return kept


def run_training(config: EpochcacheConfig, *, resume: bool | str = False) -> int:
    """Run the whole job of ``epochcache run``; returns the exit status.

    Under torchrun, the process group is joined first; global rank 0 writes the demo data and
    the run directory (config, metrics, checkpoints, plots), local rank 0 of each node runs the
    node's daemon, and the other ranks of a node share its cache through ``cache.epochs()``.
    SIGINT and SIGTERM stop the run at its next safe point (`epochcache.run.signals`):
    exit 130 or 143.
    """
    from ..placement import detect_placement

    place = detect_placement()
    if config.train.metrics_port is not None:
        require_prometheus("train.metrics_port")  # before anything starts
    stop = StopSignals().install()
    run = Run(config, resume=resume, is_main=place.rank == 0, node_rank=place.node_rank,
              stop=stop, rank=place.rank, world_size=place.world_size,
              local_rank=place.local_rank)
    try:
        try:
            status = _run_job(run, place)
        except KeyboardInterrupt as exc:
            status = _stopped(exc)
        try:
            # Not before the run directory exists: a run stopped in its start-up has no plot.
            plot = (run.write_plots() if run.is_main and run.config.train.plot
                    and run.run_dir.is_dir() else None)
            if plot is not None:
                log.info("wrote %s", plot)
            if status == 0:
                stop.check()  # a signal during the clean-up or the plot: stopped all the same
        except KeyboardInterrupt as exc:
            status = _stopped(exc)
    finally:
        stop.restore()
    return status


def _stopped(exc: KeyboardInterrupt) -> int:
    log.warning("%s: stopping (the last checkpoint is kept; continue with --resume)",
                "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted")
    return int(getattr(exc, "exit_status", Interrupted.exit_status))


def _run_job(run: Run, place: Placement) -> int:
    """`run_training` from the demo data to the daemon stopped and the job left."""
    config, stop = run.config, run.stop
    created_group = joined = False
    try:
        if run.is_main:  # before anything starts: exit 2 naming train.run_dir
            check_writable(run.run_dir, "the run directory (train.run_dir)")
        check_run_sources(config)  # before anything starts: never train on another dataset
        run.serve_metrics(place.local_rank)
        if place.rank == 0:
            ensure_demo_data(config)
            stop.check()
        if place.local_rank == 0:
            # Lists the source first: an unreachable one exits 2 before the run dir is written
            # (and before torch is imported, which takes seconds).
            run.start_daemon()
            stop.check()
        run.train_fn  # noqa: B018 - import the trainer now: a missing function is a bad config
        stop.check()
        from .process_group import barrier, init_run_distributed, joins_job, select_device

        run.device = select_device(place)  # torch: after the checks
        joined = joins_job(place, os.environ)
        created_group = init_run_distributed(place, run.device, join=joined)
        barrier()  # the demo data and the node's daemon exist before any rank trains
        stop.check()
        if run.is_main:
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "config.yaml").write_text(config.redacted_yaml())
        if config.loader.num_workers and multiprocessing.get_start_method() == "forkserver":
            shelter_forkserver()  # before epochs() starts workers from it (Python 3.14+)
        return run.train()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        if not stop.requested:
            raise
        # What a stop breaks on its way (a DataLoader worker or a peer rank signalled too, the
        # daemon's samplers stopping) is the stop, not a failure.
        log.debug("while stopping: %s: %s", type(exc).__name__, exc, exc_info=exc)
        raise stop.exception() from None
    finally:
        try:
            run.stop_daemon()
        finally:
            if joined:
                from .process_group import close_run_distributed

                close_run_distributed(created_group)
