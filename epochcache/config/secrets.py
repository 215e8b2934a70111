"""What a config masks: the secrets it carries, found in a resolved config or named by the
``${VAR}`` interpolation, for `EpochcacheConfig.set_secrets` to hide them in its ``repr()``,
``redacted()`` and error messages (`epochcache.redact` does the masking)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..redact import secret_values, strings_in, url_secrets


def set_path(data: Any, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            return
    last = parts[-1]
    if isinstance(data, dict) and last in data:
        data[last] = value
    elif isinstance(data, list) and last.isdigit() and int(last) < len(data):
        data[int(last)] = value


def found_secrets(data: Any) -> set[str]:
    """Secrets a resolved config carries in plain sight: credential-like storage options and
    the credentials inside every URL-like string."""
    found = secret_values(get_path(data, ("source", "storage_options")))
    entries = get_path(data, ("sources",))
    for entry in entries if isinstance(entries, list) else []:
        options = get_path(entry, ("storage_options",))
        found |= secret_values(options if isinstance(options, Mapping) else None)
    for text in strings_in(data):
        found.update(url_secrets(text))
    return found


def get_path(data: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        if not isinstance(data, Mapping):
            return None
        data = data.get(part)
    return data
