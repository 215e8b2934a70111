"""Keep credentials out of everything epochcache prints or saves.

Credential values of ``storage_options`` (``key``, ``secret``, ``token``, ...) are masked as
``***`` by :func:`redact_options` wherever options could be shown, and :func:`scrub` replaces
known secret strings in any text. A base module: no fsspec, no torch, nothing of epochcache.
"""

from __future__ import annotations

import re
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
