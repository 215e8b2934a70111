"""What a config reads from the environment, and the secrets it masks.

``${VAR}`` and ``${VAR:-default}`` in its strings are interpolated (`interpolate`), and the
samplers' node is read (`resolve_node`) when the config does not say. The secrets a config
carries, found in the resolved config (`found_secrets`) or named by the interpolation, are
what `EpochcacheConfig.set_secrets` hides in its ``repr()``, ``redacted()`` and error messages
(`epochcache.redact` does the masking)."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError, NodeLayoutError
from ..placement import env_int, read_node
from ..redact import secret_values, strings_in, url_secrets

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
    `epochcache.placement`); ``(0, 1)`` outside a distributed launch.

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
