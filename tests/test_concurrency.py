"""``sampler.concurrency: auto`` against simulated remotes, and the shared request budget.

The control (:mod:`epochcache.ingest.concurrency`) is driven here by a discrete-event
simulation of a remote in *simulated* time: first-byte latency with jitter, a client CPU that
serves completions one at a time (what bounds a sampler at small objects), a bandwidth per
connection, and a token bucket that answers 503 at once above its rate. The best fixed
concurrency of a sweep is the yardstick, as in scripts/bench_remote.py against a real proxy.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epochcache.ingest.concurrency import (
    START_LIMIT,
    AutoConcurrency,
    FixedConcurrency,
    Outcome,
)
from epochcache.ingest.requests import RequestBudget


@dataclass
class Remote:
    """A simulated remote (see the module docstring); times in seconds."""

    latency_s: float = 0.02
    size: int = 65536
    bandwidth: float | None = None  # bytes/s per connection
    cpu_s: float = 0.0  # client CPU per completed request (one core)
    rate: float | None = None  # requests/s the bucket serves
    burst: float = 5.0
    jitter: float = 0.1


@dataclass
class Run:
    goodput: float  # objects/s over the second half
    throttled: int
    sent: int
    limits: list[float] = field(default_factory=list)  # the limit every 0.25 s
    controls: list[Any] = field(default_factory=list)


def simulate(make: Callable[[Callable[[], float]], Any], remote: Remote, *, clients: int = 1,
             seconds: float = 30.0, seed: int = 0, first_request_s: float = 0.0) -> Run:
    """``clients`` controls (as many sampler processes) sharing one remote; the controls are
    made at time 0 and send their first requests at ``first_request_s`` (a sampler lists or
    loads its listing first)."""
    rng = random.Random(seed)
    now = 0.0

    def clock() -> float:
        return now

    controls = [make(clock) for _ in range(clients)]
    now = first_request_s
    events: list[tuple[float, int, str, int, float]] = []
    seq = 0
    tat = 0.0
    cpu_free = 0.0
    done: list[float] = []
    throttled = sent = 0

    def push(at: float, kind: str, who: int, start: float = 0.0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, who, start))

    def fill(who: int) -> None:
        control = controls[who]
        while control.in_flight < control.slots:
            control.started()
            delay = control.reserve() if hasattr(control, "reserve") else 0.0
            push(now + delay, "send", who)

    for who in range(clients):
        fill(who)
    limits: list[float] = []
    next_sample = 0.0
    while events:
        at, _, kind, who, start = heapq.heappop(events)
        if at > seconds:
            break
        now = at
        if kind == "send":
            sent += 1
            if remote.rate:
                interval = 1 / remote.rate
                t = max(tat, now)
                if t - now > (remote.burst - 1) * interval:
                    throttled += 1
                    push(now + 0.001, "throttled", who, now)
                    continue
                tat = t + interval
            service = remote.latency_s * (1 + rng.uniform(-remote.jitter, remote.jitter))
            if remote.bandwidth:
                service += remote.size / remote.bandwidth
            push(now + service, "arrived", who, now)
        elif kind == "arrived":
            cpu_free = max(cpu_free, now) + remote.cpu_s
            push(cpu_free, "ok", who, start)
        else:
            outcome = Outcome.OK if kind == "ok" else Outcome.THROTTLED
            controls[who].finished(outcome, remote.size if kind == "ok" else 0, now - start)
            if kind == "ok":
                done.append(now)
            fill(who)
        while now >= next_sample:
            limits.append(sum(c.limit for c in controls))
            next_sample += 0.25
    second_half = [t for t in done if t >= seconds / 2]
    return Run(len(second_half) / (seconds / 2), throttled, sent, limits, controls)


def best_fixed(remote: Remote, clients: int = 1) -> float:
    return max(simulate(lambda clock, n=n: FixedConcurrency(n), remote, clients=clients).goodput
               for n in (1, 2, 4, 8, 16, 32, 64, 128, 256))


def auto(clock: Callable[[], float]) -> AutoConcurrency:
    return AutoConcurrency(clock=clock)


def settled(limits: list[float]) -> list[float]:
    return limits[len(limits) // 2:]


@pytest.mark.parametrize("remote", [
    Remote(cpu_s=0.0025),  # s3fs at 64 KiB: the client's CPU is the limit (about 400 GETs/s)
    Remote(cpu_s=0.0005),  # obstore at 64 KiB: 2,000 GETs/s
    Remote(latency_s=0.05, size=1 << 20, bandwidth=100e6, cpu_s=0.0008),  # 1 MiB, 50 ms away
], ids=["cpu-bound", "cheap-requests", "1MiB-far"])
def test_auto_reaches_the_best_fixed_concurrency_and_settles(remote: Remote) -> None:
    run = simulate(auto, remote)
    assert run.goodput >= 0.9 * best_fixed(remote)
    late = settled(run.limits)
    middle = statistics.median(late)
    assert middle > START_LIMIT  # it grew to what the latency needs
    # settled: no decrease, and the limit stays within its probes' reach of where it settled
    assert run.controls[0].decreases == 0
    assert all(0.75 * middle <= limit <= 1.35 * middle for limit in late), late


def test_auto_stops_growing_where_more_requests_bring_nothing() -> None:
    # 400 GETs/s of CPU at 20 ms needs about 9 in flight: far fewer than the cap
    run = simulate(auto, Remote(cpu_s=0.0025))
    assert max(settled(run.limits)) <= 48


def test_latency_alone_lets_it_grow_to_its_cap() -> None:
    run = simulate(lambda clock: AutoConcurrency(cap=200, clock=clock), Remote(), seconds=10)
    assert max(run.limits) == 200  # never above the cap (the byte budget's share)
    assert run.goodput >= 0.9 * 200 / 0.02


@pytest.mark.parametrize("rate", [100.0, 1000.0])
def test_a_throttling_remote_is_paced_just_below_its_rate(rate: float) -> None:
    remote = Remote(rate=rate, cpu_s=0.0002)
    run = simulate(auto, remote)
    assert run.goodput >= 0.9 * rate
    control = run.controls[0]
    assert control.pace is not None and control.pace <= 1.2 * rate
    # a rate to adapt to: throttled answers are a small part of what was sent
    assert run.throttled < 0.1 * run.sent


def test_a_fixed_concurrency_keeps_its_number_and_still_paces_a_throttling_remote() -> None:
    remote = Remote(rate=200.0, cpu_s=0.0002)
    run = simulate(lambda clock: FixedConcurrency(32, clock=clock), remote)
    assert set(run.limits) == {32.0}
    assert run.goodput >= 0.9 * 200 and run.throttled < 0.1 * run.sent


def test_a_throttled_start_after_a_long_listing_is_paced_at_the_remote_rate() -> None:
    """The control made seconds before the first request (the listing) must not read that
    gap as a rate: it would pace the sampler at a request a second."""
    run = simulate(auto, Remote(rate=100.0, cpu_s=0.0002), first_request_s=5.0, seconds=35.0)
    assert run.goodput >= 0.9 * 100


def test_two_samplers_share_a_throttled_remote() -> None:
    remote = Remote(rate=400.0, cpu_s=0.0001)
    run = simulate(auto, remote, clients=2)
    assert run.goodput >= 0.9 * 400
    assert run.throttled < 0.1 * run.sent


def test_timeouts_lower_the_limit_multiplicatively() -> None:
    now = [0.0]
    control = AutoConcurrency(start=64, clock=lambda: now[0])
    control.phase = control.phase.HOLD
    for _ in range(64):
        control.started()
    control.finished(Outcome.TIMEOUT)
    assert control.limit == pytest.approx(64 * 0.7)
    control.finished(Outcome.TIMEOUT)  # the same round trip: counted once
    assert control.limit == pytest.approx(64 * 0.7)
    now[0] += 1.0
    control.finished(Outcome.TIMEOUT)
    assert control.limit == pytest.approx(64 * 0.7 * 0.7)
    assert control.slots >= 1


def test_a_cap_lowered_below_the_limit_lowers_it() -> None:
    control = AutoConcurrency(start=64)
    control.set_cap(10)
    assert control.limit == 10 and control.slots == 10
    with pytest.raises(ValueError, match="concurrency"):
        FixedConcurrency(0)


# -- the shared budget ---------------------------------------------------------------------------


def _reserve(path: str, per_s: float, count: int, out: Any) -> None:
    budget = RequestBudget(path, per_s)
    out.put([budget.reserve_at()[1] for _ in range(count)])


def test_the_request_budget_is_shared_by_processes(tmp_path: Path) -> None:
    """Requests of several processes get instants at least 1/per_s apart (after a burst of a
    quarter second's worth): together they keep to the budget."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    path = str(tmp_path / "request-budget")
    procs = [ctx.Process(target=_reserve, args=(path, 200.0, 60, out)) for _ in range(3)]
    for proc in procs:
        proc.start()
    instants = sorted(t for _ in procs for t in out.get(timeout=60))
    for proc in procs:
        proc.join(30)
    gaps = [b - a for a, b in zip(instants, instants[1:])]
    # each request its own instant, at least 1/200 s after the one before (a burst after a
    # quiet spell is instants in the past)
    assert min(gaps) >= 1 / 200 - 1e-9, min(gaps)


def test_a_sampler_killed_while_holding_the_budget_does_not_wedge_the_others(
        tmp_path: Path) -> None:
    path = tmp_path / "request-budget"
    RequestBudget(path, 10.0).close()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the lock: the kernel drops it
        holder.wait(30)
        budget = RequestBudget(path, 10.0)
        assert budget.reserve() >= 0.0
        budget.close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    with pytest.raises(ValueError, match="max_requests_per_s"):
        RequestBudget(path, 0)


def test_the_samplers_of_a_daemon_share_one_pace_per_source(tmp_path: Path) -> None:
    """Two samplers' controls on one shared pace: a decrease seen by one slows both, their
    requests get instants of one schedule, and once one has nothing to fetch the other has
    the whole rate (its own share would leave the remote's rate half used)."""
    from epochcache.ingest.concurrency import Pace, SharedPaceState

    now = [100.0]
    first = Pace(SharedPaceState.in_cache(tmp_path, "web"), clock=lambda: now[0])
    second = Pace(SharedPaceState.in_cache(tmp_path, "web"), clock=lambda: now[0])
    other = Pace(SharedPaceState.in_cache(tmp_path, "books"), clock=lambda: now[0])
    assert first.reserve() == 0.0 and first.rate is None  # not paced before throttling
    assert first.decrease(share=0.5, first=100.0)
    assert first.rate == pytest.approx(70.0)  # 100 x the least factor (0.7)
    assert not second.decrease(share=0.1, first=100.0)  # within HOLD_S of the first
    waits = [pace.reserve() for pace in (first, second, first, second)]
    assert waits == pytest.approx([0, 1 / 70, 2 / 70, 3 / 70], rel=0.05)
    assert second.rate is not None and other.reserve() == 0.0  # another source: its own
