"""Ctrl-C and SIGTERM in ``epochcache run``: a request to stop, acted on where stopping is clean.

A Python signal handler runs in the main thread between any two bytecodes. Raising from it (as
Python's SIGINT handler does) lands the exception anywhere: inside DataLoader start-up, between
a remap-lock entry of the store and its ``try`` (a later map resize then waits forever for that
entry), half-way through a multiprocessing queue. So `StopSignals` only records the
first SIGINT or SIGTERM; the run checks it (`StopSignals.check`) at its own safe points --
between start-up steps, every poll of the wait for ``train.min_samples``, before and after each
batch, at each epoch boundary -- and stops there: epochs closed (the epoch's lease left for
the resume where a checkpoint named it, docs/guide/resume.md), daemon stopped, the last
checkpoint kept, one line saying so, exit 130 (SIGINT) or 143 (SIGTERM).

Further signals never cut the stop short (invariant 11). Under a scheduler every rank gets
SIGTERM more than once: Slurm signals every process of a job step (a cancel, a time limit, a
requeue, ``scancel --signal`` of an ``srun`` step), and torchrun forwards its own SIGTERM to
each rank again. The second one used to end the rank at once, before the checkpoint of its
stop, and the resume went back to the last periodic one. Now a repeated SIGTERM is logged and
the stop goes on; only SIGKILL (the scheduler's, after its grace: Slurm's ``KillWait``,
torchrun's ``--shutdown-timeout``) ends it sooner. A second Ctrl-C stops at once, as a person
insisting means it, except while a checkpoint is owed or written (`StopSignals.deferring`,
`StopSignals.writing`): the run stops right after it. The signals are logged by a thread, as
they arrive (a handler must not log), and `StopSignals.writing` logs when a stop's checkpoint
starts (with how long the last one took) and ends, so a rank that the scheduler's SIGKILL
ends first says so.

A terminal's Ctrl-C, torchrun and Slurm signal the run's whole process group, DataLoader workers
included. Workers started by the run ignore SIGINT (`quiet_worker`, their
``worker_init_fn``): the run stops them in order itself, where a worker that Ctrl-C interrupts
quits mid-epoch or, while it starts, prints a KeyboardInterrupt traceback. SIGTERM keeps torch's
handler in them (they end at once, silently); what that breaks in the run's loader is taken for
the stop it is, and torch's SIGCHLD handler, which would raise their deaths from anywhere in the
run (its clean-up included), is taken out once the run stops. Workers started from multiprocessing's forkserver come from a process in the
same group, which a group SIGTERM used to end (every worker start after it failed, half-way)
and a Ctrl-C while it started to print a traceback: `shelter_forkserver` starts it with
both signals blocked.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) reached the run: it stops at its next safe point and exits 130."""

    exit_status = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the run: a scheduler preempting or ending the job (Slurm, Kubernetes),
    or torchrun passing it on. The run stops as on Ctrl-C, and exits 143."""

    exit_status = 143


def _name(signum: int) -> str:
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


class StopSignals:
    """Records SIGINT and SIGTERM as a request to stop (see the module docstring).

    Install it in the main thread (elsewhere it changes nothing: handlers belong to the main
    thread). SIGINT is taken over only from Python's own handler: a run started with SIGINT
    ignored (a background job of a shell) keeps ignoring it. A process forked from the run
    (before it sets handlers of its own) takes SIGTERM's previous action and ignores SIGINT.

    Attributes:
        signum: the signal that asked to stop (None: none yet).
        repeats: the stop signals that arrived after it.
        last_write_s: how long the last checkpoint took to write (`writing`).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.repeats = 0
        self.last_write_s: float | None = None
        self._requested_at = 0.0
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()
        self._deferring = 0
        self._writing: tuple[str, float] | None = None
        self._notes = -1  # the pipe's write end: the handler's notes to the reporting thread
        self._reporter: threading.Thread | None = None

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._pid = os.getpid()
        if self._reporter is None:
            read_end, self._notes = os.pipe()
            os.set_blocking(self._notes, False)  # a handler never waits: a full pipe drops one
            self._reporter = threading.Thread(target=self._report, args=(read_end,),
                                              name="epochcache-signals", daemon=True)
            self._reporter.start()
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._take(signal.SIGINT)
        self._take(signal.SIGTERM)
        return self

    def _take(self, signum: int) -> None:
        previous = signal.signal(signum, self._handle)
        # None: a handler installed outside Python; its action cannot be put back, the default can
        self._previous[signum] = signal.SIG_DFL if previous is None else previous

    def restore(self) -> None:
        """Put the previous handlers back (and end the reporting thread)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        notes, self._notes = self._notes, -1
        reporter, self._reporter = self._reporter, None
        if notes >= 0:
            os.close(notes)  # the thread logs what is noted, then ends
        if reporter is not None:
            reporter.join(timeout=2.0)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # No logging, no locks here: the main thread may be inside either (the thread logs).
        if os.getpid() != self._pid:  # a process forked from the run, not the run
            if signum == signal.SIGTERM:
                signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
                os.kill(os.getpid(), signum)
            return
        first = self.signum is None
        if first:
            self.signum, self._requested_at = signum, time.monotonic()
            _quiet_worker_deaths()
        else:
            self.repeats += 1
        if self._notes >= 0:
            try:
                os.write(self._notes, bytes((signum, first)))
            except OSError:  # full (a flood of signals) or closed: the note is dropped
                pass
        if not first and signum == signal.SIGINT and not self._deferring:
            raise self.exception()  # a person insists: stop wherever the run is

    def _report(self, read_end: int) -> None:
        """The reporting thread: log each stop signal as the handler notes it."""
        with open(read_end, "rb", buffering=0) as notes:
            while pair := notes.read(2):
                if len(pair) == 2:
                    self._log_signal(pair[0], bool(pair[1]))

    def _log_signal(self, signum: int, first: bool) -> None:
        name = _name(signum)
        if first:
            log.info("%s: stopping at the next safe point", name)
            return
        since = time.monotonic() - self._requested_at
        writing = self._writing
        if writing is not None:
            what, started = writing
            log.warning("%s again (%d after the first, %.1f s ago) while %s is being written "
                        "(for %.1f s; the last checkpoint took %s): it is finished first; a "
                        "SIGKILL before it is written resumes from the previous one", name,
                        self.repeats, since, what, time.monotonic() - started,
                        _seconds(self.last_write_s))
        elif signum == signal.SIGINT and self._deferring:
            log.warning("%s again: the run stops as soon as its checkpoint is written (Ctrl-\\ "
                        "quits at once, without it)", name)
        elif signum == signal.SIGINT:
            log.warning("%s again: stopping at once", name)
        else:
            log.warning("%s again (%d after the first, %.1f s ago; a scheduler and torchrun "
                        "both send it): the stop goes on", name, self.repeats, since)

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """A stretch that owes a checkpoint at a stop (an epoch with mid-epoch checkpoints): a
        further Ctrl-C in it does not raise; the run stops after the checkpoint, at its next
        safe point."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    @contextmanager
    def writing(self, what: str) -> Iterator[None]:
        """Around writing a checkpoint (``what`` names it): no further signal interrupts it;
        one arriving meanwhile is logged as such. When the run is stopping, one line before
        (how long after the signal, how long the last checkpoint took) and one after."""
        started = time.monotonic()
        if self.signum is not None:
            log.warning("stopping (%s %.1f s ago): writing %s (the last checkpoint took %s)",
                        _name(self.signum), started - self._requested_at, what,
                        _seconds(self.last_write_s))
        self._writing = (what, started)
        try:
            with self.deferring():
                yield
        finally:
            self._writing = None
            self.last_write_s = time.monotonic() - started
            if self.signum is not None:
                log.warning("%s written in %.1f s", what[:1].upper() + what[1:],
                            self.last_write_s)

    def request(self, signum: int) -> None:
        """Stop as if ``signum`` had arrived (a peer rank was told to stop)."""
        if self.signum is None:
            self.signum, self._requested_at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exception(self) -> KeyboardInterrupt:
        """What the run raises to stop: `Terminated` or `Interrupted`."""
        return Terminated() if self.signum == signal.SIGTERM else Interrupted()

    def check(self) -> None:
        """Raise `exception` when a stop was requested (a safe point of the run)."""
        if self.signum is not None:
            raise self.exception()


def _seconds(value: float | None) -> str:
    return "none yet" if value is None else f"{value:.1f} s"


def _quiet_worker_deaths() -> None:
    """Once the run stops, its DataLoader workers' deaths are expected (a group SIGTERM ends
    them at once): take torch's SIGCHLD handler out, which raised "DataLoader worker ... is
    killed by signal" from wherever the main thread was, inside a logging call of the
    run's clean-up too (a "Logging error" traceback in the run's output). A loader whose
    workers are gone still says so where it is read, at a point the run expects it.

    Replaced by a handler that does nothing, not by SIG_DFL: a SIGCHLD that arrived with the
    stop signal, noted for torch's handler and run after this one, found no Python handler
    any more, and Python printed "Signal 17 ignored due to race condition" with a traceback."""
    handler = signal.getsignal(signal.SIGCHLD) if hasattr(signal, "SIGCHLD") else None
    if callable(handler) and getattr(handler, "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, _child_ended)


def _child_ended(signum: int, _frame: FrameType | None) -> None:
    """SIGCHLD's handler once the run stops (`_quiet_worker_deaths`)."""


def quiet_worker(worker_id: int) -> None:
    """``worker_init_fn`` of the run's DataLoader workers: SIGINT ignored (see the module
    docstring); both signals unblocked, as a sheltered forkserver's children start with them
    blocked (torch's SIGTERM handler, installed by now, must run: DataLoader's ``terminate()``
    of a stuck worker relies on it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def shelter_forkserver() -> None:
    """Start multiprocessing's forkserver now, with SIGINT and SIGTERM blocked in it and in the
    processes it forks (the run's DataLoader workers, see `quiet_worker`).

    A SIGTERM to the run's process group (torchrun, Slurm) would otherwise end the forkserver
    while the run still starts workers from it (the next epoch's, prepared in the background),
    and they fail half-way through DataLoader's start-up; a Ctrl-C while the forkserver or a
    worker starts up raises KeyboardInterrupt there (a traceback). Blocked, not ignored: a
    signal to the run meanwhile reaches its handler once this returns. The forkserver ends when
    the run does (it watches the run's end of a pipe). Call it in the main thread, before any
    worker is started; a forkserver already running is left as it is. Where workers are forked
    from the run instead, it only costs an idle process. Processes it forks start with both
    signals blocked: the run's workers unblock them (`quiet_worker`); another forkserver
    process a trainer starts must do the same if it relies on them.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver, resource_tracker

    # Started first: starting it unblocks SIGINT and SIGTERM in the calling thread afterwards.
    resource_tracker.ensure_running()
    # The forkserver is started from this thread: it inherits the thread's signal mask, which
    # exec keeps, as do the processes it forks.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
