"""What a config chooses by name, in one place: the layouts a source may have.

The config validates ``source.layout`` against `LAYOUTS`, and the reference pages list its
choices (and their help) from it; `epochcache.ingest.layouts.layout_of` imports a layout's
`Source` class from here when a source is opened. Names live in this base module, not beside
the classes, so that the config (which never imports the ingest layer) knows them, and a
layout's library (pyarrow) is imported only by those who read that layout.

A new layout is one entry here and its module in ``ingest/layouts/`` (docs/contributing.md).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """A layout a source may have.

    Attributes:
        target: ``module:Class`` of its `Source` subclass.
        help: what its objects are, one line (the reference pages).
        pattern: what is listed when the config gives no pattern, manifest or shard list.
        shards: whether it takes ``source.shards`` (a brace pattern of shard keys).
        requires: a module it needs that epochcache does not depend on (None: none)...
        extra: ...and the extra of ``pip install 'epochcache[extra]'`` that installs it.
    """

    target: str
    help: str
    pattern: str = "**"
    shards: bool = False
    requires: str | None = None
    extra: str | None = None


LAYOUTS: dict[str, Layout] = {
    "files": Layout("epochcache.ingest.layouts.files:FilesSource", "one object per sample"),
    "tar": Layout("epochcache.ingest.layouts.tar:TarSource",
                  "WebDataset shards, a sample per basename", pattern="**/*.tar", shards=True),
    "parquet": Layout("epochcache.ingest.layouts.parquet:ParquetSource",
                      "Parquet files, a sample per row (read a row group at a time)",
                      pattern="**/*.parquet", requires="pyarrow", extra="parquet"),
}


def layout(name: str) -> Layout:
    """The layout named ``name``.

    Raises:
        ValueError: no layout has that name (the message lists those that do).
    """
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"source layout {name!r}: expected one of "
                         f"{', '.join(sorted(LAYOUTS))}") from None


def missing_requirement(name: str) -> str | None:
    """What layout ``name`` needs and is not installed, as a sentence saying how to install
    it; None when nothing is missing."""
    entry = layout(name)
    if entry.requires is None or importlib.util.find_spec(entry.requires) is not None:
        return None
    return (f"layout {name} needs {entry.requires}, which is not installed: "
            f"pip install 'epochcache[{entry.extra}]'")
