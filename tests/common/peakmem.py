"""Run a script in a fresh interpreter and measure how much its memory grew (peak RSS).

A bound on memory is only meaningful in a process of its own: the test process holds whatever
earlier tests left. :func:`run_measured` runs ``script`` after a preamble that records the RSS
once the script calls ``mark()`` (after its imports and set-up), and a watchdog thread that
ends the process with exit status :data:`OVER_LIMIT` as soon as the RSS grows past
``limit_mib``, so a test of a memory bomb fails quickly instead of taking the machine's memory.

Two growths are reported: of the peak RSS (``VmHWM``, exact), and of the anonymous memory
alone (``RssAnon``, sampled every 2 ms by the watchdog): the pages of an LMDB file the process
maps count in its RSS as page cache, not as memory it holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

OVER_LIMIT = 86
TESTS = Path(__file__).resolve().parents[1]

_PREAMBLE = '''
import os, sys, threading, time
_PAGE = os.sysconf("SC_PAGE_SIZE")
_BASE = [0]
_ANON = [0, 0]  # at mark(), and the largest seen since
_LIMIT = {limit}

def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE

def _anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

def mark():
    """Memory from here on is what is measured."""
    try:  # reset the peak (VmHWM) to the RSS now: imports may have peaked higher
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    _ANON[0] = _ANON[1] = _anon()
    _BASE[0] = _rss()

def _watch():
    while True:
        if _BASE[0]:
            _ANON[1] = max(_ANON[1], _anon())
        if _BASE[0] and _rss() - _BASE[0] > _LIMIT:
            sys.stdout.write("OVER_LIMIT\\n")
            sys.stdout.flush()
            os._exit({over})
        time.sleep(0.002)

threading.Thread(target=_watch, daemon=True).start()

def report():
    # VmHWM, not ru_maxrss: the latter survives exec, so a child forked from a large test
    # process reports the parent's size.
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    _ANON[1] = max(_ANON[1], _anon())
    print("GROWTH_MIB", (peak - _BASE[0]) / 2**20, flush=True)
    print("ANON_GROWTH_MIB", (_ANON[1] - _ANON[0]) / 2**20, flush=True)
'''


@dataclass
class Measured:
    """What the script printed, and how much its memory grew after ``mark()``."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def growth_mib(self) -> float:
        """Peak RSS minus the RSS at ``mark()``, from the script's ``report()``."""
        return self._reported("GROWTH_MIB")

    @property
    def anon_growth_mib(self) -> float:
        """Peak anonymous memory (sampled) minus that at ``mark()``: file pages not counted."""
        return self._reported("ANON_GROWTH_MIB")

    def _reported(self, name: str) -> float:
        for line in self.stdout.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"the script did not report its memory:\n{self.stderr[-3000:]}")

    @property
    def over_limit(self) -> bool:
        return self.returncode == OVER_LIMIT


def run_measured(script: str, *, limit_mib: float, cwd: Path | None = None,
                 timeout_s: float = 300) -> Measured:
    """Run ``script`` (which calls ``mark()`` before the part measured and ``report()`` at the
    end) in a new interpreter, killed once it grows by more than ``limit_mib``."""
    code = _PREAMBLE.format(limit=int(limit_mib * 2**20), over=OVER_LIMIT)
    code += textwrap.dedent(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd or TESTS, env=env, check=False)
    return Measured(done.returncode, done.stdout, done.stderr)
