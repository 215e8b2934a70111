"""The run configuration: one validated model for ``epochcache daemon`` and ``epochcache run``.

A YAML file with five sections (and an optional sixth, ``daemon``); only ``source.url``,
``cache.dir`` and ``cache.capacity`` are required::

    source:  {url: "s3://bucket/train/", layout: files, pattern: "*.npy", storage_options: {}}
    cache:   {dir: /nvme/epochcache, capacity: 200GiB}
    sampler: {processes: 2, concurrency: auto, strategy: uniform, seed: 0}
    loader:  {batch_size: 64, num_workers: null, decode: auto, allow_pickle: false}
    train:   {epochs: 10, min_samples: 1000, entrypoint: "epochcache.examples:train_epoch"}

Instead of ``source`` (one), ``sources`` lists several, each with the fields of ``source`` plus
``name``, ``weight`` and ``optional``: the daemon samples them in proportion to their weights, and
their samples are cached under ``<name>/<key>``.

``${VAR}`` and ``${VAR:-default}`` in any string value are replaced from the environment before
validation (``$${`` writes a literal ``${``), so secrets stay out of files. Values interpolated from a
variable whose name contains KEY, SECRET, TOKEN, PASSWORD or CREDENTIAL, every credential-like key
of ``source.storage_options``, and the credentials inside URLs (userinfo, presigned signature and
token parameters, see `epochcache.redact.redact_url`) are masked as ``***`` in ``repr()``,
`EpochcacheConfig.redacted` and error messages. ``model_dump()`` keeps the real values
(samplers need them): never log it. A config handed to another process goes as
`EpochcacheConfig.to_transfer` and comes back with `EpochcacheConfig.from_transfer`,
which keeps what must be masked (``model_validate`` alone would forget it).

Sizes accept ints or strings such as ``200GiB``/``64MB``; durations ints, floats or ``30s``/``5m``.
Reading a config (`load_config`, `parse_config`): YAML from a file, ``${VAR}`` interpolated,
validated into the model. Every error is a [`ConfigError`][epochcache.ConfigError] whose message
names the field path, the bad value and what is allowed: pydantic's errors are turned into one
paragraph that names every bad field.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from ..redact import REDACTED, scrub, scrub_urls
from .environment import found_secrets, get_path, interpolate
from .schema import (
    CacheConfig,
    EpochcacheConfig,
    LoaderConfig,
    NamedSourceConfig,
    SourceConfig,
    SourceEntry,
    TrainConfig,
)

__all__ = [
    "CacheConfig",
    "EpochcacheConfig",
    "LoaderConfig",
    "NamedSourceConfig",
    "SourceConfig",
    "SourceEntry",
    "TrainConfig",
    "load_config",
    "parse_config",
]


def parse_config(
    data: Any, *, origin: str = "<dict>", environ: Mapping[str, str] | None = None
) -> EpochcacheConfig:
    """Validate already-parsed YAML (a mapping), interpolating ``${VAR}`` from ``environ``.

    Raises:
        ConfigError: one paragraph naming every bad field path, its value and what is allowed.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{origin}: the config must be a mapping with sections source, cache, sampler, loader, "
            f"train; got {type(data).__name__}"
        )
    environ = os.environ if environ is None else environ
    resolved, secret_paths, secrets = interpolate(data, environ, origin)
    secrets |= found_secrets(resolved)
    entries = get_path(resolved, ("sources",))
    entries = entries if isinstance(entries, list) else []
    try:
        config = EpochcacheConfig.model_validate(resolved)
    except ValidationError as exc:
        hidden = set(secret_paths) | {"source.storage_options"}
        hidden |= {f"sources.{i}.storage_options" for i in range(len(entries))}
        raise ConfigError(describe_errors(exc, origin, hidden, secrets)) from None
    config.set_secrets(secret_paths, secrets, origin)
    return config


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> EpochcacheConfig:
    """Read, interpolate and validate a YAML config file.

    Raises:
        ConfigError: the file is missing, not YAML, or a field is invalid (the message names it).
    """
    origin = os.fspath(path)
    try:
        text = Path(origin).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{origin}: cannot read the config ({exc.strerror or exc})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{origin}: not valid YAML{where}: {problem}") from None
    return parse_config(data, origin=origin, environ=environ)


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """The field names of the model that holds ``loc[-1]``."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an index into a list of sections (sources.0.url)
        fields = getattr(_section_model(current), "model_fields", None)
        if fields is None or part not in fields:
            return None
        current = fields[part].annotation
    fields = getattr(_section_model(current), "model_fields", None)
    return sorted(fields) if fields is not None else None


def _section_model(annotation: Any) -> Any:
    """The model inside ``X | None`` or ``list[X]`` (else the annotation itself)."""
    if hasattr(annotation, "model_fields"):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if hasattr(found, "model_fields"):
            return found
    return annotation


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe_errors(exc: ValidationError, origin: str, hidden_paths: set[str],
                    secrets: set[str]) -> str:
    """One paragraph: every error as ``path: problem, got value (allowed)``; secrets masked."""
    problems: list[str] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        path = ".".join(str(part) for part in loc) or "<top>"
        kind = error["type"]
        message = str(error["msg"])
        message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        for prefix in ("size: ", "duration: ", "headroom: "):
            message = message.removeprefix(prefix)
        hidden = any(path == p or path.startswith(p + ".") for p in hidden_paths)
        shown = REDACTED if hidden else _show(error.get("input"))
        if kind == "extra_forbidden":
            allowed = _allowed_keys(EpochcacheConfig, loc)
            hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
            problems.append(f"{path}: unknown key{hint}")
        elif kind == "missing":
            problems.append(f"{path}: required but missing")
        elif "got " in message or isinstance(error.get("input"), (dict, list)):
            # our validators already name the value; a whole section is never echoed (secrets)
            problems.append(f"{path}: {message}")
        else:
            problems.append(f"{path}: {message}, got {shown}")
    count = len(problems)
    head = f"{origin}: invalid config ({count} problem{'s' if count != 1 else ''}): "
    return scrub(scrub_urls(head + "; ".join(problems) + "."), secrets)
