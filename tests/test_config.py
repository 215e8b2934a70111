"""The config model: defaults, validation errors that name the field, env interpolation, redaction."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from epochcache.config import EpochcacheConfig, load_config, parse_config
from epochcache.errors import ConfigError

MINIMAL = {
    "source": {"url": "s3://bucket/train/"},
    "cache": {"dir": "/tmp/cache", "capacity": "200GiB"},
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_minimal_config_gets_defaults(tmp_path: Path) -> None:
    config = load_config(
        write(
            tmp_path,
            """
        source: {url: "s3://bucket/train/"}
        cache: {dir: /tmp/cache, capacity: 200GiB}
    """,
        )
    )
    assert isinstance(config, EpochcacheConfig)
    assert config.cache.capacity == 200 * 2**30
    assert config.cache.headroom_bytes == int(200 * 2**30 * 0.1)
    assert config.source.layout == "files" and config.source.effective_pattern == "**"
    assert config.sampler.processes == 2 and config.sampler.concurrency == "auto"
    assert config.source.timeout_s == 30.0 and config.source.retries == 5
    assert config.loader.batch_size == 64 and config.loader.allow_pickle is False
    assert config.train.entrypoint == "epochcache.examples:train_epoch"
    assert config.origin.endswith("config.yaml")


def test_sizes_durations_and_headroom_forms() -> None:
    config = parse_config(
        {
            "source": {"url": "memory://x", "timeout_s": "2m", "layout": "tar"},
            "cache": {"dir": "c", "capacity": 10_000, "headroom": "500"},
            "sampler": {"bandwidth_limit": "100MB/s"},
        }
    )
    assert config.source.timeout_s == 120.0 and config.source.effective_pattern == "**/*.tar"
    assert config.cache.headroom_bytes == 500
    assert config.sampler.bandwidth_limit == 100_000_000
    assert (
        parse_config(
            {**MINIMAL, "cache": {"dir": "c", "capacity": "1GB", "headroom": "5%"}}
        ).cache.headroom_bytes
        == 50_000_000
    )


@pytest.mark.parametrize(
    ("data", "path", "fragment"),
    [
        (
            {**MINIMAL, "cache": {"dir": "c", "capacity": "1GB", "colour": "red"}},
            "cache.colour",
            "unknown key",
        ),
        ({**MINIMAL, "sampler": {"processes": "many"}}, "sampler.processes", "'many'"),
        # Keys nothing read were removed, not accepted and ignored (source.timeout_s/retries
        # are the remote settings).
        ({**MINIMAL, "sampler": {"timeout_s": 5}}, "sampler.timeout_s", "unknown key"),
        ({**MINIMAL, "sampler": {"max_retries": 3}}, "sampler.max_retries", "unknown key"),
        ({**MINIMAL, "cache": {"dir": "c", "capacity": "-5GiB"}}, "cache.capacity", "-5GiB"),
        ({**MINIMAL, "cache": {"dir": "c", "capacity": -5}}, "cache.capacity", "negative"),
        ({**MINIMAL, "cache": {"dir": "c", "capacity": "12 parsecs"}}, "cache.capacity", "unit"),
        ({**MINIMAL, "cache": {"dir": "c"}}, "cache.capacity", "missing"),
        ({**MINIMAL, "source": {"url": "x", "layout": "zip"}}, "source.layout", "got 'zip'"),
        (
            {**MINIMAL, "train": {"entrypoint": "nocolon"}},
            "train.entrypoint",
            "package.module:function",
        ),
        ({**MINIMAL, "sampler": {"node_rank": 2, "num_nodes": 2}}, "sampler", "node_rank 2"),
        # A DataLoader timeout needs workers, whatever the device (issue 26, item 8).
        ({**MINIMAL, "loader": {"timeout": "30s"}}, "loader.timeout", "num_workers > 0"),
        ({**MINIMAL, "loader": {"timeout": 30, "num_workers": 0}}, "loader.timeout",
         "num_workers > 0"),
        ({**MINIMAL, "sampler": {"concurrency": 0}}, "sampler.concurrency",
         "expected auto, or a number of requests in flight from 1 to 1024, got 0"),
        ({**MINIMAL, "sampler": {"concurrency": "fast"}}, "sampler.concurrency", "'fast'"),
        ({**MINIMAL, "sampler": {"max_requests_per_s": 0}}, "sampler.max_requests_per_s",
         "greater than 0"),
        ({**MINIMAL, "source": {"url": "x", "client": "boto"}}, "source.client",
         "'auto', 's3fs' or 'obstore'"),
        ({**MINIMAL, "bogus": {}}, "bogus", "allowed: cache, daemon, loader, sampler, source, sources, train"),
        ({**MINIMAL, "train": {"resume": "sometimes"}}, "train.resume",
         "expected true, false or auto, got 'sometimes'"),
    ],
)
def test_errors_name_field_value_and_what_is_allowed(data: dict, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    message = str(info.value)
    assert f"{path}:" in message and fragment in message
    assert "\n" not in message  # one paragraph



def test_layout_choices_are_the_registrys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layout names live in `epochcache.registry` only (issue 36): the config accepts each,
    its error lists them all, and a layout whose library is missing is a config error naming
    the extra that installs it."""
    from dataclasses import replace

    from epochcache import registry

    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, "source": {"url": "x", "layout": "zip"}})
    for name in registry.LAYOUTS:
        assert f"'{name}'" in str(info.value)
        assert parse_config({**MINIMAL, "source": {"url": "x", "layout": name}}).source.layout \
            == name
    assert parse_config({**MINIMAL, "source": {"url": "x", "layout": "tar"}}
                        ).source.effective_pattern == registry.LAYOUTS["tar"].pattern
    monkeypatch.setitem(registry.LAYOUTS, "tar", replace(
        registry.LAYOUTS["tar"], requires="epochcache_no_such_module", extra="tarx"))
    with pytest.raises(ConfigError) as info:
        parse_config({**MINIMAL, "source": {"url": "x", "layout": "tar"}})
    assert "source.layout: layout tar needs epochcache_no_such_module" in str(info.value)
    assert "pip install 'epochcache[tarx]'" in str(info.value)

def test_config_error_is_a_value_error_and_not_a_pydantic_error() -> None:
    with pytest.raises(ValueError) as info:
        parse_config({"source": {}, "cache": {}})
    assert info.value.__cause__ is None and "source.url: required" in str(info.value)


def test_yaml_and_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_config(write(tmp_path, "source:\n  url: a: b\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- a list\n"))


def test_env_interpolation_with_defaults_and_escape(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        source: {url: "s3://${BUCKET}/train", pattern: "$${literal}"}
        cache: {dir: "${CACHE_DIR:-/tmp/default}", capacity: "${CAPACITY}"}
        sampler: {processes: "${PROCS}"}
    """,
    )
    config = load_config(path, environ={"BUCKET": "b1", "CAPACITY": "2GiB", "PROCS": "3"})
    assert config.source.url == "s3://b1/train" and config.source.pattern == "${literal}"
    assert str(config.cache.dir) == "/tmp/default"
    assert config.cache.capacity == 2 * 2**30 and config.sampler.processes == 3


def test_missing_env_var_names_field_and_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPOCHCACHE_TEST_UNSET", raising=False)
    path = write(
        tmp_path,
        """
        source: {url: "s3://b/", storage_options: {secret: "${EPOCHCACHE_TEST_UNSET}"}}
        cache: {dir: c, capacity: 1GB}
    """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "source.storage_options.secret" in str(info.value)
    assert "EPOCHCACHE_TEST_UNSET" in str(info.value)


def test_env_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(
        tmp_path, 'source: {url: "${EPOCHCACHE_TEST_URL}"}\ncache: {dir: c, capacity: 1GB}\n'
    )
    monkeypatch.setenv("EPOCHCACHE_TEST_URL", "memory://one")
    assert load_config(path).source.url == "memory://one"
    monkeypatch.setenv("EPOCHCACHE_TEST_URL", "memory://two")
    assert load_config(path).source.url == "memory://two"


SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLE"
TOKEN = "tok-4f1e2d3c"


def secret_config(tmp_path: Path) -> EpochcacheConfig:
    path = write(
        tmp_path,
        """
        source:
          url: "s3://bucket/train/"
          storage_options:
            key: AKIAPLAINTEXTKEY
            secret: "${MY_AWS_SECRET}"
            endpoint_url: "http://127.0.0.1:9"
            client_kwargs: {region_name: us-west-2, aws_session_token: "${SESSION_TOKEN}"}
        cache: {dir: /tmp/c, capacity: 1GB}
        train: {options: {api: "${API_TOKEN}", lr: 0.1}}
    """,
    )
    return load_config(
        path, environ={"MY_AWS_SECRET": SECRET, "SESSION_TOKEN": TOKEN, "API_TOKEN": "api-123456"}
    )


def test_secrets_never_in_repr_str_or_redacted_dump(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = secret_config(tmp_path)
    assert config.source.storage_options["secret"] == SECRET  # the real value reaches fsspec
    caplog.set_level(logging.DEBUG)
    logging.getLogger("test").info("config %s / %r / %s", config, config, config.source)
    texts = [
        repr(config),
        str(config),
        repr(config.source),
        str(config.source),
        config.redacted_yaml(),
        str(config.redacted()),
        caplog.text,
    ]
    for text in texts:
        for secret in (SECRET, TOKEN, "AKIAPLAINTEXTKEY", "api-123456"):
            assert secret not in text
    redacted = config.redacted()
    assert redacted["source"]["storage_options"]["secret"] == "***"
    assert redacted["source"]["storage_options"]["client_kwargs"]["aws_session_token"] == "***"
    assert redacted["source"]["storage_options"]["endpoint_url"] == "http://127.0.0.1:9"
    assert redacted["train"]["options"] == {"api": "***", "lr": 0.1}


def test_secret_values_masked_in_validation_errors(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        source: {url: "s3://b/", storage_options: {secret: "${MY_SECRET}"}, timeout_s: "${MY_TOKEN}"}
        cache: {dir: c, capacity: 1GB}
    """,
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={"MY_SECRET": SECRET, "MY_TOKEN": "not-a-duration-secret"})
    message = str(info.value)
    assert "source.timeout_s" in message
    assert SECRET not in message and "not-a-duration-secret" not in message


def test_node_from_torchrun_environment() -> None:
    config = parse_config(MINIMAL)
    assert config.sampler.node({}) == (0, 1)
    assert config.sampler.node({"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3"}) == (1, 3)
    assert config.sampler.node({"GROUP_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == (
        1,
        2,
    )
    with pytest.raises(ConfigError, match="node_rank"):
        config.sampler.node({"GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"})
    explicit = parse_config({**MINIMAL, "sampler": {"node_rank": 0, "num_nodes": 4}})
    assert explicit.sampler.node({"GROUP_RANK": "3"}) == (0, 4)


def test_parquet_manifest_needs_pyarrow(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed (find_spec: None)
    with pytest.raises(ConfigError, match="pyarrow"):
        parse_config({**MINIMAL, "source": {"url": "x", "manifest": "keys.parquet"}})


def test_config_pickles_for_spawned_samplers(tmp_path: Path) -> None:
    import pickle

    config = secret_config(tmp_path)
    clone = pickle.loads(pickle.dumps(config))
    assert clone.source.storage_options["secret"] == SECRET
    assert SECRET not in repr(clone)


def test_cache_sync_defaults_on_and_is_validated(tmp_path: Path) -> None:
    base = {"source": {"url": "memory://x"}, "cache": {"dir": str(tmp_path / "c"), "capacity": "1MiB"}}
    assert parse_config(base).cache.sync is True
    off = parse_config({**base, "cache": {**base["cache"], "sync": False}})
    assert off.cache.sync is False
    with pytest.raises(ConfigError, match="cache.sync"):
        parse_config({**base, "cache": {**base["cache"], "sync": "sometimes"}})


SOURCES = {
    "sources": [
        {"name": "web", "url": "s3://b/web/", "weight": 3, "storage_options": {"secret": "s3cr3t-web"}},
        {"name": "books", "url": "file:///data/books", "optional": True},
    ],
    "cache": {"dir": "/tmp/cache", "capacity": "1GiB"},
}


def test_sources_list_with_names_weights_and_optional() -> None:
    config = parse_config(SOURCES)
    assert config.source is None
    entries = config.source_entries()
    assert [(e.name, e.weight, e.optional, e.key_prefix) for e in entries] == [
        ("web", 3.0, False, "web/"), ("books", 1.0, True, "books/")]
    assert entries[1].config.timeout_s == 30.0  # the fields of source, with their defaults
    single = parse_config(MINIMAL).source_entries()
    assert [(e.name, e.key_prefix) for e in single] == [("", "")]  # keys stay un-namespaced
    assert "s3cr3t-web" not in repr(config) and "s3cr3t-web" not in config.redacted_yaml()
    assert "sources" in config.redacted() and "source" not in config.redacted()


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"source": {"url": "s3://x/"}}, "exactly one of source"),  # both
        ({"sources": None}, "exactly one of source"),  # neither
        ({"sources": []}, "sources: List should have at least 1 item"),
        ({"sources": [{"name": "a/b", "url": "s3://x/"}]}, "sources.0.name: expected 1-64"),
        ({"sources": [{"url": "s3://x/"}]}, "sources.0.name: required but missing"),
        ({"sources": [{"name": "a", "url": "s3://x/", "weight": 0}]}, "sources.0.weight"),
        ({"sources": [{"name": "a", "url": "s3://x/"}, {"name": "a", "url": "s3://y/"}]},
         "names must be unique, a appear"),
        ({"sources": [{"name": "a", "url": "s3://x/", "bogus": 1}]},
         "sources.0.bogus: unknown key (allowed: checks,"),
    ],
)
def test_sources_errors_name_the_field(change: dict, fragment: str) -> None:
    data = {**SOURCES, **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert fragment in str(info.value)
    assert "s3cr3t-web" not in str(info.value)


def test_config_travels_to_another_process_with_its_secrets_masked() -> None:
    from epochcache.config import EpochcacheConfig

    config = parse_config(SOURCES)
    clone = EpochcacheConfig.from_transfer(config.to_transfer())
    assert clone == config
    assert clone.sources is not None and clone.sources[0].storage_options["secret"] == "s3cr3t-web"
    assert "s3cr3t-web" not in repr(clone) and "s3cr3t-web" not in repr(clone.sources[0])


def test_loader_fields_and_image() -> None:
    config = parse_config({**MINIMAL, "loader": {"fields": ["jpg;png", "cls"], "image": "torch"}})
    assert config.loader.fields == ["jpg;png", "cls"] and config.loader.image == "torch"
    assert parse_config({**MINIMAL, "loader": {"fields": "jpg;png cls"}}).loader.fields == [
        "jpg;png", "cls"]
    assert parse_config(MINIMAL).loader.fields is None
    for loader, field in (({"image": "tensor"}, "loader.image"), ({"fields": []}, "loader.fields"),
                          ({"fields": ["jpg", ";"]}, "loader.fields")):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            parse_config({**MINIMAL, "loader": loader})
