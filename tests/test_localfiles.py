"""Local sources are read with the OS's calls (issue 14): in order, bounded, never following a
link, never held up by a hung file, and in parallel only while the filesystem is slow."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from epochcache.errors import CorruptSample, PermanentRemoteError
from epochcache.ingest.layouts import SampleRef, SourceSpec
from epochcache.ingest.layouts.files import FilesSource
from epochcache.ingest.localfiles import (
    SLOW_READ_S,
    LocalFiles,
    judge_reads,
    read_file,
    read_wait,
)


def _files(folder: Path, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"f{i:03d}.bin"
        path.write_bytes(f"payload {i} ".encode() * (i + 1))
        paths.append(str(path))
    return paths


def test_reads_whole_files_in_order_with_limits_and_errors(tmp_path: Path) -> None:
    paths = _files(tmp_path, 5)
    reader = LocalFiles(concurrency=4)
    got = reader.read_many(paths + [str(tmp_path / "missing")], [None, 3, None, 0, 10**9, None],
                           timeout_s=5)
    assert got[0] == Path(paths[0]).read_bytes()
    assert got[1] == Path(paths[1]).read_bytes()[:3]
    assert got[2] == Path(paths[2]).read_bytes()
    assert got[3] == b""
    assert got[4] == Path(paths[4]).read_bytes()
    assert isinstance(got[5], FileNotFoundError)


def test_the_final_component_is_never_followed_as_a_link(tmp_path: Path) -> None:
    (target,) = _files(tmp_path / "data", 1)
    os.symlink(target, tmp_path / "link.bin")
    with pytest.raises(OSError) as info:
        read_file(str(tmp_path / "link.bin"))
    assert info.value.errno == errno.ELOOP


def test_a_hung_read_times_out_and_later_batches_are_not_held_up(tmp_path: Path) -> None:
    """A FIFO without a writer blocks its open for good, as a dead NFS mount does."""
    paths = _files(tmp_path, 3)
    os.mkfifo(tmp_path / "hang")
    reader = LocalFiles(concurrency=4)
    try:
        started = time.monotonic()
        got = reader.read_many([paths[0], str(tmp_path / "hang"), paths[1]], [None] * 3,
                               timeout_s=0.5)
        assert time.monotonic() - started < 30  # its timeout, not the FIFO's forever
        assert got[0] == Path(paths[0]).read_bytes()
        # One lane: the file after the hung one waits behind it and times out with it.
        assert isinstance(got[1], TimeoutError) and isinstance(got[2], TimeoutError)
        for _ in range(3):  # held up behind the hung lane, they would time out (not bytes)
            assert reader.read_many(paths[1:], [None, None], timeout_s=5) == [
                Path(p).read_bytes() for p in paths[1:]]
    finally:
        with open(tmp_path / "hang", "wb"):  # lets the hung thread finish
            pass


def test_reads_spread_over_threads_while_files_are_slow_and_back_when_quick(
    tmp_path: Path
) -> None:
    """FIFOs whose writer opens them a few ms late stand in for files on a slow filesystem:
    the reader notices, reads the next batches in parallel, and returns to one thread once
    reads are quick again."""
    reader = LocalFiles(concurrency=8)
    quick = _files(tmp_path / "quick", 16)
    assert reader.read_many(quick, [None] * 16, timeout_s=5) == [Path(p).read_bytes()
                                                                 for p in quick]
    assert not reader.slow

    def slow_batch(tag: str, count: int, delay_s: float) -> list[str]:
        fifos = []
        for i in range(count):
            fifo = tmp_path / f"{tag}-{i}"
            os.mkfifo(fifo)
            fifos.append(str(fifo))

        def writers() -> None:
            for fifo in fifos:
                time.sleep(delay_s)
                fd = os.open(fifo, os.O_WRONLY)  # waits for the reader to open it
                os.close(fd)

        threading.Thread(target=writers, daemon=True).start()
        return fifos

    delay = 4 * SLOW_READ_S
    fifos = slow_batch("a", 6, delay)
    assert reader.read_many(fifos, [None] * 6, timeout_s=5) == [b""] * 6
    assert reader.slow  # the next batches get `concurrency` threads
    parallel = slow_batch("b", 8, 0.0)  # opened by the writer one after the other
    seen: list[str] = []
    threads_used: set[int] = set()

    def spy(path: str, end: int | None, start: int = 0) -> bytes:  # the real read, noted
        threads_used.add(threading.get_ident())
        seen.append(path)
        return read_file(path, end, start)

    from epochcache.ingest import localfiles

    localfiles.read_file, saved = spy, localfiles.read_file  # type: ignore[assignment]
    try:
        assert reader.read_many(parallel, [None] * 8, timeout_s=5) == [b""] * 8
    finally:
        localfiles.read_file = saved  # type: ignore[assignment]
    assert len(threads_used) > 1 and sorted(seen) == sorted(parallel)
    # Quick files again: one read under QUICK_READ_S is enough to go back to one thread.
    assert reader.read_many(quick, [None] * 16, timeout_s=5)[0] == Path(quick[0]).read_bytes()
    assert not reader.slow


def test_large_files_in_the_page_cache_are_not_slow() -> None:
    """A 32 MiB file takes milliseconds to copy even from the page cache; that is its size,
    not a slow filesystem, so reads stay in one thread (they went to many threads, for good,
    when the time per file alone decided). Judged on given durations: a unit test must not
    depend on how fast this machine reads."""
    big, small = 32 << 20, 64 << 10
    page_cached = [read_wait(0.012, big)] * 4  # 32 MiB in 12 ms: 2.8 GB/s
    assert judge_reads(False, 1, page_cached) is False
    assert judge_reads(False, 1, [read_wait(0.004, small)] * 4) is True  # 64 KiB in 4 ms: NFS
    # Back to one thread as soon as one read of a multi-threaded batch was quick ...
    assert judge_reads(True, 8, [read_wait(0.030, small), read_wait(0.00005, small)]) is False
    # ... and staying with many while every read waits.
    assert judge_reads(True, 8, [read_wait(0.003, small)] * 8) is True
    # A read slower than its size explains is slow, whatever its size.
    assert judge_reads(False, 1, [read_wait(0.2, big)]) is True


def test_a_files_source_reads_a_link_inside_its_root_at_its_target_and_refuses_others(
    tmp_path: Path
) -> None:
    root = tmp_path / "root"
    inside = _files(root / "real", 2)
    outside = _files(tmp_path / "outside", 1)
    os.symlink(inside[0], root / "alias.bin")
    os.symlink(outside[0], root / "escape.bin")
    os.symlink(tmp_path / "outside", root / "outdir")
    source = FilesSource(SourceSpec(url=f"file://{root}", checks=()))
    refs = [SampleRef("alias.bin"), SampleRef("real/f001.bin"), SampleRef("escape.bin"),
            SampleRef("outdir/f000.bin"), SampleRef("nope.bin")]
    got = {ref.key: value for ref, value in source.fetch_many(refs)}
    assert got["alias.bin"] == Path(inside[0]).read_bytes()
    assert got["real/f001.bin"] == Path(inside[1]).read_bytes()
    for key in ("escape.bin", "outdir/f000.bin"):
        assert isinstance(got[key], CorruptSample) and "resolves to" in str(got[key])
    assert isinstance(got["nope.bin"], PermanentRemoteError) and "nope.bin" in str(got["nope.bin"])
