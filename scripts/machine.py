"""The machine a benchmark ran on, measured in the same run: the cores it could use, and memcpy.

    core_probe()   how many cores a CPU-bound process per core actually got over a short
                   spin (2 on an idle 2-core machine, less while other jobs run), with the
                   load average: the machine's state next to every round of figures
    memcpy_gbps()  the bandwidth of large copies between two warm buffers, in this process
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np


def _spin(seconds: float, out: multiprocessing.queues.Queue) -> None:  # type: ignore[type-arg]
    start_cpu, deadline = time.process_time(), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass
    out.put(time.process_time() - start_cpu)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def core_probe(seconds: float = 0.25) -> dict[str, float]:
    """One spinning process per core for ``seconds``: the CPU seconds they got in all over
    ``seconds`` is the number of cores free for this benchmark (other jobs take the rest)."""
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=_spin, args=(seconds, out)) for _ in range(cores())]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join()
    return {"cores": cores(), "cores_free": round(sum(got) / seconds, 2),
            "load_1m": round(os.getloadavg()[0], 2)}


def memcpy_gbps(nbytes: int = 64 << 20, seconds: float = 0.5) -> float:
    """GB/s of copying ``nbytes`` between two buffers already written (no page faults) again
    and again for ``seconds``: the memory bandwidth one thread's copies get in this process
    now, sustained, as a loader's rate is (the best single copy would pick the moments other
    jobs left the machine alone)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    copies, start = 0, time.perf_counter()
    while copies == 0 or time.perf_counter() - start < seconds:
        np.copyto(dst, src)
        copies += 1
    return copies * nbytes / (time.perf_counter() - start) / 1e9
