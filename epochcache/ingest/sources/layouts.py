"""The layouts a source can have, by name: where a new one is added.

A layout is a `Source` subclass: how its dataset is listed (``list_table``: one ref per
object, or per shard), fetched (``fetch_grouped``) and what a listed ref stands for
(``unit``: a sample or a shard of samples). ``files`` (one object per sample) and ``tar``
(WebDataset shards) register themselves in ``sources/__init__.py``; a new layout (say
Parquet row groups) is one module with its `Source` subclass and one `register_layout`
call beside those, plus its name in the config's ``source.layout`` choices
(`epochcache.config.SourceConfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Source

_LAYOUTS: dict[str, type[Source]] = {}


def register_layout(cls: type[Source]) -> type[Source]:
    """Register ``cls`` under its ``layout`` name (usable as a class decorator).

    Raises:
        ValueError: another class has that name.
    """
    name = cls.layout
    if _LAYOUTS.get(name, cls) is not cls:
        raise ValueError(f"layout {name!r} is registered already ({_LAYOUTS[name].__name__})")
    _LAYOUTS[name] = cls
    return cls


def layout_of(name: str) -> type[Source]:
    """The `Source` class of layout ``name``.

    Raises:
        ValueError: no layout has that name (the message lists those that do).
    """
    try:
        return _LAYOUTS[name]
    except KeyError:
        raise ValueError(f"source layout {name!r}: expected one of "
                         f"{', '.join(sorted(_LAYOUTS))}") from None


def layouts() -> list[str]:
    """The registered layout names."""
    return sorted(_LAYOUTS)
