"""Keep credentials out of everything epochcache prints or saves.

Credentials are masked as ``***`` *by structure*, wherever they sit, whatever their value:

* ``storage_options`` values under a credential-like name (``key``, ``secret``, ``token``,
  ``password``, ``session_token``, ``account_key``, ``sas_token``, ``connection_string``,
  ``client_secret``, ...), in nested mappings and lists too (`redact_options`);
* URLs: userinfo (``https://user:token@host/...``) and the signature or token parameters of
  presigned URLs (``X-Amz-Signature=``, ``X-Amz-Credential=``, ``X-Goog-Signature=``, Azure's
  ``sig=``, ``token=``, ...): `redact_url` masks them in one URL (``https://***@host/
  ...?X-Amz-Signature=***``);
* text that is not a URL: the fields of connection strings (``AccountKey=``,
  ``SharedAccessSignature=``, ``SharedAccessKey=``) and credential parameters of a SAS token
  or query string (``sig=``, ``X-Amz-Signature=``, ``token=``, ...).

`scrub_urls` masks all of these in any text, `redact_tree` in every string of a
JSON-like tree, and `RedactingFilter` in every log record a handler emits (third-party
libraries log URLs too). Sources keep the real URL for fsspec and show only the redacted one.

A secret known only by its value (a ``${AWS_SECRET_ACCESS_KEY}`` interpolated into a config) is
also replaced wherever it occurs (`scrub`), but only when it is at least
`MIN_SCRUB_CHARS` long: masking a short value by value garbles unrelated text (a key id
``test`` turned ``/tmp/pytest-1/test_x`` into ``/tmp/py***-1/***_x``); short ones are masked
by structure only. Every pattern here is linear in the text (a log line may carry a key of
megabytes). A base module: no fsspec, no torch, nothing of epochcache.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any

REDACTED = "***"
#: Secrets known only by value are scrubbed from text when at least this long (see above).
MIN_SCRUB_CHARS = 8
_SECRET_KEY = re.compile(
    r"key|secret|token|password|passwd|credential|session|auth|connection_?str|conn_?str|sas"
    r"|signature|(?:^|_)sig(?:$|_)", re.IGNORECASE)
# Keys that look secret by the rule above but are not (they name a file, a setting or a public id).
_NOT_SECRET = {"key_file", "endpoint_url", "region_name", "anon", "signature_version"}


def is_secret_key(name: str) -> bool:
    """Whether a storage-option key names a credential (``key``, ``secret``, ``token``, ...)."""
    return name not in _NOT_SECRET and bool(_SECRET_KEY.search(name))


def redact_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a copy of ``storage_options`` that is safe to log: credential values become ``***``.

    A value under a credential-like name is masked whole, whatever it holds (a string, or the
    mapping of a service account's JSON). Other nested mappings (``client_kwargs``,
    ``config_kwargs``) and lists are redacted recursively, and credentials inside their strings
    (a URL's userinfo, a connection string's ``AccountKey=``) are masked by `scrub_urls`.
    """
    return {name: REDACTED if is_secret_key(str(name)) and _holds_value(value)
            else _redact_value(value) for name, value in (options or {}).items()}


def _holds_value(value: Any) -> bool:
    """Whether a value under a credential-like name could be a credential (``None``, ``""``,
    flags and numbers are shown: ``anon: true``, ``use_listings_cache: false``)."""
    return value not in (None, "") and not isinstance(value, (bool, int, float))


def _redact_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return redact_options(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_redact_value(item) for item in value)
    if isinstance(value, str):
        return scrub_urls(value)
    return value


def strings_in(value: Any) -> Iterator[str]:
    """Every string in ``value``, itself one or inside nested mappings (their values), lists
    and tuples."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from strings_in(item)


def secret_values(options: Any) -> set[str]:
    """The credential strings held in ``storage_options`` (to scrub them from any text): every
    string under a credential-like name, in nested mappings and lists too."""
    found: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            for name, item in value.items():
                if is_secret_key(str(name)):
                    found.update(text for text in strings_in(item) if len(text) >= 4)
                else:
                    visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(options)
    return found


def scrub(text: str, secrets: set[str] | frozenset[str]) -> str:
    """Replace every occurrence of each secret of at least `MIN_SCRUB_CHARS` characters
    in ``text`` by ``***`` (shorter ones are masked by structure only: see the module)."""
    for value in sorted(secrets, key=len, reverse=True):
        if len(value) >= MIN_SCRUB_CHARS:
            text = text.replace(value, REDACTED)
    return text


# -- URLs --------------------------------------------------------------------------------------

#: A URL inside text: scheme://, then anything up to whitespace, quotes or brackets. The
#: scheme's length is bounded: unbounded, every letter of a long run (a key of 100,000 letters
#: in a log line) started a scan to the run's end, quadratic (40 s for that one line).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"<>()\[\]{}`]+")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*)@")  # up to the last @
#: Query parameters that carry a credential (presigned S3/GCS URLs, Azure SAS, API tokens).
_SECRET_PARAM = re.compile(
    r"sig|signature|token|secret|password|passwd|credential|key|auth|session", re.IGNORECASE)
_PARAM = re.compile(r"([?&;])([^=&;#]+)=([^&;#]*)")
#: Parameters whose names match the pattern above but carry no credential: S3's paging (an
#: unreachable endpoint's message shows the listing URL; ``max-keys=***`` hid the page size).
_PLAIN_PARAMS = frozenset({"max-keys", "key-marker", "version-id-marker", "upload-id-marker"})


def _secret_param(name: str) -> bool:
    """Whether a query parameter's name says its value is a credential."""
    name = urllib.parse.unquote_plus(name)
    return name.lower() not in _PLAIN_PARAMS and bool(_SECRET_PARAM.search(name))
#: Credentials outside URLs: the fields of Azure connection strings (their value runs to the
#: next ``;``: a SharedAccessSignature holds ``&``s), and credential parameters of a SAS token
#: or query string written on its own (``sv=...&sig=...``), each after a separator.
_CONNECTION_FIELD = re.compile(
    r"(?<![A-Za-z0-9_-])(AccountKey|SharedAccessSignature|SharedAccessKey|Password|Pwd)=([^;\s'\"]+)",
    re.IGNORECASE)
_LOOSE_PARAM = re.compile(
    r"(?<![A-Za-z0-9_.-])(sig|signature|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token"
    r"|X-Goog-Signature|X-Goog-Credential|access_token|refresh_token|id_token|token|api_?key"
    r"|client_secret|secret|password|passwd|session_token)=([^&;#\s'\"]+)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its userinfo and credential query parameters masked as ``***``.

    Only what is masked changes; a URL without credentials is returned as it is.
    """
    if "://" not in url:
        return url
    redacted = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", url, count=1)
    head, sep, tail = redacted.partition("?")
    if sep:
        redacted = head + _PARAM.sub(_mask_param, "?" + tail)
    return redacted


def _mask_param(match: re.Match[str]) -> str:
    sep, name, value = match.group(1), match.group(2), match.group(3)
    if value and _secret_param(name):
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
            if value and _secret_param(name):
                found |= {value, urllib.parse.unquote_plus(value)}
    return {value for value in found if len(value) >= 4}


def scrub_urls(text: str) -> str:
    """``text`` with every URL in it passed through `redact_url`, and the credentials of
    connection strings and SAS tokens outside URLs masked (see the module docstring)."""
    if "://" in text:
        text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    if "=" in text:
        text = _CONNECTION_FIELD.sub(_mask_field, text)
        text = _LOOSE_PARAM.sub(_mask_field, text)
    return text


def _mask_field(match: re.Match[str]) -> str:
    return match.group(0) if match.group(2) == REDACTED else f"{match.group(1)}={REDACTED}"


def redact_tree(value: Any, secrets: set[str] | frozenset[str] | None = None) -> Any:
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


def install_log_redaction(secrets: set[str] | None = None) -> None:
    """Add a `RedactingFilter` to every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter(secrets))
