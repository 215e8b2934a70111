"""An ``s3://`` source's configuration as botocore resolves it: one answer for both clients.

s3fs hands its ``storage_options`` to botocore, which reads the rest itself: the environment,
the shared config and credentials files, the profile. obstore reads only some of the same
variables, and differently (it took ``AWS_ENDPOINT_URL=http://...`` and then refused its
scheme on every read). So the configuration is resolved here, once, the way botocore does,
and obstore is given all of it explicitly (`clients`): both clients read the same bucket, at
the same endpoint, with the same credentials, or the source says at start what obstore cannot
use. Precedence, botocore's:

* **endpoint**: ``endpoint_url`` (or ``client_kwargs.endpoint_url``) in the options, else
  ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the profile's ``services`` section (its
  ``s3`` ``endpoint_url``), the profile's ``endpoint_url``; none of those when
  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS`` (or the profile's ``ignore_configured_endpoint_urls``)
  is true. None: AWS's own endpoint for the region.
* **region**: ``client_kwargs.region_name``, else ``AWS_DEFAULT_REGION``, the profile's
  ``region``. botocore follows a bucket into its region (a 301 names it); for obstore the
  sampler asks the bucket once when the options name no region (`clients.bucket_region`).
* **addressing**: ``config_kwargs.s3.addressing_style``, else the profile's ``s3``
  ``addressing_style``, else ``auto`` (path-style at a custom endpoint). An endpoint that is
  an IP address is always path-style (there is no host name to put the bucket in).
* **TLS**: ``client_kwargs.verify`` (False, or a CA bundle's path), else ``AWS_CA_BUNDLE``,
  the profile's ``ca_bundle``.
* **credentials**: ``key``/``secret``/``token`` in the options, else botocore's chain for the
  profile (``profile`` in the options, else ``AWS_PROFILE``): the environment, the credentials
  and config files (``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), SSO, a credential
  process, container and instance roles.

Nothing here sends a request; the config files are read when a source is opened.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError

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
