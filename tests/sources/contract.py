"""Contract tests every source backend passes (mixed into per-backend classes, as fsspec does).

A backend class provides a ``backend`` fixture returning a :class:`Backend`: a root URL with its
storage options and a way to write objects under it.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from epochcache.demo import write_demo_data
from epochcache.errors import CorruptSample, PermanentRemoteError, SourceError, SourceUnavailable
from epochcache.ingest.layouts import (
    SampleRef,
    SourceSpec,
    listing_cached,
    open_source,
    source_fingerprint,
)


@dataclass
class Backend:
    """Where a contract test writes its objects."""

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    put: Callable[[str, bytes], None] = lambda key, data: None
    client: str | None = None  # source.client (s3: s3fs or obstore reads the objects)

    def url(self, sub: str = "") -> str:
        return f"{self.root.rstrip('/')}/{sub}".rstrip("/") if sub else self.root

    def source(self, sub: str = "", **fields: Any) -> SourceSpec:
        if self.client is not None:
            fields.setdefault("client", self.client)
        return SourceSpec(url=self.url(sub), storage_options=self.storage_options, **fields)


def npy_bytes(value: float = 1.0, shape: tuple[int, ...] = (4, 4)) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.full(shape, value, dtype=np.float32))
    return buffer.getvalue()


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class SourceContract:
    """Behaviour shared by file://, memory:// and s3:// sources."""

    def test_files_listing_with_pattern(self, backend: Backend) -> None:
        write_demo_data(backend.url("d"), 12, "files", backend.storage_options)
        source = open_source(backend.source("d", pattern="*.npy"))
        refs = source.list_keys()
        assert [r.key for r in refs] == [f"sample-{i:06d}.npy" for i in range(12)]
        assert all(r.size == 1152 for r in refs)

    def test_glob_levels(self, backend: Backend) -> None:
        for key in ("a.npy", "x/b.npy", "x/y/c.npy", "x/notes.txt"):
            backend.put(f"g/{key}", npy_bytes())
        def keys(pattern: str) -> list[str]:
            return [r.key for r in open_source(backend.source("g", pattern=pattern)).list_keys()]
        assert keys("*.npy") == ["a.npy"]
        assert keys("**/*.npy") == ["a.npy", "x/b.npy", "x/y/c.npy"]
        assert keys("x/*") == ["x/b.npy", "x/notes.txt"]
        assert keys("**") == ["a.npy", "x/b.npy", "x/notes.txt", "x/y/c.npy"]

    def test_fetch_files_returns_bytes_in_order(self, backend: Backend) -> None:
        write_demo_data(backend.url("d"), 20, "files", backend.storage_options)
        source = open_source(backend.source("d", pattern="*.npy"), concurrency=4)
        refs = source.list_keys()
        results = source.fetch_many(refs)
        assert [r.key for r, _ in results] == [r.key for r in refs]
        arrays = [np.load(io.BytesIO(p)) for _, p in results if isinstance(p, bytes)]
        assert len(arrays) == 20 and arrays[0].shape == (16, 16) and arrays[0].dtype == np.float32

    def test_missing_object_is_permanent_error_with_key(self, backend: Backend) -> None:
        write_demo_data(backend.url("d"), 3, "files", backend.storage_options)
        source = open_source(backend.source("d"))
        from epochcache.ingest.layouts import SampleRef

        [(_ref, result)] = source.fetch_many([SampleRef("nope.npy")])
        assert isinstance(result, PermanentRemoteError)
        assert "nope.npy" in str(result) and "nope.npy" in result.url

    def test_tar_groups_members_into_samples(self, backend: Backend) -> None:
        write_demo_data(backend.url("d"), 25, "tar", backend.storage_options, samples_per_shard=10)
        source = open_source(backend.source("d", layout="tar"))
        shards = source.list_keys()
        assert [s.key for s in shards] == [
            "shard-000000.tar",
            "shard-000001.tar",
            "shard-000002.tar",
        ]
        results = source.fetch_many(shards)
        assert len(results) == 25
        ref, fields = results[11]
        assert ref.key == "shard-000001.tar/000011" and ref.shard == "shard-000001.tar"
        assert ref.members == ("000011.npy", "000011.cls")
        assert isinstance(fields, dict) and set(fields) == {"npy", "cls"}
        assert fields["cls"] == b"3"  # class = index % 4
        assert len({r.key for r, _ in results}) == 25

    def test_tar_shards_brace_pattern(self, backend: Backend) -> None:
        write_demo_data(backend.url("d"), 30, "tar", backend.storage_options, samples_per_shard=10)
        source = open_source(backend.source("d", layout="tar", shards="shard-{000000..000002}.tar"))
        assert len(source.list_keys()) == 3
        missing = open_source(backend.source("d", layout="tar", shards="other-{00..02}.tar"))
        with pytest.raises(SourceUnavailable, match="other-"):
            missing.list_keys()

    @pytest.mark.parametrize("name", ["manifest.csv", "manifest.jsonl", "keys.txt",
                                      "keys.parquet"])
    def test_manifest_formats(self, backend: Backend, name: str) -> None:
        write_demo_data(backend.url("d"), 8, "files", backend.storage_options)
        keys = [f"sample-{i:06d}.npy" for i in range(8)]
        if name == "keys.txt":
            backend.put("d/keys.txt", b"# keys\n" + "".join(f"{k}\n" for k in keys).encode())
        if name == "keys.parquet":  # read by nothing in the suite before pyarrow was in it
            import pyarrow as pa
            import pyarrow.parquet as pq

            sink = pa.BufferOutputStream()
            pq.write_table(pa.table({"key": keys[::-1], "size": [1152] * 8,
                                     "weight": [0.5] * 8}), sink)
            backend.put("d/keys.parquet", sink.getvalue().to_pybytes())
        refs = open_source(backend.source("d", manifest=name)).list_keys()
        assert [r.key for r in refs] == keys
        if name == "keys.parquet":
            assert all(r.size == 1152 and r.weight == 0.5 for r in refs)
        elif name != "keys.txt":
            assert all(r.size == 1152 and r.checksum and len(r.checksum) == 64 for r in refs)

    def test_manifest_weights_and_subset_columns(self, backend: Backend) -> None:
        backend.put("m/a.bin", b"a")
        backend.put("m/manifest.csv", b"key,weight\na.bin,2.5\nb.bin,0\n")
        refs = open_source(backend.source("m", manifest="manifest.csv")).list_keys()
        assert [(r.key, r.weight, r.size) for r in refs] == [
            ("a.bin", 2.5, None),
            ("b.bin", 0.0, None),
        ]
        backend.put("m/bad.csv", b"name,size\na,1\n")
        with pytest.raises(SourceUnavailable, match="key"):
            open_source(backend.source("m", manifest="bad.csv")).list_keys()

    def test_checksum_and_size_mismatch_are_corrupt(self, backend: Backend) -> None:
        good, bad = npy_bytes(1.0), npy_bytes(2.0)
        backend.put("c/good.npy", good)
        backend.put("c/bad.npy", bad)
        backend.put("c/short.npy", good)
        manifest = (
            f'{{"key":"good.npy","checksum":"sha256:{hashlib.sha256(good).hexdigest()}"}}\n'
            f'{{"key":"bad.npy","checksum":"{hashlib.sha256(good).hexdigest()}"}}\n'
            f'{{"key":"short.npy","size":{len(good) + 1}}}\n'
        )
        backend.put("c/manifest.jsonl", manifest.encode())
        source = open_source(backend.source("c", manifest="manifest.jsonl"))
        results = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(results["good.npy"], bytes)
        assert isinstance(results["bad.npy"], CorruptSample) and results["bad.npy"].key == "bad.npy"
        assert "sha256 mismatch" in str(results["bad.npy"])
        assert isinstance(results["short.npy"], CorruptSample) and "size" in str(
            results["short.npy"]
        )

    def test_truncated_objects_fail_format_checks(self, backend: Backend) -> None:
        import gzip

        backend.put("f/ok.npy", npy_bytes())
        backend.put("f/cut.npy", npy_bytes()[:-7])
        backend.put("f/cut.json.gz", gzip.compress(b'{"a": 1}' * 50)[:-9])
        backend.put("f/bad.json", b'{"a": ')
        source = open_source(backend.source("f"))
        results = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(results["ok.npy"], bytes)
        for key in ("cut.npy", "cut.json.gz", "bad.json"):
            assert isinstance(results[key], CorruptSample), key
            assert results[key].key == key
        unchecked = open_source(backend.source("f", checks=[]))
        assert all(isinstance(p, bytes) for _, p in unchecked.fetch_many(unchecked.list_keys()))

    def test_corrupt_tar_member_is_quarantined_not_fatal(self, backend: Backend) -> None:
        members = []
        for i in range(4):
            members += [(f"{i:03d}.npy", npy_bytes(i)), (f"{i:03d}.cls", str(i).encode())]
        members[2] = ("001.npy", npy_bytes(1)[:-5])  # a bad member inside a well-formed tar
        backend.put("t/a.tar", tar_bytes(members))
        whole = tar_bytes([(f"{i:03d}.npy", npy_bytes(i)) for i in range(6)])
        backend.put("t/b.tar", whole[: 512 * 7 + 100])  # truncated shard, mid-member
        source = open_source(backend.source("t", layout="tar"))
        results = source.fetch_many(source.list_keys())
        outcome = {r.key: type(p).__name__ for r, p in results}
        assert outcome["a.tar/000"] == "dict" and outcome["a.tar/002"] == "dict"
        assert outcome["a.tar/001"] == "CorruptSample"
        good_b = [k for k, v in outcome.items() if k.startswith("b.tar/") and v == "dict"]
        bad_b = [k for k, v in outcome.items() if k.startswith("b.tar") and v == "CorruptSample"]
        assert good_b and len(bad_b) == 1
        corrupt = {r.key: p for r, p in results}[bad_b[0]]
        assert isinstance(corrupt, CorruptSample) and corrupt.key == bad_b[0]

    def test_empty_prefix_fails_fast_with_url_and_pattern(self, backend: Backend) -> None:
        backend.put("e/other.txt", b"x")
        start = time.monotonic()
        with pytest.raises(SourceUnavailable) as info:
            open_source(backend.source("e", pattern="*.npy")).list_keys()
        assert time.monotonic() - start < 60  # not minutes of retries (a loaded machine: ~8 s)
        assert backend.url("e") in str(info.value) and "*.npy" in str(info.value)
        assert "source.pattern" in str(info.value)

    def test_missing_root_fails_fast(self, backend: Backend) -> None:
        start = time.monotonic()
        with pytest.raises(SourceUnavailable) as info:
            open_source(backend.source("does-not-exist")).list_keys()
        assert time.monotonic() - start < 60  # not minutes of retries (a loaded machine: ~8 s)
        assert "does-not-exist" in str(info.value)

    def test_listing_cache_round_trip(
        self, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        write_demo_data(backend.url("d"), 5, "files", backend.storage_options)
        source = open_source(backend.source("d", pattern="*.npy"))
        first = listing_cached(source, tmp_path).refs
        saved = list((tmp_path / "listings").iterdir())
        assert [p.name for p in saved] == [f"{source_fingerprint(source.spec)}.keys"]
        secret_free = saved[0].read_bytes()
        for value in _secret_strings(backend.storage_options):
            assert value.encode() not in secret_free

        def fail() -> None:
            raise AssertionError("re-listed although a listing was saved")

        for listing in ("list_keys", "list_table", "pager"):
            monkeypatch.setattr(source, listing, fail)
        assert listing_cached(source, tmp_path).refs == first

    # -- untrusted input is bounded (issue 10, item 7) ---------------------------------------

    def test_keys_that_leave_the_root_are_refused_never_read(self, backend: Backend) -> None:
        backend.put("inside/ok.npy", npy_bytes(1.0))
        backend.put("outside/secret.npy", npy_bytes(7.0))  # next to the root, not under it
        absolute = backend.url("outside/secret.npy").split("://", 1)[-1]
        if not absolute.startswith("/"):
            absolute = "/" + absolute
        keys = ["ok.npy", "../outside/secret.npy", "a/../../outside/secret.npy", absolute]
        backend.put("inside/keys.txt", "\n".join(keys).encode())
        source = open_source(backend.source("inside", manifest="keys.txt"))
        results = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(results["ok.npy"], bytes)
        for key in keys[1:]:
            refused = results[key]
            assert isinstance(refused, CorruptSample), (key, refused)
            assert refused.key == key and key in str(refused)
            assert "leaves the source root" in str(refused)

    def test_an_object_listed_larger_than_the_limit_is_refused_before_download(
        self, backend: Backend
    ) -> None:
        backend.put("big/small.npy", npy_bytes())
        backend.put("big/large.npy", npy_bytes(shape=(512, 512)))  # 1 MiB
        backend.put("big/manifest.csv", b"key,size\nsmall.npy,\nlarge.npy,1048704\n"
                                        b"huge.npy,68719476736\n")  # listed, never written
        source = open_source(backend.source("big", manifest="manifest.csv",
                                            max_sample_bytes=64 * 1024))
        results = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(results["small.npy"], bytes)
        for key, size in (("large.npy", "1.0 MiB"), ("huge.npy", "64.0 GiB")):
            assert isinstance(results[key], CorruptSample), results[key]
            assert f"listed as {size}" in str(results[key]) and "64.0 KiB" in str(results[key])
        # huge.npy does not exist: refused from its listed size, never requested

    def test_an_object_of_unknown_size_is_read_only_up_to_the_limit(
        self, backend: Backend
    ) -> None:
        from epochcache.ingest.remote import fetch_many

        backend.put("u/large.bin", bytes(range(256)) * 4096)  # 1 MiB
        backend.put("u/empty.bin", b"")
        backend.put("u/keys.txt", b"large.bin\nempty.bin\n")
        source = open_source(backend.source("u", manifest="keys.txt", max_sample_bytes=4096))
        results = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(results["large.bin"], CorruptSample)
        assert "is more than 4.0 KiB" in str(results["large.bin"])
        assert results["empty.bin"] == b""  # a ranged read of an empty object is not an error
        # what the fetch reads: the limit plus one byte, however large the object
        read = fetch_many(source.fs, [source.object_path("large.bin"),
                                      source.object_path("empty.bin")], limits=[4097, 4097])
        assert [len(r) for r in read] == [4097, 0]  # type: ignore[arg-type]

    def test_a_gzip_bomb_is_refused_after_the_limit(self, backend: Backend) -> None:
        from common.bombs import gzip_bomb

        backend.put("z/bomb.npy.gz", gzip_bomb(64))  # 65 KiB that expand to 64 MiB
        backend.put("z/ok.json.gz", __import__("gzip").compress(b'{"a": 1}'))
        members = [("000.npy.gz", gzip_bomb(64)), ("000.cls", b"1"), ("001.cls", b"2")]
        backend.put("z/shard.tar", tar_bytes(members))
        files = open_source(backend.source("z", pattern="*.gz", max_sample_bytes=8 * 1024**2))
        results = {r.key: p for r, p in files.fetch_many(files.list_keys())}
        assert isinstance(results["ok.json.gz"], bytes)
        bomb = results["bomb.npy.gz"]
        assert isinstance(bomb, CorruptSample) and bomb.key == "bomb.npy.gz"
        assert "expands past 8.0 MiB" in str(bomb)
        tar = open_source(backend.source("z", layout="tar", max_sample_bytes=8 * 1024**2))
        samples = {r.key: p for r, p in tar.fetch_many(tar.list_keys())}
        assert isinstance(samples["shard.tar/001"], dict)
        assert isinstance(samples["shard.tar/000"], CorruptSample)
        assert "expands past 8.0 MiB" in str(samples["shard.tar/000"])

    def test_a_tar_shard_is_handed_over_in_pieces_as_it_is_read(self, backend: Backend) -> None:
        """A sampler gets a shard's samples a piece at a time while the shard is read (what
        it holds stays within its budget); the fetch's results stand in for them."""
        from epochcache.ingest.layouts import STREAMED

        members = []
        for i in range(12):
            members += [(f"{i:03d}.bin", bytes([i]) * 10_000), (f"{i:03d}.cls", b"%d" % i)]
        backend.put("p/a.tar", tar_bytes(members))
        backend.put("p/b.tar", tar_bytes(members[:4]))
        source = open_source(backend.source("p", layout="tar"))
        pieces: list[Any] = []
        results = source.fetch_with_retries(source.list_keys(), on_piece=pieces.append,
                                            piece_bytes=25_000)
        handed = {ref.key: payload for piece in pieces for ref, payload in piece.results}
        assert len(pieces) >= 4 and all(len(piece.results) <= 3 for piece in pieces)
        # each piece says its shard, its samples' ordinals there, and on the last the count
        for shard, count in (("a.tar", 12), ("b.tar", 2)):
            mine = [piece for piece in pieces if piece.shard.key == shard]
            firsts = [piece.first for piece in mine]
            assert firsts == sorted(firsts) and firsts[0] == 0
            assert [piece.members for piece in mine] == [None] * (len(mine) - 1) + [count]
            for piece in mine:
                assert [ref.key for ref, _ in piece.results] == [
                    f"{shard}/{i:03d}" for i in range(piece.first, piece.first + len(piece.results))]
        assert sorted(handed) == sorted([f"a.tar/{i:03d}" for i in range(12)]
                                        + ["b.tar/000", "b.tar/001"])
        assert handed["a.tar/007"] == {"bin": bytes([7]) * 10_000, "cls": b"7"}
        assert len(results) == 14 and all(payload is STREAMED for _, payload in results)
        assert source.held_bytes(source.list_keys()[0], 10**9, 25_000) == 0  # pieces take theirs

    def test_a_tar_member_larger_than_the_limit_is_refused(self, backend: Backend) -> None:
        members = [("000.bin", bytes(200_000)), ("000.cls", b"0"), ("001.bin", b"x"),
                   ("001.cls", b"1")]
        backend.put("m/shard.tar", tar_bytes(members))
        source = open_source(backend.source("m", layout="tar", max_sample_bytes=100_000))
        samples = {r.key: p for r, p in source.fetch_many(source.list_keys())}
        assert isinstance(samples["shard.tar/001"], dict)
        refused = samples["shard.tar/000"]
        assert isinstance(refused, CorruptSample) and "'000.bin' is 195.3 KiB" in str(refused)

    def test_read_range_reads_that_range_only(self, backend: Backend) -> None:
        """The ranged reads every layout may use (issue 36): the bytes asked for, counted as
        one GET each with only their bytes received, the size as listed or asked for."""
        data = bytes(range(256)) * 1200  # 300 KiB, every offset distinct modulo 256
        backend.put("r/blob.bin", data)
        source = open_source(backend.source("r"))
        [listed] = source.list_keys()
        assert source.object_size(listed) == len(data)
        assert source.object_size(SampleRef("blob.bin")) == len(data)  # not listed: asked
        before = dict(source.gate.stats.values)
        assert bytes(source.read_range(listed, 1000, 5000)) == data[1000:5000]
        assert bytes(source.read_range(listed, len(data) - 8, len(data))) == data[-8:]
        assert bytes(source.read_range(listed, len(data) - 3, len(data) + 100)) == data[-3:]
        stats = source.gate.stats.values
        assert stats["gets"] - before["gets"] == 3
        assert stats["bytes"] - before["bytes"] == 4000 + 8 + 3
        with pytest.raises(SourceError) as missing:
            source.read_range(SampleRef("nothing.bin"), 0, 10)
        assert "nothing.bin" in str(missing.value)
        with pytest.raises(CorruptSample, match="leaves the source root"):
            source.read_range(SampleRef("../blob.bin"), 0, 10)
        small = open_source(backend.source("r", max_range_bytes=4096))
        with pytest.raises(CorruptSample, match=r"sampler.max_bytes_in_flight"):
            small.read_range(listed, 0, 4097)  # refused before a request
        assert small.gate.stats.values["gets"] == 0


def _secret_strings(options: dict[str, Any]) -> list[str]:
    return [v for k, v in options.items() if k in ("key", "secret") and isinstance(v, str)]
