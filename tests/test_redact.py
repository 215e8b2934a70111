"""Credentials inside URLs (userinfo, presigned signatures and tokens) never appear in logs,
status, the printed config, the cache directory, the run directory or error messages (issue 10,
item 8; invariant 9)."""

from __future__ import annotations

import gzip
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.httpserver import credential_server
from epochcache.config import EpochcacheConfig, parse_config
from epochcache.demo import write_demo_data
from epochcache.redact import RedactingFilter, redact_url, scrub_urls, url_secrets

TOKEN = "tOkEn-CANARY-userinfo-9x7q"
SIGNATURE = "SiGnAtUrE-CANARY-5d4c3b2a"
CREDENTIAL = "AKIDCANARY77/20260101/us-east-1/s3/aws4_request"
API_TOKEN = "ApI-CANARY-option-3b2a1z"


def test_redact_url_masks_userinfo_and_credential_parameters_only() -> None:
    cases = {
        "https://user:tok3n@host:8080/a/b?x=1": "https://***@host:8080/a/b?x=1",
        "https://ghp_TOKEN123@github.com/o/r.git": "https://***@github.com/o/r.git",
        "https://u:p@ss@host/x": "https://***@host/x",  # an unencoded @ in the password
        ("https://b.s3.amazonaws.com/k.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential="
         "AKID%2F20260101&X-Amz-Date=20260101T000000Z&X-Amz-Security-Token=IQoJ&X-Amz-Signature=ab12"):
            ("https://b.s3.amazonaws.com/k.csv?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
             "&X-Amz-Date=20260101T000000Z&X-Amz-Security-Token=***&X-Amz-Signature=***"),
        "https://acct.blob.core.windows.net/c/k?sv=2022-11-02&se=2026&sp=r&sig=Zm9v%3D":
            "https://acct.blob.core.windows.net/c/k?sv=2022-11-02&se=2026&sp=r&sig=***",
        "https://storage.googleapis.com/b/k?X-Goog-Signature=beef&X-Goog-Credential=sa%40p":
            "https://storage.googleapis.com/b/k?X-Goog-Signature=***&X-Goog-Credential=***",
        "https://host/api?access_token=abcd&page=2#top": "https://host/api?access_token=***&page=2#top",
        "s3://bucket/prefix/": "s3://bucket/prefix/",
        "file:///data/train": "file:///data/train",
        "/local/path?sig=not-a-url": "/local/path?sig=not-a-url",
    }
    for url, expected in cases.items():
        assert redact_url(url) == expected, url
    assert {"user:tok3n", "tok3n"} <= url_secrets("https://user:tok3n@host/")
    assert {"AKID%2F20260101", "AKID/20260101"} <= url_secrets(
        "https://h/k?X-Amz-Credential=AKID%2F20260101")
    text = "GET 'https://u:s3cret@h/x?sig=abcd' failed (HTTP 403); see s3://b/k."
    assert scrub_urls(text) == "GET 'https://***@h/x?sig=***' failed (HTTP 403); see s3://b/k."


def test_the_log_filter_masks_messages_arguments_and_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("some.library")
    handler = logging.StreamHandler(stream := __import__("io").StringIO())
    handler.addFilter(RedactingFilter({API_TOKEN}))
    logger.addHandler(handler)
    try:
        logger.warning("fetching %s with %s", f"http://u:{TOKEN}@h/x", API_TOKEN)
        try:
            raise OSError(f"cannot open http://h/k?X-Amz-Signature={SIGNATURE}")
        except OSError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    shown = stream.getvalue()
    assert "http://***@h/x with ***" in shown and "X-Amz-Signature=***" in shown
    assert TOKEN not in shown and SIGNATURE not in shown and API_TOKEN not in shown


def test_a_config_keeps_its_masks_in_another_process(tmp_path: Path) -> None:
    """Samplers got ``model_dump()`` and re-validated it: what parse_config knew to mask (here a
    ``${ENV}`` token and a URL's credentials) was forgotten. ``to_transfer`` carries it."""
    data = {
        "source": {"url": f"https://user:{TOKEN}@host/data/", "manifest":
                   f"https://host/m.csv?X-Amz-Signature={SIGNATURE}"},
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "1MiB"},
        "train": {"options": {"api_token": "${MY_API_TOKEN}"}},
    }
    config = parse_config(data, environ={"MY_API_TOKEN": API_TOKEN})
    shown = config.redacted_yaml() + repr(config) + repr(config.source)
    assert "https://***@host/data/" in shown and "X-Amz-Signature=***" in shown
    forgetful = EpochcacheConfig.model_validate(config.model_dump(mode="python"))
    assert API_TOKEN in forgetful.redacted_yaml()  # why model_validate alone is not enough
    moved = EpochcacheConfig.from_transfer(config.to_transfer())
    assert moved == config
    shown = moved.redacted_yaml() + repr(moved) + repr(moved.source)
    for secret in (TOKEN, SIGNATURE, API_TOKEN):
        assert secret not in shown
    assert {TOKEN, SIGNATURE, API_TOKEN} <= moved.secrets


def _places(root: Path, prefix: str) -> dict[str, bytes]:
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if data[:2] == b"\x1f\x8b":
                data += gzip.decompress(data)
            found[f"{prefix}/{path.relative_to(root)}"] = data
    return found


def _leaks(data: bytes) -> list[str]:
    squeezed = re.sub(rb"\s+", b"", data)
    secrets = [TOKEN, SIGNATURE, API_TOKEN, CREDENTIAL, CREDENTIAL.replace("/", "%2F")]
    return [s for s in secrets if s.encode() in data or s.encode() in squeezed]


def _cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_credentials_in_urls_leak_nowhere(tmp_path: Path) -> None:
    """A run whose source needs HTTP basic auth (userinfo) and whose manifest is a presigned
    URL: the credentials are used (the server refuses requests without them), and no log line,
    status output, printed config, file of the cache or of the run directory shows them."""
    import os

    root = tmp_path / "remote"
    write_demo_data(f"file://{root}/ds", 600, "tar", {}, samples_per_shard=100)
    (root / "ds" / "bad.tar").write_bytes(b"not a tar" * 100)  # quarantined, with its URL
    shards = sorted(p.name for p in (root / "ds").glob("shard-*.tar"))
    (root / "ds" / "shards.txt").write_text("\n".join([*shards, "bad.tar", "gone.tar"]) + "\n")
    with credential_server(root, user="reader", token=TOKEN, signature=SIGNATURE,
                           credential=CREDENTIAL) as server:
        config: dict[str, Any] = {
            "source": {"url": server.data_url("ds"), "layout": "tar",
                       "manifest": server.signed_url("ds/shards.txt"), "timeout_s": 5,
                       "retries": 1},
            "cache": {"dir": "cache", "capacity": "300KiB"},
            "sampler": {"processes": 1, "concurrency": 4},
            "loader": {"batch_size": 64, "num_workers": 0},
            "train": {"epochs": 1, "min_samples": 150, "run_dir": "run",
                      "options": {"api_token": "${MY_API_TOKEN}"}},
        }
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "COLUMNS": "1000", "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
               "MY_API_TOKEN": API_TOKEN}
        run = _cli("-v", "run", "cfg.yaml", cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
        outputs = {"run stdout": run.stdout, "run stderr": run.stderr}
        for args in (("status", "cache"), ("status", "--json", "cache"), ("config", "cfg.yaml"),
                     ("-v", "verify", "cache")):
            done = _cli(*args, cwd=tmp_path, env=env)
            assert done.returncode == 0, done.stderr
            outputs[" ".join(args)] = done.stdout + done.stderr
        # an error message that carries the URL: the source without its credentials
        config["source"]["url"] = server.data_url("ds").replace(TOKEN, TOKEN + "-wrong")
        config["source"].pop("manifest")
        config["cache"]["dir"] = "cache2"
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
        refused = _cli("run", "bad.yaml", cwd=tmp_path, env=env)
        assert refused.returncode == 2, refused.stderr
        outputs["refused run"] = refused.stdout + refused.stderr
    assert "gone.tar" in run.stderr and "bad.tar" in run.stderr  # URLs were logged, masked
    stats = json.loads(outputs["status --json cache"])
    assert stats["samples"] > 0 and stats["quarantined"] >= 1
    assert stats["daemon"]["source"] == f"http://***@127.0.0.1:{server.port}/data/ds"
    assert "X-Amz-Signature=***" in outputs["config cfg.yaml"]
    assert "http://***@127.0.0.1" in outputs["refused run"]
    places = {name: text.encode() for name, text in outputs.items()}
    places.update(_places(tmp_path / "cache", "cache"))
    places.update(_places(tmp_path / "run", "run"))
    assert {"run/config.yaml", "run/metrics.jsonl", "cache/data.mdb"} <= set(places)
    leaked = {where: _leaks(data) for where, data in places.items() if _leaks(data)}
    assert not leaked, f"credentials found in {leaked}"
