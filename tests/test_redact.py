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


def test_an_unfinished_listing_of_a_url_with_userinfo_saves_no_credential(tmp_path: Path) -> None:
    """A large HTTP source listed page by page is saved as it goes, with where to go on: the
    directories still to list were saved as full URLs, ``user:token@`` and all."""
    from epochcache.ingest.layouts import SourceSpec, open_source
    from epochcache.ingest.paging import PagedListing

    root = tmp_path / "remote"
    for part in ("a", "b", "c"):
        (root / "ds" / part).mkdir(parents=True)
        for i in range(600):
            (root / "ds" / part / f"{i:04d}.bin").write_bytes(b"x")
    cache_dir = tmp_path / "cache"
    with credential_server(root, user="reader", token=TOKEN, signature=SIGNATURE,
                           credential=CREDENTIAL) as server:
        source = open_source(SourceSpec(url=server.data_url("ds")))
        partial = PagedListing(source, cache_dir).run(until_started=True)  # the daemon's start
        assert not partial.complete and 0 < len(partial) < 1800
        saved = {path: path.read_bytes() for path in cache_dir.rglob("*") if path.is_file()}
        assert saved and not any(TOKEN.encode() in data for data in saved.values()), saved.keys()
        done = PagedListing(source, cache_dir).run()  # a restart goes on from where it stopped
    assert done.complete and len(done) == 1800
    assert {ref.key for ref in done.refs} == {f"{p}/{i:04d}.bin" for p in "abc" for i in range(600)}


ACCOUNT_KEY = "QWNjb3VudEtleS1DQU5BUlktMTIzNDU2Nzg5MA=="
SAS_SIG = "c2lnLUNBTkFSWS1zYXMtOTg3Ng%3D"
CLIENT_SECRET = "cLiEnT-sEcReT-CANARY-42"


def test_the_printed_config_holds_no_credential_whatever_option_carries_it(
    tmp_path: Path,
) -> None:
    """``epochcache config`` printed an Azure connection string with its ``AccountKey=`` in
    clear: masking worked by value, so it was hidden only when ``account_key`` was given too."""
    import os

    connection = ("DefaultEndpointsProtocol=https;AccountName=acct;"
                  f"AccountKey={ACCOUNT_KEY};EndpointSuffix=core.windows.net")
    sas = f"sv=2022-11-02&ss=b&srt=co&sp=rl&se=2026-01-01&sig={SAS_SIG}"
    data = {
        "sources": [
            {"name": "azure", "url": "az://container/train/",
             "storage_options": {"connection_string": connection, "account_name": "acct"}},
            {"name": "sas", "url": "az://container/val/",
             "storage_options": {"sas_token": sas, "account_name": "acct",
                                 "client_kwargs": {"conn_str": connection},
                                 "credentials": [{"client_secret": CLIENT_SECRET}]}},
            {"name": "gcs", "url": "gs://bucket/x/",
             "storage_options": {"token": {"type": "service_account",
                                           "private_key": CLIENT_SECRET + "-pk"}}},
        ],
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "1MiB"},
        "train": {"options": {"note": f"SharedAccessSignature={sas};BlobEndpoint=https://a",
                              "blob": f"https://acct.blob.core.windows.net/c?{sas}"}},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    done = _cli("config", "cfg.yaml", cwd=tmp_path, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    shown = done.stdout + done.stderr
    for secret in (ACCOUNT_KEY, SAS_SIG, CLIENT_SECRET):
        assert secret not in shown, shown
    assert "account_name: acct" in shown  # only what is secret is masked
    config = parse_config(data)
    shown = repr(config) + config.redacted_yaml() + repr(config.source_entries()[0].config)
    for secret in (ACCOUNT_KEY, SAS_SIG, CLIENT_SECRET):
        assert secret not in shown
    free = (f"error: cannot open container with 'AccountName=acct;AccountKey={ACCOUNT_KEY};' "
            f"and token ?{sas}")
    assert ACCOUNT_KEY not in scrub_urls(free) and SAS_SIG not in scrub_urls(free)
    assert "AccountName=acct" in scrub_urls(free)


def test_a_short_secret_is_masked_by_where_it_is_not_by_its_value(tmp_path: Path) -> None:
    """``AWS_ACCESS_KEY_ID=test`` (as local endpoints take) turned every "test" of a message
    into ``***``: paths in errors became unreadable."""
    import os

    where = tmp_path / "test_runs" / "latest"
    data = {"source": {"url": f"file://{where}/data",
                       "storage_options": {"key": "${AWS_ACCESS_KEY_ID}",
                                           "secret": "${AWS_SECRET_ACCESS_KEY}"}},
            "cache": {"dir": str(where / "cache"), "capacity": "1MiB"},
            "loader": {"decode": "rwa"}}  # an error whose message names the config file
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": API_TOKEN}
    (tmp_path / "test_runs").mkdir()
    config_path = tmp_path / "test_runs" / "cfg.yaml"
    config_path.write_text(yaml.safe_dump(data))
    refused = _cli("config", str(config_path), cwd=tmp_path, env=env)
    assert refused.returncode == 2 and str(config_path) in refused.stderr, refused.stderr
    data["loader"] = {}
    config_path.write_text(yaml.safe_dump(data))
    shown = _cli("config", str(config_path), cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    assert str(where / "cache") in shown.stdout  # "test_runs" kept whole
    assert "key: '***'" in shown.stdout and "secret: '***'" in shown.stdout
    assert API_TOKEN not in shown.stdout
    filtered = RedactingFilter({"test", API_TOKEN})._clean(f"reading {where} with {API_TOKEN}")
    assert filtered == f"reading {where} with ***"


def test_masking_a_log_line_with_a_huge_key_ends() -> None:
    """A key of 100,000 letters in a log line took 40 s to mask (the URL pattern rescanned the
    run of letters from each of its letters: quadratic, minutes at 300,000). Masking it here
    takes milliseconds; the deadline is only there to end the test if that comes back."""
    script = (
        "from epochcache.redact import RedactingFilter\n"
        "line = 'quarantined file:///data/s.tar/' + 'n' * 300_000 + ': bad ?sig=abc&x=' + "
        "'y' * 300_000\n"
        "clean = RedactingFilter({'ApI-CANARY-option-3b2a1z'})._clean(line)\n"
        "assert 'sig=***' in clean and len(clean) > 600_000\n"
    )
    try:
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("masking one log line of 600,000 characters did not end in 120 s")


def test_parameters_that_only_look_secret_stay_readable() -> None:
    """An unreachable endpoint's message showed S3's listing URL as ``...&max-keys=***&...``:
    a parameter whose name merely contains ``key`` was masked. S3's paging parameters are
    shown; credentials in the same URL are still masked."""
    url = ("http://127.0.0.1:1/my-bucket?list-type=2&prefix=train%2F&max-keys=1000"
           "&key-marker=a%2Fb&encoding-type=url&X-Amz-Signature=0123456789abcdef")
    shown = redact_url(url)
    assert "max-keys=1000" in shown and "key-marker=a%2Fb" in shown, shown
    assert "X-Amz-Signature=***" in shown and "0123456789abcdef" not in shown
    assert "max-keys=1000" in scrub_urls(f"cannot list ({url}); retrying")
    assert url_secrets(url) == {"0123456789abcdef"}
