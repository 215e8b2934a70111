"""The ``parquet`` layout (issue 36): a file's rows are samples, read a row group at a time with
ranged reads (the footer's length, the footer, then one GET per row group), never the whole
file; a damaged file, an absurd footer or a row group larger than a sampler holds in flight is
refused with its reason; a daemon caches the rows and quarantines what is refused."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa  # the test extra installs it (the layout's own extra is optional)
import pyarrow.parquet as pq
import pytest
from common.daemonproc import read_cache, wait_cached, wait_for, wait_running, write_config

from epochcache.config import parse_config
from epochcache.errors import ConfigError, CorruptSample
from epochcache.ingest.layouts import STREAMED, Piece, SourceSpec, open_source

if TYPE_CHECKING:
    from conftest import S3Env

ROWS, GROUP_ROWS = 300, 100  # three row groups


def table(rows: int = ROWS, blob_bytes: int = 64) -> Any:
    """Rows with a string (null every tenth), an int label and a blob: what ``txt``, ``cls``
    and a raw field read."""
    return pa.table({
        "txt": [None if i % 10 == 9 else f"row {i}" for i in range(rows)],
        "cls": list(range(rows)),
        "bin": [bytes([i % 256]) * blob_bytes for i in range(rows)],
    })


def parquet_bytes(data: Any, group_rows: int = GROUP_ROWS, **kwargs: Any) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(data, sink, row_group_size=group_rows, **kwargs)
    return bytes(sink.getvalue().to_pybytes())


def put_all(tmp_path: Path, s3: S3Env | None, files: dict[str, bytes]) -> tuple[str, dict[str, Any]]:
    """Write ``files`` under a root (a directory, or the moto bucket); its URL and options."""
    if s3 is None:
        for name, data in files.items():
            (tmp_path / "ds" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "ds" / name).write_bytes(data)
        return (tmp_path / "ds").as_uri(), {}
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options)
    for name, data in files.items():
        fs.pipe_file(f"{s3.bucket}/ds/{name}", data)
    return s3.url("ds"), s3.storage_options


@pytest.fixture(params=["file", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``put(files) -> (url, storage_options)`` on file:// or moto's S3 server."""
    s3 = request.getfixturevalue("s3") if request.param == "s3" else None
    return lambda files: put_all(tmp_path, s3, files)


def test_rows_are_samples_read_a_row_group_per_get(where: Any) -> None:
    data = parquet_bytes(table(), compression="snappy")
    url, options = where({"a/train-0.parquet": data, "a/notes.txt": b"not listed"})
    source = open_source(SourceSpec(url=url, layout="parquet", storage_options=options))
    refs = source.list_keys()
    assert [ref.key for ref in refs] == ["a/train-0.parquet"]  # the default pattern
    pieces: list[Piece] = []
    [results] = source.fetch_grouped(refs, on_piece=pieces.append, piece_bytes=4000)
    assert len(results) == ROWS and all(payload is STREAMED for _, payload in results)
    stats = source.gate.stats.values
    assert stats["gets"] == 2 + 3  # the footer's length, the footer, a GET per row group
    assert stats["bytes"] <= len(data)  # ranges of the file, never more
    samples = {ref.key: payload for piece in pieces for ref, payload in piece.results}
    assert list(samples) == [f"a/train-0.parquet/{i:09d}" for i in range(ROWS)]
    assert samples["a/train-0.parquet/000000007"] == {
        "txt": b"row 7", "cls": b"7", "bin": bytes([7]) * 64}
    assert "txt" not in samples["a/train-0.parquet/000000019"]  # a null: no field
    # pieces in file order, each at most piece_bytes, the last saying how many rows the file has
    assert [piece.first for piece in pieces] == sorted(piece.first for piece in pieces)
    assert all(sum(len(value) for _, fields in piece.results
                   for value in fields.values()) <= 4000 for piece in pieces)  # type: ignore[union-attr]
    assert [piece.members for piece in pieces][-1] == ROWS and pieces[0].members is None
    assert all(piece.shard is refs[0] for piece in pieces)


def test_a_file_whose_read_failed_goes_on_after_the_rows_handed_over(
        s3: S3Env, tmp_path: Path, remote_proxy: Any) -> None:
    url, options = put_all(tmp_path, s3, {"t.parquet": parquet_bytes(table(blob_bytes=4000),
                                                                    compression="none")})
    proxy = remote_proxy(s3.endpoint_url, latency_s=0.0)
    source = open_source(SourceSpec(
        url=url, layout="parquet", timeout_s=1.0, retries=1, client="s3fs",
        storage_options={**options, "endpoint_url": proxy.endpoint}))
    refs = source.list_keys()
    pieces: list[Piece] = []

    def stall_after_the_first(piece: Piece) -> None:
        pieces.append(piece)  # the next body stops for longer than timeout_s, and is not retried
        proxy.manners.stall_after_bytes, proxy.manners.stall_s = 10, 2.5

    [failed] = source.fetch_grouped(refs, on_piece=stall_after_the_first, piece_bytes=10**6)
    assert [payload for _, payload in failed[:-1]] == [STREAMED] * GROUP_ROWS
    assert type(failed[-1][1]).__name__ == "RemoteTimeout" and failed[-1][0] is refs[0]
    proxy.manners.stall_after_bytes = None
    gets = source.gate.stats.values["gets"]
    [done] = source.fetch_grouped(refs, on_piece=pieces.append, piece_bytes=10**6)
    # the footer again, then the two row groups not handed over; the first is not read again
    assert source.gate.stats.values["gets"] - gets == 2 + 2
    assert [(piece.first, len(piece.results)) for piece in pieces] == [(0, 100), (100, 100),
                                                                    (200, 100)]
    assert pieces[-1].members == ROWS and len(done) == ROWS


def test_damaged_files_are_refused_with_their_reason(tmp_path: Path) -> None:
    good = parquet_bytes(table(), compression="snappy")
    metadata = pq.read_metadata(pa.BufferReader(good))
    column = metadata.row_group(1).column(2)  # the second group's blobs, garbled mid-pages
    start = column.data_page_offset
    garbled = bytearray(good)
    garbled[start : start + column.total_compressed_size] = os.urandom(column.total_compressed_size)
    footer_bomb = b"PAR1" + bytes(100) + (2**31).to_bytes(4, "little") + b"PAR1"
    url, _ = put_all(tmp_path, None, {"garbled.parquet": bytes(garbled),
                                      "text.parquet": b"key,label\n" * 10,
                                      "bomb.parquet": footer_bomb, "good.parquet": good})
    source = open_source(SourceSpec(url=url, layout="parquet"))
    groups = dict(zip(["bomb", "garbled", "good", "text"],
                      source.fetch_grouped(source.list_keys())))
    assert len(groups["good"]) == ROWS
    # the rows of the row group before the damage are kept, then the file is refused
    kept, (ref, error) = groups["garbled"][:-1], groups["garbled"][-1]
    assert len(kept) == GROUP_ROWS and all(isinstance(payload, dict) for _, payload in kept)
    assert ref.key == "garbled.parquet" and isinstance(error, CorruptSample)
    assert "garbled.parquet: row group 1 does not decode" in str(error)
    [(_, error)] = groups["text"]
    assert isinstance(error, CorruptSample) and "does not end with PAR1" in str(error)
    [(_, error)] = groups["bomb"]
    assert isinstance(error, CorruptSample) and "its footer says 2.0 GiB" in str(error)


def test_a_row_group_larger_than_a_sampler_holds_is_refused_unread(tmp_path: Path) -> None:
    data = parquet_bytes(table(blob_bytes=1000), compression="none")
    url, _ = put_all(tmp_path, None, {"big.parquet": data})
    source = open_source(SourceSpec(url=url, layout="parquet", max_range_bytes=50_000))
    [(ref, error)] = source.fetch_many(source.list_keys())
    assert isinstance(error, CorruptSample)
    assert "big.parquet: refused: row group 0 is" in str(error)
    assert "sampler.max_bytes_in_flight" in str(error)
    assert source.gate.stats.values["gets"] == 2  # the footer only


def test_layout_parquet_without_pyarrow_is_a_config_error(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    config = {"source": {"url": "s3://b/x", "layout": "parquet"},
              "cache": {"dir": "/tmp/c", "capacity": "1GiB"}}
    assert parse_config(config).source.effective_pattern == "**/*.parquet"
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        parse_config(config)
    assert "source.layout: layout parquet needs pyarrow" in str(info.value)
    assert "pip install 'epochcache[parquet]'" in str(info.value)


def test_a_fetch_holds_a_few_row_groups_never_the_file(tmp_path: Path) -> None:
    """12 row groups of 8 MiB (96 MiB, uncompressed noise in 512 KiB rows): a fetch's peak
    memory is its row group's bytes, the table pyarrow decodes them into and the piece being
    handed over, plus what the allocators keep: 2.9 row groups measured here (mimalloc,
    arrow's default); with 128 KiB rows, 3.4 (jemalloc) to 5.4 (mimalloc). Reading through
    arrow's read-ahead and copying each read from the spans held was 5-7; the file is 12."""
    from common.peakmem import run_measured

    group_bytes, groups = 8 * 2**20, 12
    rows = 16 * groups
    noise = os.urandom(group_bytes // 16)
    pq.write_table(pa.table({"bin": [noise] * rows, "cls": list(range(rows))}),
                   tmp_path / "big.parquet", row_group_size=16, compression="none",
                   use_dictionary=False)
    done = run_measured(f"""
        import pyarrow.parquet
        from epochcache.ingest.layouts import SourceSpec, open_source
        source = open_source(SourceSpec(url={tmp_path.as_uri()!r}, layout="parquet"))
        refs = source.list_keys()
        handed = []
        mark()
        source.fetch_grouped(refs, on_piece=lambda piece: handed.append(len(piece.results)),
                             piece_bytes=2 << 20)
        print("ROWS", sum(handed), "GETS", source.gate.stats.values["gets"])
        report()
    """, limit_mib=80)
    assert not done.over_limit, "a fetch took more than 80 MiB"
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ROWS {rows} GETS {2 + groups}" in done.stdout
    print(f"peak growth {done.growth_mib:.1f} MiB: {done.growth_mib * 2**20 / group_bytes:.2f} "
          "row groups")
    assert done.growth_mib < 5 * group_bytes / 2**20, done.stdout


@pytest.mark.timeout(120)
def test_a_daemon_caches_the_rows_and_quarantines_a_damaged_file(
        s3: S3Env, tmp_path: Path, start_daemon: Any) -> None:
    url, options = put_all(tmp_path, s3, {
        "train-0.parquet": parquet_bytes(table(), compression="snappy"),
        "train-1.parquet": b"not parquet at all"})
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=url, cache_dir=cache_dir,
                          storage_options=options, layout="parquet",
                          source={"pattern": "**/*.parquet"}, sampler={"processes": 1})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, ROWS)
    rows = wait_for(lambda: read_cache(cache_dir, lambda c: c.quarantined()), 30,
                    "the damaged file to be quarantined")
    assert [row["key"] for row in rows] == ["train-1.parquet"]
    assert "not a Parquet file" in rows[0]["reason"]
    time.sleep(0.5)  # nothing more arrives
    assert daemon.terminate() == 0, daemon.logs()[-3000:]

    def row(cache: Any) -> Any:
        return cache.get(cache.seq_of("train-0.parquet/000000042"))

    assert read_cache(cache_dir, row) == {"txt": b"row 42", "cls": b"42",
                                          "bin": bytes([42]) * 64}
    assert read_cache(cache_dir, len) == ROWS
