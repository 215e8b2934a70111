"""An ``s3://`` source's configuration as botocore resolves it, and the client that reads its
objects: s3fs, or obstore (``source.client``).

Reading small objects, the client's CPU per request is the limit, not the network: measured
here through 20 ms of latency, s3fs (aiobotocore) spends several times the CPU of obstore (Rust's
``object_store`` behind an fsspec adapter) on every GET (docs/benchmarks.md, "CPU per
request"). So ``source.client``:

* ``s3fs``: every request through s3fs, as always;
* ``obstore``: object reads through obstore's fsspec adapter (``pip install
  'epochcache[s3]'``); listing, manifests and everything else stay with s3fs;
* ``auto`` (the default): obstore where it is installed and it can honour the source's whole
  configuration (below), else s3fs, saying why in one log line.

One contract for both. s3fs hands its ``storage_options`` to botocore, which reads the rest
itself: the environment, the shared config and credentials files, the profile. obstore reads
only some of the same variables, and differently (it took ``AWS_ENDPOINT_URL=http://...`` and
then refused its scheme on every read). So the configuration is resolved here, once, the way
botocore does (`resolve_s3_settings`), and obstore is given all of it explicitly: both clients
read the same bucket, at the same endpoint, with the same credentials, or the source says at
start what obstore cannot use. Precedence, botocore's:

* **endpoint**: ``endpoint_url`` (or ``client_kwargs.endpoint_url``) in the options, else
  ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's ``services`` section (its
  ``s3`` ``endpoint_url``), the profile's ``endpoint_url``; none of those when
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` (or the profile's ``ignore_configured_endpoint_urls``)
  is true. None: AWS's own endpoint for the region (``http://`` allowed where configured).
* **region**: ``client_kwargs.region_name``, else ``AWS_DEFAULT_REGION``, the profile's
  ``region``. botocore follows a bucket into its region (a 301 names it); obstore signs for
  one, so when the options name none the sampler asks the bucket once (`bucket_region`: the
  ``x-amz-bucket-region`` of a HEAD through s3fs), else ``us-east-1``.
* **addressing**: ``config_kwargs.s3.addressing_style``, else the profile's ``s3``
  ``addressing_style``, else ``auto`` (path-style at a custom endpoint). An endpoint that is
  an IP address is always path-style (there is no host name to put the bucket in).
* **TLS**: ``client_kwargs.verify`` (False, or a CA bundle's path: obstore's
  ``root_certificate``), else ``AWS_CA_BUNDLE``, the profile's ``ca_bundle``.
* **credentials**: ``key``/``secret``/``token`` in the options, else botocore's chain for the
  profile (``profile`` in the options, else ``AWS_PROFILE``): the environment, the credentials
  and config files (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), SSO, a credential
  process, container and instance roles (refreshed for obstore before they expire).

What obstore cannot honour: an option that is s3fs's alone (``client_kwargs`` other than
``region_name``/``endpoint_url``/``verify``/keys, ``config_kwargs`` other than
``s3.addressing_style`` and timeouts, any other unknown option), and FIPS, dual-stack or
accelerate endpoints; ``auto`` then keeps s3fs, and ``obstore`` is a config error naming the
setting. A key obstore cannot name (`obstore_refuses_key`: ``//``, ``.`` segments, control
characters) is read with s3fs under ``auto`` and refused (quarantined) under ``obstore``.

Resolving sends no request; the config files are read when a source is opened. Timeouts are
ours (``source.timeout_s``, ``connect_timeout_s``) and obstore retries nothing: retrying is the
request gate's and the sampler's job (`remote`, `requests`).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import ipaddress
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

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
#: Settings botocore honours that obstore has no counterpart for (name as users write it).
_BOTOCORE_ONLY = {
    "use_fips_endpoint": "AWS_USE_FIPS_ENDPOINT (or the profile's use_fips_endpoint)",
    "use_dualstack_endpoint": "AWS_USE_DUALSTACK_ENDPOINT (or the profile's "
                              "use_dualstack_endpoint)",
}


@dataclass(frozen=True)
class S3Settings:
    """Where and how an ``s3://`` source is reached, as botocore resolves it.

    Attributes:
        endpoint_url: the endpoint (None: AWS's own for the region).
        endpoint_from: the setting that gave it ("" when none did).
        region: the region requests are signed for (None: botocore's default).
        region_from: the setting that gave it.
        addressing_style: ``auto``, ``path`` or ``virtual``, as configured.
        verify: whether TLS certificates are checked.
        ca_bundle: the CA bundle that checks them (None: the system's).
        ca_bundle_from: the setting that gave it.
        profile: the profile whose files were read (None: ``default``).
        botocore_only: settings in force that only botocore honours, named for messages.
    """

    endpoint_url: str | None
    endpoint_from: str
    region: str | None
    region_from: str
    addressing_style: str
    verify: bool
    ca_bundle: str | None
    ca_bundle_from: str
    profile: str | None
    botocore_only: tuple[str, ...] = ()

    @property
    def virtual_hosted(self) -> bool:
        """Whether the bucket goes in the host name (botocore never does so at an IP)."""
        if self.addressing_style != "virtual":
            return False
        host = urlsplit(self.endpoint_url).hostname if self.endpoint_url else None
        if host is None:
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return True
        return False


def botocore_session(profile: str | None) -> Any:
    """A botocore session for ``profile`` (None: ``AWS_PROFILE``, else ``default``), the one
    s3fs builds for the same options."""
    import botocore.session

    return botocore.session.Session(profile=profile)


def resolve_s3_settings(options: Mapping[str, Any], *, field: str = "source") -> S3Settings:
    """Resolve ``options`` (s3fs's ``storage_options``) with the environment and the profile,
    as botocore does (see the module docstring).

    Raises:
        ConfigError: the profile does not exist, or a config file cannot be read (the message
            names ``field`` and the setting).
    """
    from botocore.exceptions import BotoCoreError

    client_kwargs = dict(options.get("client_kwargs") or {})
    profile = options.get("profile")
    session = botocore_session(str(profile) if profile else None)
    try:
        scoped = session.get_scoped_config()
        endpoint, endpoint_from = _endpoint(options, client_kwargs, session, scoped)
        region, region_from = _region(client_kwargs, session)
        style = _addressing_style(options, session)
        verify, ca_bundle, ca_from = _tls(client_kwargs, session)
        only = tuple(text for name, text in _BOTOCORE_ONLY.items()
                     if _true(session.get_config_variable(name)))
        s3_section = session.get_config_variable("s3") or {}
    except BotoCoreError as exc:
        name = profile or os.environ.get("AWS_PROFILE") or "default"
        raise ConfigError(f"{field}.storage_options: the AWS configuration of profile {name!r} "
                          f"cannot be read ({exc}); check AWS_PROFILE, AWS_CONFIG_FILE and "
                          "AWS_SHARED_CREDENTIALS_FILE") from None
    for key in ("use_accelerate_endpoint", "use_dualstack_endpoint"):
        if _true(s3_section.get(key)):
            only += (f"the profile's s3 {key}",)
    s3_options = ((options.get("config_kwargs") or {}).get("s3") or {})
    only += tuple(f"config_kwargs.s3.{key}" for key in
                  ("use_accelerate_endpoint", "use_dualstack_endpoint")
                  if _true(s3_options.get(key)))
    return S3Settings(endpoint, endpoint_from, region, region_from, style, verify, ca_bundle,
                      ca_from, str(profile) if profile else session.profile, only)


def _true(value: Any) -> bool:
    return value is True or str(value).strip().lower() == "true"


def _endpoint(options: Mapping[str, Any], client_kwargs: Mapping[str, Any], session: Any,
              scoped: Mapping[str, Any]) -> tuple[str | None, str]:
    for value, name in ((options.get("endpoint_url"), "storage_options.endpoint_url"),
                        (client_kwargs.get("endpoint_url"),
                         "storage_options.client_kwargs.endpoint_url")):
        if value:
            return str(value), name
    if _true(session.get_config_variable("ignore_configured_endpoint_urls")):
        return None, ""
    from botocore.configprovider import ConfiguredEndpointProvider

    # botocore's own lookup (its order: the service variable, the global one, the profile's
    # services section, the profile): the value is what s3fs will use
    value = ConfiguredEndpointProvider(session.full_config, scoped, "s3").provide()
    if not value:
        return None, ""
    profile = session.profile or "default"
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name) == value:
            return str(value), name
    if scoped.get("endpoint_url") == value:
        return str(value), f"endpoint_url of profile {profile!r} ({_config_file()})"
    return str(value), f"the services section of profile {profile!r} ({_config_file()})"


def _config_file() -> str:
    return os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"


def _region(client_kwargs: Mapping[str, Any], session: Any) -> tuple[str | None, str]:
    if client_kwargs.get("region_name"):
        return str(client_kwargs["region_name"]), "storage_options.client_kwargs.region_name"
    region = session.get_config_variable("region")
    if not region:
        return None, ""
    if os.environ.get("AWS_DEFAULT_REGION") == region:
        return str(region), "AWS_DEFAULT_REGION"
    return str(region), f"region of profile {session.profile or 'default'!r}"


def _addressing_style(options: Mapping[str, Any], session: Any) -> str:
    s3_options = (options.get("config_kwargs") or {}).get("s3") or {}
    style = s3_options.get("addressing_style") or (
        session.get_config_variable("s3") or {}).get("addressing_style")
    return str(style or "auto")


def _tls(client_kwargs: Mapping[str, Any], session: Any) -> tuple[bool, str | None, str]:
    verify = client_kwargs.get("verify")
    if verify is False:
        return False, None, "storage_options.client_kwargs.verify"
    if isinstance(verify, str) and verify:
        return True, verify, "storage_options.client_kwargs.verify"
    bundle = session.get_config_variable("ca_bundle")
    if not bundle:
        return True, None, ""
    if os.environ.get("AWS_CA_BUNDLE") == bundle:
        return True, str(bundle), "AWS_CA_BUNDLE"
    return True, str(bundle), f"ca_bundle of profile {session.profile or 'default'!r}"


def obstore_installed() -> bool:
    return importlib.util.find_spec("obstore") is not None


@dataclass(frozen=True)
class ObstoreSettings:
    """What an ``s3://`` source's configuration (`S3Settings`) says to obstore."""

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
    besides (`resolve_s3_settings`) given explicitly, so that obstore's own reading of the environment
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
            pass  # resolved with the rest (resolve_s3_settings)
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
