"""No directory a user can hand epochcache ends a process with a signal (issue 33, item 3).

A truncated ``data.mdb`` (a copy killed part-way, a full disk), a cache of a newer format, an
empty folder, a lock file only, a ``data.mdb`` that is not LMDB: each tool, run as the user runs
it (a subprocess, so a SIGBUS shows as a negative return code), says in one line which path is
wrong and what to do, and exits 2. LMDB maps the data file: a page past its end is a SIGBUS, so
the file is checked against what its meta pages say before LMDB opens it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import yaml

from epochcache import Cache, CacheUnusable
from epochcache.demo import write_demo_data
from epochcache.store.records import C_FORMAT, DB_META, FORMAT_VERSION, pack_u64

pytestmark = pytest.mark.timeout(180)

#: The tools as a user runs them on a cache directory (the configs name it as cache.dir).
TOOLS = ("status", "verify", "copy", "daemon", "run", "Cache()")
#: Tools that read a cache that must exist (daemon, run and Cache(capacity=) create one).
READERS = ("status", "verify", "copy", "Cache()")


def _filled(path: Path) -> Path:
    cache = Cache(path, capacity="64MiB", sync=False)
    try:
        cache.put_many([(f"k{i}", os.urandom(4000)) for i in range(300)])
    finally:
        cache.close()
    return path


def truncated(path: Path) -> Path:
    _filled(path)
    data = path / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    return path


def newer_format(path: Path) -> Path:
    _filled(path)
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(C_FORMAT, pack_u64(FORMAT_VERSION + 1), db=env.open_db(DB_META, txn=txn))
    env.close()
    return path


def empty_folder(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


def lock_file_only(path: Path) -> Path:
    path.mkdir(mode=0o700)
    (path / "lock.mdb").write_bytes(os.urandom(8192))
    return path


def not_lmdb(path: Path) -> Path:
    path.mkdir(mode=0o700)
    (path / "data.mdb").write_bytes(b"PK\x03\x04" + os.urandom(20000))  # a zip, say
    return path


CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "truncated": (truncated, TOOLS),
    "newer-format": (newer_format, TOOLS),
    "empty-folder": (empty_folder, READERS),
    "lock-file-only": (lock_file_only, READERS),
    "not-lmdb": (not_lmdb, TOOLS),
}
def _config(tmp_path: Path, cache_dir: Path) -> Path:
    if not (tmp_path / "remote").exists():  # something to fetch: the daemon writes, as users'
        write_demo_data(str(tmp_path / "remote"), 8, "files")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"url": str(tmp_path / "remote"), "pattern": "*.npy"},
        "cache": {"dir": str(cache_dir), "capacity": "64MiB"},
        "train": {"epochs": 1, "min_samples": 1, "run_dir": str(tmp_path / "run")},
    }))
    return path


def _argv(tool: str, tmp_path: Path, cache_dir: Path) -> list[str]:
    if tool == "Cache()":
        return ["-c", "import sys, epochcache\n"
                      "try:\n    epochcache.Cache(sys.argv[1])\n"
                      "except epochcache.CacheUnusable as exc:\n"
                      "    print(exc, file=sys.stderr); sys.exit(2)\n", str(cache_dir)]
    if tool in ("daemon", "run"):
        return ["-m", "epochcache", tool, str(_config(tmp_path, cache_dir))]
    if tool == "copy":
        return ["-m", "epochcache", "copy", str(cache_dir), str(tmp_path / "copy")]
    return ["-m", "epochcache", tool, str(cache_dir)]


#: Runs each tool of a case in one process, as `python -m epochcache TOOL ...` would (through
#: the CLI's main), and prints one line per tool: its exit status, then its last stderr line.
#: A SIGBUS in any tool ends the process with a negative return code.
_DRIVER = """
import contextlib, io, json, sys
import epochcache
from epochcache.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if argv[0] == "Cache()":
            try:
                epochcache.Cache(argv[1])
                rc = 0
            except epochcache.CacheUnusable as exc:
                print(exc, file=sys.stderr)
                rc = 2
        else:
            rc = main(argv)
    lines = [line for line in err.getvalue().splitlines() if line.strip()] or [""]
    print(json.dumps([argv[0], rc, lines[-1], "Traceback" in err.getvalue()]), flush=True)
"""


@pytest.mark.parametrize("case", list(CASES))
def test_every_tool_says_in_one_line_what_is_wrong_and_exits_2(case: str,
                                                                tmp_path: Path) -> None:
    make, tools = CASES[case]
    cache_dir = make(tmp_path / "cache")
    data = cache_dir / "data.mdb"
    before = data.read_bytes() if data.exists() else None
    argvs = [["Cache()", str(cache_dir)] if tool == "Cache()" else
             _argv(tool, tmp_path, cache_dir)[2:] for tool in tools]
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [tool for tool, *_ in results] == [argv[0] for argv in argvs]
    for tool, rc, last, traceback in results:
        assert rc == 2 and not traceback, (tool, rc, last)
        assert str(cache_dir) in last, (tool, last)  # it names the cache, and what to do
        assert any(word in last for word in ("delete", "upgrade", "point", "copy")), last
    assert (data.read_bytes() if data.exists() else None) == before  # left as it was
    assert not (tmp_path / "copy").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case,tool", [(case, tool) for case, (_make, tools) in CASES.items()
                                       for tool in tools])
def test_each_tool_in_a_process_of_its_own(case: str, tool: str, tmp_path: Path) -> None:
    """The same, each tool as its own process, as a user runs it."""
    make = CASES[case][0]
    cache_dir = make(tmp_path / "cache")
    data = cache_dir / "data.mdb"
    before = data.read_bytes() if data.exists() else None
    done = subprocess.run([sys.executable, *_argv(tool, tmp_path, cache_dir)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert str(cache_dir) in lines[-1], done.stderr  # the last line names the cache
    assert any(word in lines[-1] for word in ("delete", "upgrade", "point", "copy")), lines[-1]
    assert (data.read_bytes() if data.exists() else None) == before  # left as it was
    assert not (tmp_path / "copy").exists()


def test_cache_in_python_names_the_file_and_what_to_do(tmp_path: Path) -> None:
    """The same checks for a program that opens the cache itself: `CacheUnusable` (a
    `CacheError`), whether it asks for a capacity or not."""
    bad = truncated(tmp_path / "cache")
    for kwargs in ({}, {"capacity": "64MiB"}, {"readonly": True}):
        with pytest.raises(CacheUnusable, match="data.mdb: cut short") as info:
            Cache(bad, **kwargs)  # type: ignore[arg-type]
        assert "delete" in str(info.value)
    with pytest.raises(CacheUnusable, match="newer"):
        Cache(newer_format(tmp_path / "newer"))
    with pytest.raises(CacheUnusable, match="not an LMDB"):
        Cache(not_lmdb(tmp_path / "zip"), capacity="1MiB")
    # an empty folder is where a new cache goes
    Cache(empty_folder(tmp_path / "new"), capacity="1MiB").close()


def test_a_cache_growing_while_it_is_checked_is_not_cut_short(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A writer commits while another process opens the cache (a DataLoader worker of a stream
    while the daemon ingests): the file's size and its meta pages are read at two moments, and
    a commit between them must not make a live cache look cut short. The file's size was read
    first, so a commit in between named pages past it: `CacheUnusable` in the worker (seen in
    tests/test_stream.py's writer test under load). Here the commit lands exactly there."""
    import epochcache.store.datafile as datafile

    path = tmp_path / "cache"
    writer = Cache(path, capacity="256MiB", sync=False)
    writer.put_many([(f"s/{i}.bin", os.urandom(4096)) for i in range(8)])
    real_fstat = os.fstat
    grown: list[int] = []

    def fstat_then_a_commit(fd: int) -> os.stat_result:
        result = real_fstat(fd)
        if not grown and os.readlink(f"/proc/self/fd/{fd}").endswith("data.mdb"):
            grown.append(0)  # once (the commit below may look at the file too)
            # 4 MiB of incompressible samples: new pages past the size just read
            writer.put_many([(f"big/{i}.bin", os.urandom(1 << 20)) for i in range(4)])
            grown[0] = real_fstat(fd).st_size - result.st_size
        return result

    monkeypatch.setattr(datafile.os, "fstat", fstat_then_a_commit)
    datafile.check_data_file(str(path), create=False)  # raised "cut short" when it read the size first
    assert grown and grown[0] > 0, "the commit did not grow the file: the test proves nothing"
    monkeypatch.undo()
    writer.close()
