"""The client that reads an ``s3://`` source's objects: s3fs, or obstore (``source.client``).

Reading small objects, the client's CPU per request is the limit, not the network: measured
here through 20 ms of latency, s3fs (aiobotocore) spends several times the CPU of obstore (Rust's
``object_store`` behind an fsspec adapter) on every GET (docs/benchmarks.md, "CPU per
request"). So ``source.client``:

* ``s3fs``: every request through s3fs, as always;
* ``obstore``: object reads through obstore's fsspec adapter (``pip install
  'epochcache[s3]'``); listing, manifests and everything else stay with s3fs;
* ``auto`` (the default): obstore where it is installed and the source's ``storage_options``
  map onto it (below), else s3fs.

Both take the same ``s3://`` URLs and ``storage_options`` (s3fs's names): ``key``/``secret``/
``token`` (or ``aws_*`` spellings), ``endpoint_url``, ``anon``, ``requester_pays``,
``client_kwargs: {region_name, endpoint_url}`` and ``config_kwargs: {s3: {addressing_style}}``;
options that only tune s3fs's own caches or threads are ignored. Any other option (``profile``
included) is s3fs's alone: ``auto`` then keeps s3fs, and ``obstore`` is a config error naming it.
Without credentials in the options (and not ``anon``), obstore asks botocore's credential chain,
the one s3fs uses (environment, ``~/.aws``, SSO, instance roles), refreshed before they
expire. The region comes from the options (``client_kwargs.region_name``), else from the
bucket itself (the ``x-amz-bucket-region`` of a HEAD through s3fs, once per sampler: s3fs
follows a bucket into its region on its own, obstore signs for one), else ``AWS_REGION``/
``AWS_DEFAULT_REGION`` or botocore's configuration, else ``us-east-1``.

Timeouts are ours (``source.timeout_s``, ``connect_timeout_s``) and obstore retries nothing:
retrying is the request gate's and the sampler's job (`remote`, `gate`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from ..errors import ConfigError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'epochcache[s3]' (or obstore)"
#: s3fs options that tune only s3fs (its caches, threads, retries): no meaning for obstore.
_S3FS_ONLY = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                        "max_concurrency", "default_block_size", "default_fill_cache",
                        "default_cache_type", "cache_regions", "asynchronous", "loop",
                        "max_paths", "retries", "fixed_upload_size", "use_ssl", "version_aware",
                        "s3_additional_kwargs", "session"})
_KEYS = {"key": "access_key_id", "aws_access_key_id": "access_key_id",
         "secret": "secret_access_key", "aws_secret_access_key": "secret_access_key",
         "token": "session_token", "aws_session_token": "session_token"}
#: botocore credentials are asked again this long before they expire (or this often).
_REFRESH = datetime.timedelta(minutes=5)


def obstore_installed() -> bool:
    return importlib.util.find_spec("obstore") is not None


@dataclass(frozen=True)
class ObstoreSettings:
    """What an ``s3://`` source's options say to obstore."""

    config: dict[str, Any]
    client_options: dict[str, Any]
    botocore_credentials: bool  # no credentials given: ask botocore's chain
    region_given: bool = True  # else ask the bucket (bucket_region)

    def in_region(self, region: str) -> ObstoreSettings:
        return dataclasses.replace(self, config={**self.config, "region": region},
                                   region_given=True)


class _Unmappable(ValueError):
    """An option obstore cannot take; the message names it."""


def _settings(options: Mapping[str, Any], timeout_s: float,
              connect_timeout_s: float) -> ObstoreSettings:
    config: dict[str, Any] = {}
    client: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s),
                              "connect_timeout": datetime.timedelta(seconds=connect_timeout_s)}
    anon = False
    for name, value in options.items():
        if name in _KEYS:
            if value is not None:
                config[_KEYS[name]] = str(value)
        elif name == "endpoint_url":
            if value:
                config["endpoint"] = str(value)
        elif name == "anon":
            anon = bool(value)
        elif name == "requester_pays":
            if value:
                config["request_payer"] = True
        elif name == "client_kwargs":
            for sub, subvalue in (value or {}).items():
                if sub == "region_name":
                    config["region"] = str(subvalue)
                elif sub == "endpoint_url":
                    config["endpoint"] = str(subvalue)
                elif sub in _KEYS:
                    config[_KEYS[sub]] = str(subvalue)
                else:
                    raise _Unmappable(f"client_kwargs.{sub}")
        elif name == "config_kwargs":
            for sub, subvalue in (value or {}).items():
                if sub == "s3" and set(subvalue or {}) <= {"addressing_style"}:
                    style = (subvalue or {}).get("addressing_style")
                    if style == "virtual":
                        config["virtual_hosted_style_request"] = True
                elif sub not in ("connect_timeout", "read_timeout", "retries",
                                 "max_pool_connections"):
                    raise _Unmappable(f"config_kwargs.{sub}")
        elif name not in _S3FS_ONLY:
            raise _Unmappable(name)
    if anon:
        config["skip_signature"] = True
    if str(config.get("endpoint", "")).startswith("http://"):
        client["allow_http"] = True
    region_given = "region" in config
    if not region_given:
        config["region"] = _default_region()
    given = "access_key_id" in config and "secret_access_key" in config
    return ObstoreSettings(config, client, botocore_credentials=not anon and not given,
                           region_given=region_given)


def bucket_region(fs: Any, bucket: str, timeout_s: float) -> str | None:
    """The region a bucket lives in, from s3fs's HEAD of it (None when it does not say)."""
    from fsspec.asyn import sync

    response: Any = None
    try:
        response = sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a 301 from another region carries it too
        error: BaseException | None = exc
        while error is not None and response is None:
            response = getattr(error, "response", None)
            error = error.__cause__
    headers = ((response or {}).get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    region = headers.get("x-amz-bucket-region")
    return str(region) if region else None


def _default_region() -> str:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        return region
    try:
        import botocore.session

        region = botocore.session.get_session().get_config_variable("region")
    except Exception:  # noqa: BLE001 - no botocore, or a broken ~/.aws/config: the default
        region = None
    return str(region or "us-east-1")


def resolve_client(client: str, url: str, options: Mapping[str, Any], *, field: str,
                   timeout_s: float = 30.0, connect_timeout_s: float = 5.0
                   ) -> ObstoreSettings | None:
    """The obstore settings when ``client`` (``auto``, ``s3fs``, ``obstore``) reads ``url``'s
    objects with obstore; None for s3fs (or a URL that is not ``s3://``).

    Raises:
        ConfigError: ``obstore`` was asked for and is not installed, or the URL or an option
            is one it cannot take (the message names ``field`` and the option).
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if client == "s3fs" or (client == "auto" and protocol not in ("s3", "s3a")):
        return None
    if client == "obstore" and protocol not in ("s3", "s3a"):
        raise ConfigError(f"{field}: obstore reads s3:// sources here, not {protocol}:// "
                          "(use client: s3fs or auto)")
    if not obstore_installed():
        if client == "obstore":
            raise ConfigError(f"{field}: obstore is not installed: {INSTALL_HINT}, or use "
                              "client: s3fs")
        return None
    try:
        return _settings(options, timeout_s, connect_timeout_s)
    except _Unmappable as exc:
        if client == "obstore":
            raise ConfigError(
                f"{field}: storage_options.{exc} is an s3fs option obstore cannot take (use "
                "client: s3fs, or remove it)") from None
        log.info("%s: storage_options.%s is s3fs's alone: objects are read with s3fs", url, exc)
        return None


def _botocore_provider() -> Callable[[], dict[str, Any]]:
    """obstore's credential provider from botocore's chain (the one s3fs uses)."""
    import botocore.session

    session = botocore.session.get_session()

    def credentials() -> dict[str, Any]:
        found = session.get_credentials()
        if found is None:
            raise PermissionError("no AWS credentials found (environment, ~/.aws, instance "
                                  "role): set them, or key/secret or anon in storage_options")
        frozen = found.get_frozen_credentials()
        expires = datetime.datetime.now(datetime.timezone.utc) + _REFRESH
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expires}

    return credentials


def obstore_filesystem(settings: ObstoreSettings) -> fsspec.AbstractFileSystem:
    """obstore's fsspec filesystem for ``s3://`` paths (``bucket/key``), retrying nothing."""
    from obstore.fsspec import FsspecStore

    provider = _botocore_provider() if settings.botocore_credentials else None
    # skip_instance_cache: fsspec's metaclass takes it (each source its own store)
    options: dict[str, Any] = {
        "config": settings.config, "client_options": settings.client_options,
        "retry_config": {"max_retries": 0, "retry_timeout": settings.client_options["timeout"]},
        "credential_provider": provider, "skip_instance_cache": True}
    store: fsspec.AbstractFileSystem = FsspecStore("s3", **options)
    return store


def obstore_store(settings: ObstoreSettings, bucket: str) -> Any:
    """obstore's store of ``bucket`` for reading bodies as they arrive (`bodies`): no deadline
    on a whole request (a shard of a GB is read for minutes; the stream's deadline is on
    silence), retrying nothing."""
    from obstore.store import from_url

    provider = _botocore_provider() if settings.botocore_credentials else None
    client = {**settings.client_options, "timeout": datetime.timedelta(days=1)}
    make: Any = from_url  # its overloads want typed dicts; ours are built from options
    return make(f"s3://{bucket}", config=settings.config, client_options=client,
                    retry_config={"max_retries": 0, "retry_timeout": client["timeout"]},
                    credential_provider=provider)
