"""Ctrl-C and SIGTERM in ``epochcache run``: a request to stop, acted on where stopping is clean.

A Python signal handler runs in the main thread between any two bytecodes. Raising from it (as
Python's SIGINT handler does) lands the exception anywhere: inside DataLoader start-up, between
a map-gate entry of the store and its ``try`` (a later map resize then waits forever for that
entry), half-way through a multiprocessing queue. So `StopSignals` only records the
first SIGINT or SIGTERM; the run checks it (`StopSignals.check`) at its own safe points --
between start-up steps, every poll of the wait for ``train.min_samples``, before and after each
batch, at each epoch boundary -- and stops there: epochs closed, lease released, daemon stopped,
the last checkpoint kept, one line saying so, exit 130 (SIGINT) or 143 (SIGTERM). A second
signal does not wait: SIGINT raises at once, SIGTERM takes its previous action (by default the
process ends at once).

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

import multiprocessing
import os
import signal
import threading
from types import FrameType
from typing import Any


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) reached the run: it stops at its next safe point and exits 130."""

    exit_status = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the run: a scheduler preempting or ending the job (Slurm, Kubernetes),
    or torchrun passing it on. The run stops as on Ctrl-C, and exits 143."""

    exit_status = 143


class StopSignals:
    """Records SIGINT and SIGTERM as a request to stop (see the module docstring).

    Install it in the main thread (elsewhere it changes nothing: handlers belong to the main
    thread). SIGINT is taken over only from Python's own handler: a run started with SIGINT
    ignored (a background job of a shell) keeps ignoring it.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._take(signal.SIGINT)
        self._take(signal.SIGTERM)
        return self

    def _take(self, signum: int) -> None:
        previous = signal.signal(signum, self._handle)
        # None: a handler installed outside Python; its action cannot be put back, the default can
        self._previous[signum] = signal.SIG_DFL if previous is None else previous

    def restore(self) -> None:
        """Put the previous handlers back."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # No logging, no locks here: the main thread may be inside either.
        if self.signum is None:
            self.signum = signum
            _quiet_worker_deaths()
            if signum == signal.SIGTERM and signal.SIGTERM in self._previous:
                # A second SIGTERM ends the process at once (the previous action).
                signal.signal(signal.SIGTERM, self._previous[signal.SIGTERM])
            return
        if signum == signal.SIGTERM and signal.SIGTERM in self._previous:
            signal.signal(signal.SIGTERM, self._previous[signal.SIGTERM])
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise self.exception()  # the user insists: stop wherever the run is

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


def _quiet_worker_deaths() -> None:
    """Once the run stops, its DataLoader workers' deaths are expected (a group SIGTERM ends
    them at once): take torch's SIGCHLD handler out, which raised "DataLoader worker ... is
    killed by signal" from wherever the main thread was, inside a logging call of the
    run's clean-up too (a "Logging error" traceback in the run's output). A loader whose
    workers are gone still says so where it is read, at a point the run expects it."""
    handler = signal.getsignal(signal.SIGCHLD) if hasattr(signal, "SIGCHLD") else None
    if callable(handler) and getattr(handler, "__module__", "").startswith("torch.utils.data"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


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
