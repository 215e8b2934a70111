"""The demo-data writer: both layouts, manifests that verify, learnable classes, any fsspec URL."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from epochcache.cli import build_parser
from epochcache.demo import make_samples, write_demo_data
from epochcache.ingest.layouts import SourceSpec, open_source

if TYPE_CHECKING:
    from conftest import S3Env


def test_both_layouts_on_local_disk(tmp_path: Path) -> None:
    summary = write_demo_data(f"file://{tmp_path}", samples=25, layout="both", samples_per_shard=10)
    assert summary["samples"] == 25
    files, tar = summary["layouts"]["files"], summary["layouts"]["tar"]
    assert files["keys"] == 25 and files["objects"] == 27 and tar["keys"] == 3
    assert sorted(p.name for p in (tmp_path / "tar").iterdir()) == [
        "manifest.csv",
        "manifest.jsonl",
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
    ]
    with tarfile.open(tmp_path / "tar" / "shard-000001.tar") as archive:
        assert archive.getnames()[:4] == ["000010.npy", "000010.cls", "000011.npy", "000011.cls"]
    rows = list(csv.DictReader((tmp_path / "files" / "manifest.csv").open()))
    assert [r["key"] for r in rows][:2] == ["sample-000000.npy", "sample-000001.npy"]
    data = (tmp_path / "files" / "sample-000003.npy").read_bytes()
    assert rows[3] == {
        "key": "sample-000003.npy",
        "size": str(len(data)),
        "checksum": hashlib.sha256(data).hexdigest(),
        "label": "3",
    }
    lines = [json.loads(x) for x in (tmp_path / "tar" / "manifest.jsonl").read_text().splitlines()]
    assert [x["key"] for x in lines] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]


def test_manifest_checksums_verify_through_a_source(tmp_path: Path) -> None:
    write_demo_data(f"file://{tmp_path}", samples=12, layout="tar", samples_per_shard=5)
    source = open_source(
        SourceSpec(url=f"file://{tmp_path}", layout="tar", manifest="manifest.csv")
    )
    results = source.fetch_many(source.list_keys())
    assert len(results) == 12 and all(isinstance(p, dict) for _, p in results)


def test_classes_are_learnable_and_deterministic() -> None:
    payloads, labels = make_samples(400, num_classes=4, seed=3)
    arrays = np.stack([np.load(io.BytesIO(p)) for p in payloads])
    assert arrays.dtype == np.float32 and arrays.shape == (400, 16, 16)
    assert labels[:5] == [0, 1, 2, 3, 0]
    means = np.stack([arrays[np.array(labels) == c].mean(0) for c in range(4)])
    # nearest class mean classifies far better than chance (0.25)
    distances = ((arrays[:, None] - means[None]) ** 2).sum(axis=(2, 3))
    assert (distances.argmin(1) == np.array(labels)).mean() > 0.9
    again, _ = make_samples(400, num_classes=4, seed=3)
    assert again == payloads


def test_sample_bytes_sets_object_size() -> None:
    payloads, _ = make_samples(2, sample_bytes=16 * 1024)
    assert len(payloads[0]) == 16 * 1024
    with pytest.raises(ValueError, match="sample_bytes"):
        make_samples(1, sample_bytes=10)


def test_memory_url_files_only() -> None:
    import fsspec

    summary = write_demo_data("memory://demo-test-files", samples=3, layout="files")
    fs = fsspec.filesystem("memory")
    try:
        assert fs.cat_file("/demo-test-files/sample-000002.npy")[:6] == b"\x93NUMPY"
        assert summary["layouts"]["files"]["url"] == "memory://demo-test-files"
    finally:
        fs.rm("/demo-test-files", recursive=True)


def test_s3_both_layouts(s3: S3Env) -> None:
    write_demo_data(s3.url("demo"), samples=30, layout="both", storage_options=s3.storage_options)
    files = open_source(
        SourceSpec(url=s3.url("demo/files"), pattern="*.npy", storage_options=s3.storage_options)
    )
    assert len(files.list_keys()) == 30
    tar = open_source(
        SourceSpec(url=s3.url("demo/tar"), layout="tar", storage_options=s3.storage_options)
    )
    assert sum(1 for _ in tar.fetch_many(tar.list_keys())) == 30


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="samples"):
        write_demo_data("memory://x", samples=0)
    with pytest.raises(ValueError, match="layout"):
        write_demo_data("memory://x", samples=1, layout="zip")  # type: ignore[arg-type]


def test_cli_parser_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["demo-data", f"file://{tmp_path}", "--samples", "4", "--layout", "files"]
    )
    assert args.func(args) == 0
    assert "files: 4 keys" in capsys.readouterr().out


def test_jpg_kind_writes_images_of_ten_shapes(tmp_path: Path) -> None:
    from epochcache.data.decode import AutoDecoder, decode_sample

    summary = write_demo_data(f"file://{tmp_path}", samples=23, layout="both", kind="jpg",
                              samples_per_shard=10)
    assert summary["num_classes"] == 10 and summary["layouts"]["tar"]["keys"] == 3
    with tarfile.open(tmp_path / "tar" / "shard-000002.tar") as archive:
        assert archive.getnames()[:2] == ["000020.jpg", "000020.cls"]
        assert archive.extractfile("000020.cls").read() == b"0"  # type: ignore[union-attr]
    image = decode_sample(AutoDecoder(), "sample-000007.jpg",
                          (tmp_path / "files" / "sample-000007.jpg").read_bytes())
    assert image.shape == (64, 64, 3) and image.dtype == np.uint8 and image.std() > 10
    rows = list(csv.DictReader((tmp_path / "files" / "manifest.csv").open()))
    assert rows[7]["key"] == "sample-000007.jpg" and rows[7]["label"] == "7"
    with pytest.raises(ValueError, match="kind"):
        write_demo_data(f"file://{tmp_path}/x", samples=1, kind="png")  # type: ignore[arg-type]


def _demo_data_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", "demo-data", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def test_cli_writes_to_an_s3_compatible_endpoint(s3: S3Env, tmp_path: Path) -> None:
    """``epochcache demo-data s3://...`` reached only AWS itself: a MinIO/Ceph/R2 endpoint could
    be given through an undocumented variable alone. ``--endpoint-url`` (and any storage option
    with ``--storage-option KEY=VALUE``) does it; credentials stay in the environment."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": s3.storage_options["key"],
           "AWS_SECRET_ACCESS_KEY": s3.storage_options["secret"]}
    env.pop("AWS_ENDPOINT_URL", None)
    done = _demo_data_cli(s3.url("cli"), "--samples", "20", "--layout", "tar",
                          "--samples-per-shard", "10", "--endpoint-url", s3.endpoint_url,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tar: 2 keys" in done.stdout
    tar = open_source(SourceSpec(url=s3.url("cli"), layout="tar",
                                 storage_options=s3.storage_options))
    assert sum(1 for _ in tar.fetch_many(tar.list_keys())) == 20
    done = _demo_data_cli(s3.url("opt"), "--samples", "3", "--layout", "files",
                          "--storage-option", f"endpoint_url={s3.endpoint_url}",
                          "--storage-option", "client_kwargs.region_name=us-west-2",
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    files = open_source(SourceSpec(url=s3.url("opt"), pattern="*.npy",
                                   storage_options=s3.storage_options))
    assert len(files.list_keys()) == 3
    # botocore's own variable still works, as before
    done = _demo_data_cli(s3.url("env"), "--samples", "3", "--layout", "files",
                          env={**env, "AWS_ENDPOINT_URL": s3.endpoint_url}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    bad = _demo_data_cli(s3.url("bad"), "--storage-option", "no-equals-sign", env=env,
                         cwd=tmp_path)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr, bad.stderr
