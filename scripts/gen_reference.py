"""Write the reference pages that come from the code: docs/reference/config.md from the config
model (every key, its type, default, allowed values and description) and docs/reference/cli.md
from the argument parser.

    .venv/bin/python scripts/gen_reference.py          # write the pages
    .venv/bin/python scripts/gen_reference.py --check  # exit 1 if a page is stale

tests/test_docs.py runs the check, so a field or option added without regenerating fails the
suite: the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from epochcache.config import EpochcacheConfig, NamedSourceConfig, SourceConfig  # noqa: E402
from epochcache.registry import policy_names  # noqa: E402

CONFIG_PAGE = REPO / "docs" / "reference" / "config.md"
CLI_PAGE = REPO / "docs" / "reference" / "cli.md"

#: What a value parsed by one of the config's validators may be written as.
_PARSED = {
    "_size": "size",
    "_rate": "rate",
    "_duration": "duration",
    "_headroom": "fraction or size",
}
_UNITS = (
    "Sizes are ints (bytes) or strings such as `200GiB`, `64MB` (GiB = 1024³, GB = 1000³); "
    "rates are sizes per second (`200MB` or `200MB/s`); durations are seconds, or strings "
    "such as `30s`, `5m`. `${VAR}` and `${VAR:-default}` in any string are replaced from the "
    "environment before validation."
)


def _validators(info: FieldInfo | None, annotation: Any) -> list[str]:
    names: list[str] = []
    metadata = list(info.metadata) if info is not None else []
    if get_origin(annotation) is typing.Annotated:
        metadata += list(get_args(annotation)[1:])
    for item in metadata:
        if isinstance(item, BeforeValidator):
            names.append(getattr(item.func, "__name__", ""))
    return names


def _type(annotation: Any, info: FieldInfo | None = None) -> str:
    """A short, readable name of a field's type."""
    for name in _validators(info, annotation):
        if name in _PARSED:
            return _PARSED[name]
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return _type(get_args(annotation)[0], None) if not _validators(None, annotation) else \
            _PARSED.get(_validators(None, annotation)[0], _type(get_args(annotation)[0]))
    if origin in (typing.Union, types.UnionType):
        parts = [_type(arg) for arg in get_args(annotation) if arg is not type(None)]
        optional = type(None) in get_args(annotation)
        return " or ".join(parts) + (" or null" if optional else "")
    if origin is Literal:
        return _type(type(get_args(annotation)[0]))
    if origin is list:
        (item,) = get_args(annotation) or (Any,)
        return f"list of {_type(item)}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type):
        return {"str": "string", "int": "int", "float": "number", "bool": "bool",
                "Path": "path"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def _allowed(annotation: Any, info: FieldInfo) -> str:
    """Allowed values (a Literal's) or bounds (ge/gt/le/lt, min length)."""
    literals: list[str] = []

    def walk(ann: Any) -> None:
        origin = get_origin(ann)
        if origin is Literal:
            literals.extend(f"`{value}`" for value in get_args(ann))
        elif origin in (typing.Union, types.UnionType, typing.Annotated, list):
            for arg in get_args(ann):
                walk(arg)

    walk(annotation)
    if "_eviction" in _validators(info, annotation):  # checked against the registry
        literals.extend(f"`{name}`" for name in policy_names())
    bounds: list[str] = []
    metadata = list(info.metadata)
    for arg in get_args(annotation):
        if get_origin(arg) is typing.Annotated:
            metadata += list(get_args(arg)[1:])
    if get_origin(annotation) is typing.Annotated:
        metadata += list(get_args(annotation)[1:])
    for item in metadata:
        if isinstance(item, FieldInfo):
            metadata += list(item.metadata)
    for item in metadata:
        if isinstance(item, Ge):
            bounds.append(f">= {item.ge}")
        elif isinstance(item, Gt):
            bounds.append(f"> {item.gt}")
        elif isinstance(item, Le):
            bounds.append(f"<= {item.le}")
        elif isinstance(item, Lt):
            bounds.append(f"< {item.lt}")
        elif isinstance(item, MinLen) and item.min_length:
            bounds.append(f"at least {item.min_length} long")
    # a Literal and bounds: a number within the bounds, or one of the words
    return ", ".join(list(dict.fromkeys(bounds)) + literals)


def _size_text(num_bytes: int) -> str:
    """A size as a config writes it: ``4GiB``, ``512MiB`` (bytes only when no unit divides it)."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def _default(info: FieldInfo, kind: str = "") -> str:
    if info.is_required():
        return "**required**"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path):
        return f"`{value}`"
    if kind.startswith("size") and isinstance(value, int):
        return f"`{_size_text(value)}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _escape(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _section_rows(model: type[BaseModel], prefix: str, skip: set[str] = frozenset()  # type: ignore[assignment]
                  ) -> list[str]:
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        annotation = info.annotation
        kind = _type(annotation, info)
        rows.append(f"| `{prefix}{name}` | {_escape(kind)} | "
                    f"{_escape(_default(info, kind))} | {_escape(_allowed(annotation, info))} | "
                    f"{_escape(info.description or '')} |")
    return rows


def config_markdown() -> str:
    """The configuration reference, from :class:`EpochcacheConfig` and its sections."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen_reference.py from epochcache/config/schema.py: do not edit. -->",
        "",
        "One YAML file configures `epochcache daemon` and `epochcache run` (and `ec.Daemon`, "
        "`ec.load_config`). Only `source.url` (or `sources`), `cache.dir` and "
        "`cache.capacity` are required. A bad key or value stops the command with exit "
        "status 2 and a message naming the field.",
        "",
        _UNITS,
        "",
    ]
    header = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for name, info in EpochcacheConfig.model_fields.items():
        if name == "sources":
            continue
        model = _section_model(info.annotation)
        out += [f"## `{name}`", ""]
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        if doc:
            out += [" ".join(doc.split()), ""]
        out += header + _section_rows(model, f"{name}.") + [""]
        if name == "source":
            out += [
                "## `sources`",
                "",
                "Instead of `source`: a list of sources, each with every key of `source` and "
                "these, sampled in proportion to their weights (their samples are cached under "
                "`<name>/<key>`).",
                "",
                *header,
                *_section_rows(NamedSourceConfig, "sources[].",
                               skip=set(SourceConfig.model_fields)),
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


def _section_model(annotation: Any) -> type[BaseModel]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    raise TypeError(f"no section model in {annotation!r}")


def cli_markdown() -> str:
    """The command reference, from the argument parser of ``epochcache``."""
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix it for a stable page
    from epochcache.cli import build_parser

    parser = build_parser()
    out = [
        "# Command reference",
        "",
        "<!-- Generated by scripts/gen_reference.py from epochcache/cli.py: do not edit. -->",
        "",
        "One command, `epochcache`, with a subcommand per job. Exit status: 0 success, 1 a "
        "failure at run time, 2 bad usage, a bad config, a source unreachable or a path that "
        "cannot be written (a read-only mount, a file in the way, /proc) at start, each one "
        "line naming it (nothing was started). `-v` / `-q` before or after the subcommand make "
        "the log "
        "(stderr) more or less verbose; stdout carries only what a command prints.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
    ]
    subparsers = next(action for action in parser._actions
                      if isinstance(action, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        out += [f"## `epochcache {name}`", ""]
        if helps.get(name):
            out += [_escape(str(helps[name])).rstrip(".") + ".", ""]
        if sub.description:
            out += [" ".join(sub.description.split()), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        rows = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            names = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest}`"
            detail = _escape(action.help or "")
            if action.choices:
                detail += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                detail += f" (default: `{action.default}`)"
            rows.append(f"| {names} | {detail} |")
        if rows:
            out += ["| argument | meaning |", "|---|---|", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


PAGES = {CONFIG_PAGE: config_markdown, CLI_PAGE: cli_markdown}


def stale() -> list[Path]:
    """The generated pages whose content differs from what the code gives now."""
    return [page for page, make in PAGES.items()
            if not page.exists() or page.read_text() != make()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is stale")
    args = parser.parse_args()
    if args.check:
        pages = stale()
        for page in pages:
            print(f"{page.relative_to(REPO)} is stale: run scripts/gen_reference.py")
        return 1 if pages else 0
    for page, make in PAGES.items():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(make())
        print(f"wrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
