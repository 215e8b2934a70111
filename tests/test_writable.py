"""Paths that cannot be written are one line naming the path and exit 2 (issue 37, item 3).

A ``cache.dir``, ``train.run_dir``, ``copy`` destination, ``plot -o`` or ``manifest -o`` on a
read-only mount, under a file or under /proc gave a Python traceback (``OSError: [Errno 30]
Read-only file system``) and exit 1. The read-only mount is a real one: a tmpfs mounted ``ro``
(root only; skipped elsewhere). Every case runs in one Python process calling the CLI's
``main`` (one interpreter start for the matrix), each with its own stderr.

Internals: ``plumbing.append_history`` writes the daemon's stats rows that ``plot`` draws.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.cachecheck import content_for

import epochcache as ec
from epochcache import Cache
from epochcache.store.plumbing import append_history

_CASES = r"""
import contextlib, io, json, sys
from epochcache.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse
            status = exc.code
        except BaseException as exc:
            import traceback
            traceback.print_exc(file=err)
            status = f"raised {type(exc).__name__}"
    out.append({"argv": argv, "status": status, "stderr": err.getvalue()})
print(json.dumps(out))
"""


def _main_of(argvs: list[list[str]], cwd: Path) -> list[dict[str, Any]]:
    """``{"argv", "status", "stderr"}`` of the CLI's ``main`` for each of ``argvs``, in one
    process."""
    done = subprocess.run([sys.executable, "-c", _CASES, json.dumps(argvs)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "ro"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _config(tmp_path: Path, name: str, cache_dir: Path, run_dir: Path) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "source": {"url": str(tmp_path / "data"), "layout": "files"},
        "cache": {"dir": str(cache_dir), "capacity": "1MiB"},
        "train": {"epochs": 1, "run_dir": str(run_dir)}}))
    return str(path)


def test_every_path_that_cannot_be_written_is_one_line_and_exit_2(
        tmp_path: Path, read_only_mount: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory\n")
    cache = tmp_path / "cache"
    with Cache(cache, "1MiB", sync=False) as filled:
        filled.put_many([(f"k{i}", content_for(f"k{i}", 100)) for i in range(5)])
        append_history(filled)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    places = {"read-only mount": read_only_mount / "x", "under a file": tmp_path / "a-file" / "x",
              "under /proc": Path("/proc") / f"epochcache-test-{os.getpid()}"}
    cases = []
    for n, (kind, bad) in enumerate(places.items()):
        good = tmp_path / kind.replace(" ", "-").replace("/", "")
        cases += [
            ("cache.dir (daemon)", kind, bad / "cache",
             ["-q", "daemon", _config(tmp_path, f"d{n}", bad / "cache", good / "run")]),
            ("cache.dir (run)", kind, bad / "cache",
             ["-q", "run", _config(tmp_path, f"r{n}", bad / "cache", good / "run")]),
            ("train.run_dir", kind, bad / "run",
             ["-q", "run", _config(tmp_path, f"rd{n}", good / "cache", bad / "run")]),
            ("copy DEST", kind, bad / "copy", ["copy", str(cache), str(bad / "copy")]),
            ("plot -o", kind, bad / "fill.png", ["plot", str(cache), "-o", str(bad / "fill.png")]),
            ("manifest -o", kind, bad / "keys.txt",
             ["manifest", str(run_dir), "--epoch", "0", "-o", str(bad / "keys.txt")]),
        ]
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "one.bin").write_bytes(b"x" * 100)
    problems = []
    for (what, kind, path, _argv), result in zip(cases, _main_of([c[3] for c in cases],
                                                                  tmp_path)):
        lines = result["stderr"].strip().splitlines()
        if result["status"] != 2 or len(lines) != 1 or str(path) not in lines[0] \
                or "cannot write" not in lines[0]:
            problems.append(f"{what}, {kind}: exit {result['status']}\n{result['stderr']}")
    assert not problems, "\n\n".join(problems)
    # nothing was started or left behind
    assert not any((tmp_path / name).exists() for name in
                   ("read-only-mount", "under-a-file", "under-proc")), os.listdir(tmp_path)


def test_a_cache_opened_on_a_read_only_mount_is_read_and_not_written(
        tmp_path: Path) -> None:
    """A cache on a mount that became read-only: ``status`` and ``verify`` read it (they failed
    with ``lmdb.InvalidParameterError``: py-lmdb closes the tables opened in a read
    transaction), ``Cache()`` and the daemon refuse it naming the path."""
    where = tmp_path / "mnt"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(where)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with Cache(where / "cache", "1MiB", sync=False) as cache:
            cache.put_many([(f"k{i}", content_for(f"k{i}", 100)) for i in range(5)])
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        status = subprocess.run([sys.executable, "-m", "epochcache", "status", "--json",
                                 str(where / "cache")], capture_output=True, text=True,
                                timeout=60, check=False)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["samples"] == 5
        with pytest.raises(ec.PathNotWritable, match="mounted read-only"):
            Cache(where / "cache")
        with Cache(where / "cache", readonly=True) as cache:
            assert len(cache) == 5 and cache.get("k0") == content_for("k0", 100)
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_commands_on_a_directory_that_is_not_a_cache_give_cli_advice(tmp_path: Path) -> None:
    """``status`` on a folder that is not a cache said "open it with Cache(path,
    capacity=...)": Python advice on the command line."""
    empty = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    argvs = [["status", empty], ["verify", empty], ["plot", empty], ["copy", empty, "c"]]
    for result in _main_of(argvs, tmp_path):
        err = result["stderr"]
        assert result["status"] == 2, result
        assert "no cache here" in err and "epochcache daemon CONFIG" in err, result
        assert "Cache(" not in err and len(err.strip().splitlines()) == 1, result


def test_version() -> None:
    done = subprocess.run([sys.executable, "-m", "epochcache", "--version"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == f"epochcache {ec.__version__}"


def test_a_failed_start_leaves_no_cache_directory_and_manifest_writes_no_parquet_as_text(
        tmp_path: Path) -> None:
    """A daemon whose source cannot be listed exits 2 and left its new cache directory (LMDB
    files, locks) behind; ``manifest -o out.parquet`` wrote a text file named .parquet, which
    ``source.manifest`` then reads as Parquet."""
    (tmp_path / "run").mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "source": {"url": str(tmp_path / "no-such-data"), "layout": "files"},
        "cache": {"dir": str(tmp_path / "new" / "cache"), "capacity": "1MiB"}}))
    daemon, parquet = _main_of([["-q", "daemon", str(config)],
                                ["manifest", "run", "--epoch", "0", "-o", "keys.parquet"]],
                               tmp_path)
    assert daemon["status"] == 2 and "no-such-data" in daemon["stderr"], daemon
    assert "no such directory" in daemon["stderr"] and "storage_options" not in daemon["stderr"]
    assert not (tmp_path / "new").exists(), os.listdir(tmp_path / "new")
    assert parquet["status"] == 2 and "not Parquet" in parquet["stderr"], parquet
    assert not (tmp_path / "keys.parquet").exists()


def _open_in_a_child(path: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    Cache(path).close()


def test_an_open_cache_directory_is_warned_about_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trainer and its daemon's samplers printed "cache directory ... is readable by other
    users" four times: the trainer twice (two spellings of one path), each sampler once."""
    import multiprocessing

    (tmp_path / "cache").mkdir(mode=0o755)
    os.chmod(tmp_path / "cache", 0o755)
    with caplog.at_level("WARNING", logger="epochcache"):
        Cache(tmp_path / "cache", "1MiB", sync=False).close()
        Cache(os.path.relpath(tmp_path / "cache"), sync=False).close()
    assert caplog.text.count("is readable by other users") == 1, caplog.text
    child = multiprocessing.get_context("spawn").Process(
        target=_open_in_a_child, args=(str(tmp_path / "cache"),))
    err = tmp_path / "child.err"
    with open(err, "w") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            child.start()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    child.join(60)
    assert child.exitcode == 0
    assert "readable by other users" not in err.read_text(), err.read_text()
