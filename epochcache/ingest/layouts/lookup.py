"""The layouts a source can have, by name: their `Source` classes.

A layout is a `Source` subclass: how its dataset is listed (``list_table``: one ref per
object, or per shard), fetched (``fetch_grouped``: whole objects, a stream, or ranges with
`Source.read_range`) and what a listed ref stands for (``unit``: a sample or a shard of
samples). Names, help and default patterns are in `epochcache.registry` (the config
validates against it); a class is imported from there the first time its layout is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, cast

from ...registry import LAYOUTS, layout

if TYPE_CHECKING:
    from .base import Source


def layout_of(name: str) -> type[Source]:
    """The `Source` class of layout ``name``.

    Raises:
        ValueError: no layout has that name (the message lists those that do).
    """
    module, _, attribute = layout(name).target.partition(":")
    return cast("type[Source]", getattr(importlib.import_module(module), attribute))


def layouts() -> list[str]:
    """The layout names."""
    return sorted(LAYOUTS)
