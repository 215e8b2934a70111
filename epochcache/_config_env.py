"""Helpers of :mod:`epochcache.config`: ``${VAR}`` interpolation, node detection from the
environment, and turning pydantic's ValidationError into one readable paragraph."""

from __future__ import annotations

import importlib.util
import re
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, NodeLayoutError
from .launcher import env_int, read_node
from .redact import REDACTED, scrub, scrub_urls

_VAR = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_VAR = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def pyarrow_available() -> bool:
    """Whether Parquet manifests can be read."""
    return importlib.util.find_spec("pyarrow") is not None


def interpolate(
    data: Any, environ: Mapping[str, str], origin: str
) -> tuple[Any, set[str], set[str]]:
    """Replace ``${VAR}``/``${VAR:-default}`` in every string of a parsed YAML tree.

    Working on parsed values, not the raw text, means a variable's value can never inject YAML
    structure. Returns the new tree, the dotted paths whose value came from a secret-named variable,
    and those secret values.

    Raises:
        ConfigError: a variable is unset and has no default; the message names path and variable.
    """
    secret_paths: set[str] = set()
    secrets: set[str] = set()

    def visit(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            return {k: visit(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [visit(v, f"{path}.{i}") for i, v in enumerate(value)]
        if not isinstance(value, str) or "$" not in value:
            return value

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$${":
                return "${"
            name, default = match.group(1), match.group(2)
            if name in environ:
                result = environ[name]
            elif default is not None:
                result = default
            else:
                raise ConfigError(
                    f"{origin}: {path or '<top>'}: environment variable {name} is not set; set it, "
                    f"or write ${{{name}:-default}} to give a default"
                )
            if _SECRET_VAR.search(name):
                secret_paths.add(path)
                if result:
                    secrets.add(result)
            return result

        return _VAR.sub(substitute, value)

    return visit(data, ""), secret_paths, secrets


def resolve_node(
    node_rank: int | None, num_nodes: int | None, environ: Mapping[str, str]
) -> tuple[int, int]:
    """``(node_rank, num_nodes)`` of the samplers: the config's, else ``EPOCHCACHE_NODE_RANK``/
    ``EPOCHCACHE_NUM_NODES``, else torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (or
    ``WORLD_SIZE // LOCAL_WORLD_SIZE``), else, in a distributed launch, Slurm's (see
    :mod:`epochcache.launcher`); ``(0, 1)`` outside a distributed launch.

    Raises:
        ConfigError: a value is not an integer, out of range, or a distributed launch does not
            say which node this is (never guessed: nodes would pull the same partition).
    """

    def read(name: str) -> int | None:
        try:
            return env_int(environ, name)
        except NodeLayoutError as exc:
            raise ConfigError(f"sampler: {exc}") from None

    rank = node_rank if node_rank is not None else read("EPOCHCACHE_NODE_RANK")
    count = num_nodes if num_nodes is not None else read("EPOCHCACHE_NUM_NODES")
    if rank is None or count is None:
        try:
            launched = read_node(environ)
        except NodeLayoutError as exc:
            raise ConfigError(f"sampler.node_rank/num_nodes: {exc}; or set sampler.node_rank and "
                              "sampler.num_nodes in the config") from None
        rank = launched[0] if rank is None else rank
        count = launched[1] if count is None else count
    if count < 1 or not 0 <= rank < count:
        raise ConfigError(
            f"sampler.node_rank/num_nodes: node_rank {rank} must be in [0, num_nodes={count}); "
            "check sampler.node_rank, sampler.num_nodes or GROUP_RANK/GROUP_WORLD_SIZE"
        )
    return rank, count


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


def describe_errors(
    exc: ValidationError,
    origin: str,
    hidden_paths: set[str],
    secrets: set[str],
    model: type[BaseModel],
) -> str:
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
            allowed = _allowed_keys(model, loc)
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
