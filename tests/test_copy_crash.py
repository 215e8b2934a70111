"""``epochcache copy`` is all or nothing (issue 33, item 3).

A real ``epochcache copy`` subprocess is killed part-way (SIGKILL while its data file is being
written, Ctrl-C, a disk that fills: a real 8 MiB tmpfs): what it leaves never crashes the next
tool (before: ``status``, ``verify`` and ``Cache()`` died with SIGBUS on the cut data file, and a
second copy was refused by the half one), the tools say what happened, and a second copy
succeeds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common.tmpfs import mounted_tmpfs

from epochcache import Cache
from epochcache.store.verify import verify_cache

pytestmark = pytest.mark.timeout(180)

#: Big enough that LMDB's copy takes a while to write (tens of ms), small enough to make fast.
SAMPLES, SAMPLE_BYTES = 160, 256 * 1024


def _source(path: Path, samples: int = SAMPLES) -> Path:
    cache = Cache(path, capacity="256MiB", sync=False, compression="none")
    try:
        for start in range(0, samples, 32):
            cache.put_many([(f"k{i:05d}", os.urandom(SAMPLE_BYTES))
                            for i in range(start, min(samples, start + 32))])
    finally:
        cache.close()
    return path


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})


def _copy_caught_writing(src: Path, dst: Path, sig: int) -> subprocess.Popen[str]:
    """Start ``epochcache copy src dst``, and send ``sig`` once its data file is being written
    (stopped first, so the file is seen part-written when the signal goes)."""
    for _attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "epochcache", "copy", str(src), str(dst)],
                                cwd=src.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "COLUMNS": "400"})
        full = (src / "data.mdb").stat().st_size
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            writing = [p for p in src.parent.glob("*/data.mdb") if p.parent != src]
            sizes = [p.stat().st_size for p in writing if p.exists()]
            if any(0 < size < full // 2 for size in sizes):
                os.kill(proc.pid, signal.SIGSTOP)
                if any(0 < p.stat().st_size < full for p in writing if p.exists()):
                    os.kill(proc.pid, sig)
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.wait(60)
                    return proc
                os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.0005)
        proc.kill()
        proc.communicate(timeout=60)
        for path in (dst, *src.parent.glob(f".{dst.name}.*")):
            subprocess.run(["rm", "-rf", str(path)], check=True)
    pytest.fail("the copy was never caught writing its data file")


def test_a_copy_killed_part_way_leaves_no_cache_and_a_second_copy_succeeds(
        tmp_path: Path) -> None:
    src = _source(tmp_path / "cache")
    dst = tmp_path / "node1"
    killed = _copy_caught_writing(src, dst, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    # No tool dies on what it left: no cache at the destination, and they say why.
    status = _cli("status", str(dst), cwd=tmp_path)
    assert status.returncode == 2, (status.returncode, status.stderr)
    assert "killed part-way" in status.stderr and "copy" in status.stderr, status.stderr
    # A second copy removes the leftover, and succeeds.
    again = _cli("copy", str(src), str(dst), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "removed" in again.stderr and "partial copy" in again.stderr, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    report = verify_cache(str(dst))
    assert report.ok and report.checked == SAMPLES, report.as_dict()
    copy = Cache(dst, readonly=True)
    try:
        assert len(copy) == SAMPLES
    finally:
        copy.close()


def test_ctrl_c_says_what_it_left(tmp_path: Path) -> None:
    src = _source(tmp_path / "cache")
    dst = tmp_path / "node1"
    stopped = _copy_caught_writing(src, dst, signal.SIGINT)
    _out, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 130, err
    assert f"nothing was written at {dst}" in err and "run the copy again" in err, err
    assert "Traceback" not in err
    assert not dst.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # the source was only read: no lease of the copy is left on it
    cache = Cache(src, readonly=True)
    try:
        assert cache.stats()["leases"] == 0 and len(cache) == SAMPLES
    finally:
        cache.close()


def test_a_copy_onto_a_disk_that_fills_leaves_nothing(tmp_path: Path) -> None:
    """A 16 MiB cache copied onto an 8 MiB disk: the copy fails, says how much room it needs,
    and leaves nothing there (before: a cut data file every tool died on with SIGBUS)."""
    src = _source(tmp_path / "cache", samples=64)
    with mounted_tmpfs(tmp_path / "small") as disk:
        dst = disk / "node1"
        done = _cli("copy", str(src), str(dst), cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "the copy failed" in done.stderr and "nothing was left there" in done.stderr
        assert list(disk.iterdir()) == []
        status = _cli("status", str(dst), cwd=tmp_path)
        assert status.returncode == 2 and "no such directory" in status.stderr, status.stderr
