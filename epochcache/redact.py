"""Keep credentials out of everything epochcache prints or saves.

Credential values of ``storage_options`` (``key``, ``secret``, ``token``, ...) are masked as
``***`` by :func:`redact_options` wherever options could be shown, and :func:`scrub` replaces
known secret strings in any text.

URLs carry credentials too: userinfo (``https://user:token@host/...``) and the signature or token
parameters of presigned URLs (``X-Amz-Signature=``, ``X-Amz-Credential=``, ``X-Goog-Signature=``,
Azure's ``sig=``, ``token=``, ...). :func:`redact_url` masks them in one URL (``https://***@host/
...?X-Amz-Signature=***``), :func:`scrub_urls` in every URL of a text, :func:`redact_tree` in every
string of a JSON-like tree, and :class:`RedactingFilter` in every log record a handler emits
(third-party libraries log URLs too). Sources keep the real URL for fsspec and show only the
redacted one. A base module: no fsspec, no torch, nothing of epochcache.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

REDACTED = "***"
_SECRET_KEY = re.compile(r"key|secret|token|password|passwd|credential|session|auth", re.IGNORECASE)
# Keys that look secret by the rule above but are not (they name a file or a public id).
_NOT_SECRET = {"key_file", "endpoint_url", "region_name", "anon"}


def is_secret_key(name: str) -> bool:
    """Whether a storage-option key names a credential (``key``, ``secret``, ``token``, ...)."""
    return name not in _NOT_SECRET and bool(_SECRET_KEY.search(name))


def redact_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a copy of ``storage_options`` that is safe to log: credential values become ``***``.

    Nested mappings (``client_kwargs``, ``config_kwargs``) are redacted recursively.
    """
    result: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if isinstance(value, Mapping):
            result[name] = redact_options(value)
        elif is_secret_key(str(name)) and value not in (None, ""):
            result[name] = REDACTED
        else:
            result[name] = value
    return result


def secret_values(options: Mapping[str, Any] | None) -> set[str]:
    """The credential strings held in ``storage_options`` (to scrub them from any text)."""
    found: set[str] = set()
    for name, value in (options or {}).items():
        if isinstance(value, Mapping):
            found |= secret_values(value)
        elif is_secret_key(str(name)) and isinstance(value, str) and len(value) >= 4:
            found.add(value)
    return found


def scrub(text: str, secrets: set[str]) -> str:
    """Replace every occurrence of each secret in ``text`` by ``***``."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


# -- URLs --------------------------------------------------------------------------------------

#: A URL inside text: scheme://, then anything up to whitespace, quotes or brackets.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}`]+")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")  # up to the last @
#: Query parameters that carry a credential (presigned S3/GCS URLs, Azure SAS, API tokens).
_SECRET_PARAM = re.compile(
    r"sig|signature|token|secret|password|passwd|credential|key|auth|session", re.IGNORECASE)
_PARAM = re.compile(r"([?&;])([^=&;#]+)=([^&;#]*)")


def redact_url(url: str) -> str:
    """``url`` with its userinfo and credential query parameters masked as ``***``.

    Only what is masked changes; a URL without credentials is returned as it is.
    """
    if "://" not in url:
        return url
    redacted = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", url, count=1)
    if "?" in redacted or ";" in redacted:
        head, sep, tail = redacted.partition("?")
        if sep:
            redacted = head + _PARAM.sub(_mask_param, "?" + tail)[0:]
    return redacted


def _mask_param(match: re.Match[str]) -> str:
    sep, name, value = match.group(1), match.group(2), match.group(3)
    if value and _SECRET_PARAM.search(urllib.parse.unquote_plus(name)):
        return f"{sep}{name}={REDACTED}"
    return match.group(0)


def url_secrets(url: str) -> set[str]:
    """The credential strings inside ``url`` (userinfo, secret parameter values), raw and
    percent-decoded, to scrub them from any text."""
    found: set[str] = set()
    if "://" not in url:
        return found
    userinfo = _USERINFO.match(url)
    if userinfo and userinfo.group(2):
        raw = userinfo.group(2)
        found |= {raw, urllib.parse.unquote(raw)}
        _user, colon, password = raw.partition(":")
        if colon and password:
            found |= {password, urllib.parse.unquote(password)}
    _, sep, tail = url.partition("?")
    if sep:
        for match in _PARAM.finditer("?" + tail):
            name, value = match.group(2), match.group(3)
            if value and _SECRET_PARAM.search(urllib.parse.unquote_plus(name)):
                found |= {value, urllib.parse.unquote_plus(value)}
    return {value for value in found if len(value) >= 4}


def scrub_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url`."""
    if "://" not in text:
        return text
    return _URL.sub(lambda m: redact_url(m.group(0)), text)


def redact_tree(value: Any, secrets: set[str] | None = None) -> Any:
    """A copy of a JSON-like tree with URL credentials (and ``secrets``) masked in every string."""
    if isinstance(value, str):
        text = scrub_urls(value)
        return scrub(text, secrets) if secrets else text
    if isinstance(value, Mapping):
        return {k: redact_tree(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_tree(v, secrets) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """A handler filter that masks URL credentials (and ``secrets``) in every record, its
    arguments and its traceback, whichever library logged it."""

    def __init__(self, secrets: set[str] | None = None) -> None:
        super().__init__()
        self.secrets = set(secrets or ())

    def _clean(self, text: str) -> str:
        text = scrub_urls(text)
        return scrub(text, self.secrets) if self.secrets else text

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is the logging module's to report
            return True
        clean = self._clean(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self._clean(record.exc_text)
        return True


def install_log_redaction(logger: logging.Logger | None = None,
                          secrets: set[str] | None = None) -> None:
    """Add a :class:`RedactingFilter` to every handler of ``logger`` (default: the root)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter(secrets))
