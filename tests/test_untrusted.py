"""A source is someone else's bucket: what it lists cannot make the daemon read outside the
source root or download an object it could never cache (issue 10, item 7), end to end."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
from common.cachecheck import full_check
from common.daemonproc import (
    daemon_state,
    upload,
    wait_cached,
    wait_for,
    wait_running,
    write_config,
)
from sources.contract import npy_bytes, tar_bytes

from epochcache import Cache


def test_the_daemon_quarantines_keys_outside_the_root_and_objects_too_large(
    tmp_path: Path, start_daemon: Any
) -> None:
    remote, outside = tmp_path / "remote", tmp_path / "outside"
    keys = upload(lambda prefix: f"file://{remote}", {}, "", 30, "files")
    outside.mkdir()
    secret = npy_bytes(1234.5678, (8, 8))  # a valid .npy: format checks would not stop it
    (outside / "secret.npy").write_bytes(secret)
    os.symlink(outside / "secret.npy", remote / "link.npy")
    (remote / "big.npy").write_bytes(npy_bytes(0.0, (1024, 1024)))  # 4 MiB: over the 2 MiB capacity
    bad = {
        "../outside/secret.npy": "a '..' segment",
        str(outside / "secret.npy"): "an absolute path",
        "link.npy": f"resolves to {outside / 'secret.npy'}",
        "big.npy": "listed as 4.0 MiB, larger than the 2.0 MiB",
    }
    rows = [f"{key},{(remote / key).stat().st_size}" for key in keys]
    rows += [f"{key}," for key in bad if key != "big.npy"]
    rows += [f"big.npy,{(remote / 'big.npy').stat().st_size}"]
    (remote / "keys.csv").write_text("key,size\n" + "\n".join(rows) + "\n")
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=f"file://{remote}", cache_dir=cache_dir,
                          storage_options={}, capacity="2MiB",
                          source={"manifest": str(remote / "keys.csv")})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, len(keys))

    def quarantined() -> list[dict[str, Any]] | None:
        with Cache(cache_dir, readonly=True) as cache:
            rows = cache.quarantined()
        return rows if {row["key"] for row in rows} >= set(bad) else None

    rows = wait_for(quarantined, 30, "the four refused keys to be quarantined")
    assert daemon.terminate() == 0, daemon.logs()
    reasons = {row["key"]: row["reason"] for row in rows}
    for key, why in bad.items():
        assert why in reasons[key], (key, reasons[key])
    logs = daemon.logs()
    assert all(key in logs for key in bad)  # logged with the key
    state = full_check(str(cache_dir))
    assert sorted(state.keys) == sorted(keys)  # the daemon went on with the rest
    payload = secret[-64:]
    for path in cache_dir.rglob("*"):
        if path.is_file():
            assert payload not in path.read_bytes(), f"the file outside the root is in {path}"


def test_loader_max_sample_bytes_bounds_ingest_too(tmp_path: Path) -> None:
    import pytest

    from epochcache.config import parse_config
    from epochcache.errors import ConfigError
    from epochcache.ingest.layouts import max_sample_bytes, open_configured_source

    data: dict[str, Any] = {
        "source": {"url": f"file://{tmp_path}"},
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "64MiB"},
    }
    assert parse_config(data).loader.max_sample_bytes == 256 * 1024**2  # the default
    config = parse_config({**data, "loader": {"max_sample_bytes": "1MiB"}})
    assert config.loader.max_sample_bytes == max_sample_bytes(config) == 1024**2
    assert open_configured_source(config).max_sample_bytes == 1024**2
    small = parse_config({**data, "cache": {**data["cache"], "capacity": "512KiB"}})
    assert max_sample_bytes(small) == 512 * 1024  # nothing larger than the cache gets in
    with pytest.raises(ConfigError, match="loader.max_sample_bytes"):
        parse_config({**data, "loader": {"max_sample_bytes": 0}})


# -- one step sideways (issue 22, item 5) ---------------------------------------------------


def test_a_tar_field_name_longer_than_a_record_holds_is_quarantined_and_the_rest_committed(
    tmp_path: Path, start_daemon: Any
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    long_field = "f" * 70_000  # a record stores field names in 16 bits
    members = [(f"{i:03d}.npy", npy_bytes(float(i), (4,))) for i in range(3)]
    members.insert(2, ("bad." + long_field, b"x"))
    (remote / "shard-0.tar").write_bytes(tar_bytes(members))
    (remote / "shard-1.tar").write_bytes(tar_bytes([(f"{i:03d}.npy", npy_bytes(float(i), (4,)))
                                               for i in range(10, 13)]))
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=remote.as_uri(), cache_dir=cache_dir,
                          storage_options={}, layout="tar", sampler={"processes": 1})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, 6, timeout_s=30)

    def quarantined() -> list[dict[str, Any]] | None:
        with Cache(cache_dir, readonly=True) as cache:
            return cache.quarantined() or None

    rows = wait_for(quarantined, 30, "the sample with the long field name quarantined")
    assert daemon.alive, daemon.logs()
    assert daemon.terminate() == 0, daemon.logs()
    assert [row["key"] for row in rows] == ["shard-0.tar/bad"]
    assert "field name of 70,000 bytes" in rows[0]["reason"]
    assert len(rows[0]["reason"]) < 1000  # the name is cut in messages
    state = full_check(str(cache_dir))
    good = [f"shard-0.tar/{i:03d}" for i in range(3)]
    good += [f"shard-1.tar/{i:03d}" for i in range(10, 13)]
    assert sorted(state.keys) == sorted(good)


def _zeros_npz(mib: int) -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, a=np.zeros(mib * 1024**2, dtype=np.uint8))
    return buffer.getvalue()


def test_zip_and_npz_checks_inflate_no_more_than_a_sample_may_be(tmp_path: Path) -> None:
    import zipfile

    import pytest

    from epochcache.errors import CorruptSample
    from epochcache.ingest.layouts import SourceSpec, open_source
    from epochcache.ingest.layouts.check import check_format

    (tmp_path / "bomb.npz").write_bytes(_zeros_npz(8))  # ~8 KiB that inflate to 8 MiB
    (tmp_path / "fine.npz").write_bytes(_zeros_npz(0))
    source = open_source(SourceSpec(url=tmp_path.as_uri(), pattern="*.npz",
                                    max_sample_bytes=1024**2))
    results = {ref.key: payload for ref, payload in source.fetch_many(source.list_keys())}
    assert isinstance(results["bomb.npz"], CorruptSample)
    assert "loader.max_sample_bytes" in str(results["bomb.npz"])
    assert isinstance(results["fine.npz"], bytes)

    # bzip2 members too; and a member whose header understates its size stops at that size.
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_BZIP2) as archive:
        archive.writestr("m.bin", bytes(8 * 1024**2))
    data = buffer.getvalue()
    with pytest.raises(CorruptSample, match="loader.max_sample_bytes"):
        check_format("z.zip", "z.zip", data, max_bytes=1024**2)
    check_format("z.zip", "z.zip", data, max_bytes=16 * 1024**2)  # within the bound: valid
    lying = bytearray(data)
    for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # uncompressed size
        start = lying.find(signature)
        lying[start + at : start + at + 4] = (1024).to_bytes(4, "little")
    with pytest.raises(CorruptSample, match="inflates past its stated 1.0 KiB"):
        check_format("z.zip", "z.zip", bytes(lying), max_bytes=16 * 1024**2)


def test_manifests_are_bounded_in_keys_kept_lines_and_line_length(tmp_path: Path) -> None:
    import gzip

    import pytest

    from epochcache.errors import SourceUnavailable
    from epochcache.ingest.layouts import SourceSpec, open_source

    (tmp_path / "keys.txt").write_text("".join(f"k{i}.npy\n" for i in range(1000)))
    (tmp_path / "keys.txt.gz").write_bytes(gzip.compress(b"k0.npy\n" + b"\n" * 4_000_000))
    (tmp_path / "long.jsonl").write_text('{"key": "a"}\n{"key": "' + "b" * 70_000 + '"}\n')

    def listed(manifest: str, **bounds: int) -> int:
        spec = SourceSpec(url=tmp_path.as_uri(), manifest=manifest,
                          **bounds)  # type: ignore[arg-type]
        return len(open_source(spec).list_keys())

    assert listed("keys.txt") == 1000
    # manifest_max_bytes bounds what the keys kept take, not what is read
    with pytest.raises(SourceUnavailable, match=r"keys.txt: the keys of the manifest take more "
                                                r"than 1.0 KiB after \d+ keys \(source.manifest_"):
        listed("keys.txt", manifest_max_bytes=1024)
    assert listed("keys.txt.gz", manifest_max_bytes=1024) == 1  # 4 MB of blank lines: no keys
    with pytest.raises(SourceUnavailable, match=r"more than the 999 lines allowed "
                                                r"\(source.manifest_max_lines"):
        listed("keys.txt", manifest_max_lines=999)
    with pytest.raises(SourceUnavailable, match=r"more than the 1,000,000 lines allowed"):
        listed("keys.txt.gz", manifest_max_lines=1_000_000)  # a .gz by its lines inflated
    with pytest.raises(SourceUnavailable, match=r"long.jsonl: line 2 is longer than 64.0 KiB"):
        listed("long.jsonl")


def test_every_enum_like_config_key_is_checked_when_the_config_is_read(tmp_path: Path) -> None:
    import subprocess
    import sys

    import pytest
    import yaml

    from epochcache.config import parse_config
    from epochcache.errors import ConfigError

    data: dict[str, Any] = {
        "source": {"url": tmp_path.as_uri()},
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "64MiB"},
        "loader": {"decode": "rwa"},
    }
    with pytest.raises(ConfigError,
                       match=r"loader.decode: Input should be 'auto' or 'raw', got 'rwa'"):
        parse_config(data)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-m", "epochcache", "config", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "loader.decode" in result.stderr, result


# -- untrusted input stays bounded in memory (issue 27, item 5) ------------------------------


def test_a_gzip_manifest_of_one_endless_line_is_refused_within_a_line_of_memory(
    tmp_path: Path,
) -> None:
    """4 MiB of gzip that inflate to 4 GiB of one line took 1.55 GiB within 1.8 s: the manifest
    was decompressed whole (up to manifest_max_bytes) before a line was looked at."""
    from common.bombs import gzip_bomb
    from common.peakmem import run_measured

    (tmp_path / "keys.txt.gz").write_bytes(gzip_bomb(4096))
    done = run_measured(f"""
        from epochcache.errors import SourceUnavailable
        from epochcache.ingest.layouts import SourceSpec, open_source
        source = open_source(SourceSpec(url={tmp_path.as_uri()!r}, manifest="keys.txt.gz"))
        mark()
        try:
            source.list_table()
        except SourceUnavailable as exc:
            print("MESSAGE", exc)
        report()
    """, limit_mib=512)
    assert not done.over_limit, "the manifest took more than 512 MiB"
    assert done.returncode == 0, done.stderr[-3000:]
    message = done.stdout.split("MESSAGE ", 1)[1]
    assert f"{tmp_path.as_uri()}/keys.txt.gz: line 1 is longer than 64.0 KiB" in message
    assert "source.manifest" in message  # what to check
    assert done.growth_mib < 64, done.stdout


def test_a_manifest_costs_the_memory_of_the_keys_it_keeps(tmp_path: Path) -> None:
    """A CSV manifest whose rows carry 20 KiB of other columns: 60 MiB of text, 30 KiB of keys.
    It was held whole (and decoded whole: twice); now a row at a time."""
    import gzip

    from common.peakmem import run_measured

    notes = "n" * 20_000
    rows = "".join(f"k{i:05d}.npy,{i},{notes}\n" for i in range(3000))
    (tmp_path / "keys.csv.gz").write_bytes(gzip.compress(("key,size,notes\n" + rows).encode(), 1))
    done = run_measured(f"""
        from epochcache.ingest.layouts import SourceSpec, open_source
        source = open_source(SourceSpec(url={tmp_path.as_uri()!r}, manifest="keys.csv.gz"))
        mark()
        table = source.list_table()
        print("KEYS", len(table), table.key(0), int(table.sizes[2999]))
        report()
    """, limit_mib=512)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KEYS 3000 k00000.npy 2999" in done.stdout
    assert done.growth_mib < 24, done.stdout  # 60 MiB of text went through


def test_a_shard_of_huge_member_names_cannot_fill_the_cache_or_the_logs(
    tmp_path: Path, start_daemon: Any
) -> None:
    """One tar shard whose member names are 100 kB long grew a 1 MiB cache's data file to
    57 MiB (each quarantine row held the key three times), wrote 100 kB log lines, and with
    800 such members killed the sampler with MapFullError on every restart until the daemon
    gave up. Quarantined keys are kept and shown cut, with a digest of the whole."""
    import hashlib
    import json
    import subprocess
    import sys

    remote = tmp_path / "remote"
    remote.mkdir()
    names = [f"{i:03d}" + "n" * 100_000 for i in range(300)]
    (remote / "huge.tar").write_bytes(tar_bytes([(f"{name}.npy", b"not npy") for name in names]))
    (remote / "good.tar").write_bytes(tar_bytes([(f"{i:03d}.npy", npy_bytes(float(i), (4,)))
                                                 for i in range(20)]))
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=remote.as_uri(), cache_dir=cache_dir,
                          storage_options={}, layout="tar", capacity="1MiB",
                          sampler={"processes": 1})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, 20, timeout_s=60)

    def all_quarantined() -> bool:
        with Cache(cache_dir, readonly=True) as cache:
            return cache.counters().quarantined >= len(names)

    wait_for(all_quarantined, 120, "the 300 samples with huge names to be quarantined")
    state = daemon_state(cache_dir)
    assert daemon.alive() and state is not None, daemon.logs()[-3000:]
    assert all(not s.get("restarts") for s in state["samplers"].values()), state  # never died
    status = subprocess.run([sys.executable, "-m", "epochcache", "status", "--json",
                             str(cache_dir)], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert daemon.terminate() == 0, daemon.logs()[-3000:]
    assert (cache_dir / "data.mdb").stat().st_size < 8 * 1024**2  # 57 MiB before
    longest = max(map(len, daemon.logs().splitlines()))
    assert longest < 4096, f"a log line of {longest:,} characters"
    with Cache(cache_dir, readonly=True) as cache:
        rows = cache.quarantined(limit=1000)
        assert cache.counters().quarantined == len(names)
    full = {f"huge.tar/{name}": name for name in names}
    assert rows and all(len(json.dumps(row)) < 4096 for row in rows)
    for row in rows:  # cut, and named by the digest of the whole key
        key = next(k for k in full if row["key"].startswith(k[:160]))
        assert row["key_sha256"] == hashlib.sha256(key.encode()).hexdigest()[:16]
        assert row["key_chars"] == len(key) and row["key_sha256"] in row["key"]
        assert "not a valid .npy" in row["reason"]
    assert len(status) < 64 * 1024 and json.loads(status)["quarantined"] == len(names)
    assert sorted(full_check(str(cache_dir)).keys) == [f"good.tar/{i:03d}" for i in range(20)]


def test_a_tar_shard_larger_than_the_in_flight_budget_is_streamed_not_held(
    tmp_path: Path,
) -> None:
    """A tar shard was held whole in memory (about 2.5x its size: its bytes, its samples, their
    records) whatever ``sampler.max_bytes_in_flight`` said, while docs/operations/security.md
    said shards are bounded by it. A sampler (in a process of its own) caches a 96 MiB shard
    with an 8 MiB budget; its memory is measured from when it starts fetching."""
    import random
    import tarfile

    from common.peakmem import run_measured

    remote, samples = tmp_path / "remote", 96
    remote.mkdir()
    rng = random.Random(0)
    with tarfile.open(remote / "big.tar", "w") as archive:  # incompressible 1 MiB samples
        for i in range(samples):
            for name, data in ((f"{i:04d}.bin", rng.randbytes(1024**2)),
                               (f"{i:04d}.cls", str(i).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    cache_dir = tmp_path / "cache"
    done = run_measured(f"""
        import threading
        from epochcache import Cache
        from epochcache.config import EpochcacheConfig
        from epochcache.ingest.sampler import Sampler
        config = EpochcacheConfig.model_validate({{
            "source": {{"url": {remote.as_uri()!r}, "layout": "tar", "pattern": "*.tar"}},
            "cache": {{"dir": {str(cache_dir)!r}, "capacity": "160MiB", "sync": False}},
            "sampler": {{"processes": 1, "concurrency": 4, "max_bytes_in_flight": "8MiB"}},
        }})
        Cache(config.cache.dir, "160MiB").close()  # as the daemon creates it
        stop = threading.Event()
        sampler = Sampler(config, 0, stop)
        mark()
        runner = threading.Thread(target=sampler.run)
        runner.start()
        while len(sampler.cache) < {samples} and runner.is_alive():
            stop.wait(0.05)
        stop.set()
        runner.join(120)
        sampler.close()
        report()
    """, limit_mib=1024)
    assert done.returncode == 0, done.stderr[-3000:]
    # Measured ~15 MiB (the budget, a part being read and encoded, buffers); 250 MiB before.
    # Anonymous memory: the LMDB file's pages the process maps are page cache.
    assert done.anon_growth_mib < 40, done.stdout
    state = full_check(str(cache_dir))
    assert sorted(state.keys) == [f"big.tar/{i:04d}" for i in range(samples)]
    rng = random.Random(0)
    expected = [rng.randbytes(1024**2) for _ in range(samples)]
    with Cache(cache_dir, readonly=True) as cache:
        for seq, key in zip(state.seqs, state.keys):
            value = cache.get(seq)
            i = int(key.rsplit("/", 1)[1])
            assert value == {"bin": expected[i], "cls": str(i).encode()}, key
