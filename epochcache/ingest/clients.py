"""The client that reads an ``s3://`` source's objects: s3fs, or obstore (``source.client``).

Reading small objects, the client's CPU per request is the limit, not the network: measured
here through 20 ms of latency, s3fs (aiobotocore) spends several times the CPU of obstore (Rust's
``object_store`` behind an fsspec adapter) on every GET (docs/benchmarks.md, "CPU per
request"). So ``source.client``:

* ``s3fs``: every request through s3fs, as always;
* ``obstore``: object reads through obstore's fsspec adapter (``pip install
  'epochcache[s3]'``); listing, manifests and everything else stay with s3fs;
* ``auto`` (the default): obstore where it is installed and it can honour the source's whole
  configuration (below), else s3fs, saying why in one log line.

One contract for both: the configuration is resolved the way botocore resolves it for s3fs
(`s3config`: the options, then the environment, the profile and its files) and handed to
obstore explicitly: the endpoint (``http://`` allowed where that is what is configured), the
region, path-style or virtual-hosted addressing, the CA bundle (``root_certificate``) or
``verify: false``, and the credentials (those in the options, else botocore's chain for the
same profile, refreshed before they expire). What obstore cannot honour: an option that is
s3fs's alone (``client_kwargs`` other than ``region_name``/``endpoint_url``/``verify``/keys,
``config_kwargs`` other than ``s3.addressing_style`` and timeouts, any other unknown option),
and FIPS, dual-stack or accelerate endpoints; ``auto`` then keeps s3fs, and ``obstore`` is a
config error naming the setting. A key obstore cannot name (`obstore_refuses_key`: ``//``,
``.`` segments, control characters) is read with s3fs under ``auto`` and refused (quarantined)
under ``obstore``.

The region: the options' ``client_kwargs.region_name``, else the bucket's own (the
``x-amz-bucket-region`` of a HEAD through s3fs, once per sampler: botocore follows a bucket
into its region, obstore signs for one), else the environment's or the profile's, else
``us-east-1``.

Timeouts are ours (``source.timeout_s``, ``connect_timeout_s``) and obstore retries nothing:
retrying is the request gate's and the sampler's job (`remote`, `requests`).
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
from urllib.parse import urlsplit

import fsspec

from ..errors import ConfigError
from .s3config import botocore_session, resolve_s3_settings

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
    """What an ``s3://`` source's configuration (`s3config`) says to obstore."""

    config: dict[str, Any]
    client_options: dict[str, Any]
    #: no credentials in the options: botocore's chain for this profile (None: AWS_PROFILE)
    botocore_credentials: bool
    region_given: bool = True  # else ask the bucket (bucket_region)
    profile: str | None = None
    #: the AWS endpoint of the region is used (it follows the region)
    aws_endpoint: bool = False

    def in_region(self, region: str) -> ObstoreSettings:
        config = {**self.config, "region": region}
        if self.aws_endpoint:
            config["endpoint"] = _aws_endpoint(region)
        return dataclasses.replace(self, config=config, region_given=True)


class _Unmappable(ValueError):
    """A setting obstore cannot honour; the message names it."""


def _aws_endpoint(region: str) -> str:
    return f"https://s3.{region}.amazonaws.com"


def _settings(options: Mapping[str, Any], bucket: str, timeout_s: float,
              connect_timeout_s: float, field: str) -> ObstoreSettings:
    """obstore's settings for ``bucket``: the options mapped, and everything botocore reads
    besides (`s3config`) given explicitly, so that obstore's own reading of the environment
    cannot disagree with s3fs's."""
    config: dict[str, Any] = {}
    client: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s),
                              "connect_timeout": datetime.timedelta(seconds=connect_timeout_s)}
    anon = False
    for name, value in options.items():
        if name in _KEYS:
            if value is not None:
                config[_KEYS[name]] = str(value)
        elif name in ("endpoint_url", "profile"):
            pass  # resolved with the rest (s3config)
        elif name == "anon":
            anon = bool(value)
        elif name == "requester_pays":
            config["request_payer"] = bool(value)
        elif name == "client_kwargs":
            for sub, subvalue in (value or {}).items():
                if sub in _KEYS:
                    config[_KEYS[sub]] = str(subvalue)
                elif sub not in ("region_name", "endpoint_url", "verify"):
                    raise _Unmappable(f"storage_options.client_kwargs.{sub}")
        elif name == "config_kwargs":
            for sub, subvalue in (value or {}).items():
                if sub == "s3" and set(subvalue or {}) <= {"addressing_style"}:
                    pass  # resolved with the rest
                elif sub not in ("connect_timeout", "read_timeout", "retries",
                                 "max_pool_connections"):
                    raise _Unmappable(f"storage_options.config_kwargs.{sub}")
        elif name not in _S3FS_ONLY:
            raise _Unmappable(f"storage_options.{name}")
    resolved = resolve_s3_settings(options, field=field)
    if resolved.botocore_only:
        raise _Unmappable(resolved.botocore_only[0])
    region = resolved.region or "us-east-1"
    config["region"] = region
    config["skip_signature"] = anon
    config.setdefault("request_payer", False)
    endpoint = resolved.endpoint_url
    virtual = resolved.virtual_hosted
    config["virtual_hosted_style_request"] = virtual
    if endpoint is None:
        # AWS's own, named: obstore would otherwise take an AWS_ENDPOINT_URL that botocore
        # was told to ignore
        config["endpoint"] = _aws_endpoint(region)
    else:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"{field}: {resolved.endpoint_from} is {endpoint!r}, not an "
                              "http(s):// URL")
        if virtual:  # obstore takes the bucket's own host (botocore adds the bucket itself)
            endpoint = parts._replace(netloc=f"{bucket}.{parts.netloc}").geturl()
        config["endpoint"] = endpoint.rstrip("/")
        client["allow_http"] = parts.scheme == "http"
    if not resolved.verify:
        client["allow_invalid_certificates"] = True
    elif resolved.ca_bundle:
        try:
            with open(os.path.expanduser(resolved.ca_bundle), "rb") as handle:
                client["root_certificate"] = handle.read()
        except OSError as exc:
            raise ConfigError(f"{field}: {resolved.ca_bundle_from} names "
                              f"{resolved.ca_bundle}, which cannot be read ({exc.strerror}); "
                              "point it at a PEM file of the CA that signs the endpoint") \
                from None
    given = "access_key_id" in config and "secret_access_key" in config
    return ObstoreSettings(config, client, botocore_credentials=not anon and not given,
                           region_given=resolved.region_from.startswith("storage_options"),
                           profile=resolved.profile, aws_endpoint=endpoint is None)


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


def resolve_client(client: str, url: str, options: Mapping[str, Any], *, field: str,
                   timeout_s: float = 30.0, connect_timeout_s: float = 5.0
                   ) -> ObstoreSettings | None:
    """The obstore settings when ``client`` (``auto``, ``s3fs``, ``obstore``) reads ``url``'s
    objects with obstore; None for s3fs (or a URL that is not ``s3://``). ``auto`` says in one
    log line why it keeps s3fs where obstore cannot honour a setting.

    Raises:
        ConfigError: ``obstore`` was asked for and is not installed, or the URL, an option or
            a setting of the environment or profile is one it cannot honour (the message
            names ``field`` and the setting); or the AWS configuration cannot be read.
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
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    try:
        return _settings(options, bucket, timeout_s, connect_timeout_s, field)
    except _Unmappable as exc:
        if client == "obstore":
            raise ConfigError(
                f"{field}: obstore cannot honour {exc} (use client: s3fs or auto, or remove "
                "it)") from None
        log.info("%s: objects are read with s3fs, not obstore: obstore cannot honour %s "
                 "(source.client: auto)", url, exc)
        return None


def obstore_refuses_key(path: str) -> str:
    """Why obstore cannot name the object at ``path`` (``bucket/key``; "" when it can).

    object_store's paths have no empty segment (a key with ``//``, or starting or ending with
    ``/``, would be read as another key or refused), no ``.`` or ``..`` segment and no control
    character; S3 keys may have all of them.
    """
    key = path.split("/", 1)[1] if "/" in path else ""
    if key.startswith("/") or key.endswith("/") or "//" in key:
        return "an empty path segment ('//', or '/' at an end)"
    if any(part in (".", "..") for part in key.split("/")):
        return "a '.' or '..' segment"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return "a control character"
    return ""


def _botocore_provider(profile: str | None) -> Callable[[], dict[str, Any]]:
    """obstore's credential provider from botocore's chain for ``profile`` (the one s3fs
    uses)."""
    session = botocore_session(profile)

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


def _credentials(settings: ObstoreSettings
                 ) -> tuple[dict[str, Any], Callable[[], dict[str, Any]] | None]:
    """The store's configuration without credentials, and its credential provider: botocore's
    chain for the settings' profile, or the credentials the options gave (passed as a provider,
    so that obstore adds nothing of the environment's, an AWS_SESSION_TOKEN, to them, as
    botocore adds nothing); None for anonymous access."""
    config = dict(settings.config)
    if settings.botocore_credentials:
        return config, _botocore_provider(settings.profile)
    if "access_key_id" in config:
        given = {"access_key_id": config.pop("access_key_id"),
                 "secret_access_key": config.pop("secret_access_key"),
                 "token": config.pop("session_token", None), "expires_at": None}
        return config, given.copy
    return config, None


def obstore_filesystem(settings: ObstoreSettings) -> fsspec.AbstractFileSystem:
    """obstore's fsspec filesystem for ``s3://`` paths (``bucket/key``), retrying nothing."""
    from obstore.fsspec import FsspecStore

    config, provider = _credentials(settings)
    # skip_instance_cache: fsspec's metaclass takes it (each source its own store)
    options: dict[str, Any] = {
        "config": config, "client_options": settings.client_options,
        "retry_config": {"max_retries": 0, "retry_timeout": settings.client_options["timeout"]},
        "credential_provider": provider, "skip_instance_cache": True}
    store: fsspec.AbstractFileSystem = FsspecStore("s3", **options)
    return store


def obstore_store(settings: ObstoreSettings, bucket: str) -> Any:
    """obstore's store of ``bucket`` for reading bodies as they arrive (`bodies`): no deadline
    on a whole request (a shard of a GB is read for minutes; the stream's deadline is on
    silence), retrying nothing."""
    from obstore.store import from_url

    config, provider = _credentials(settings)
    client = {**settings.client_options, "timeout": datetime.timedelta(days=1)}
    make: Any = from_url  # its overloads want typed dicts; ours are built from options
    return make(f"s3://{bucket}", config=config, client_options=client,
                    retry_config={"max_retries": 0, "retry_timeout": client["timeout"]},
                    credential_provider=provider)
