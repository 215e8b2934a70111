"""A source is someone else's bucket: what it lists cannot make the daemon read outside the
source root or download an object it could never cache (issue 10, item 7), end to end."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from common.cachecheck import full_check
from common.daemonproc import upload, wait_cached, wait_for, wait_running, write_config
from epochcache import Cache


def _npy(value: float, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.full(shape, value, dtype=np.float32))
    return buffer.getvalue()


def test_the_daemon_quarantines_keys_outside_the_root_and_objects_too_large(
    tmp_path: Path, start_daemon: Any
) -> None:
    remote, outside = tmp_path / "remote", tmp_path / "outside"
    keys = upload(lambda prefix: f"file://{remote}", {}, "", 30, "files")
    outside.mkdir()
    secret = _npy(1234.5678, (8, 8))  # a valid .npy: format checks would not stop it
    (outside / "secret.npy").write_bytes(secret)
    os.symlink(outside / "secret.npy", remote / "link.npy")
    (remote / "big.npy").write_bytes(_npy(0.0, (1024, 1024)))  # 4 MiB: over the 2 MiB capacity
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
                          storage_options={}, capacity="2MiB", source={"manifest": "keys.csv"})
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
    from epochcache.ingest.from_config import max_sample_bytes, open_configured_source

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
