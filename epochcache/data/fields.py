"""Field selection: multi-field samples become tuples, as WebDataset's ``to_tuple`` makes them.

``fields=("jpg;png;webp", "cls")`` turns each sample into ``(image, label)``: a position lists
alternatives separated by ``;`` and takes the first one the sample has. Names match the
sample's field names (a tar member ``000123.seg.png`` is field ``seg.png``) exactly, else
ignoring case; ``__key__`` is the sample's key. A sample stored as one object (``files`` layout)
has one field, named by its key's extensions (``a/000123.jpg`` is ``jpg``, ``x.npy.gz`` is
``npy.gz``, also answering to ``npy``). With ``decode="auto"`` only the selected fields are decoded.

A sample without a wanted field raises [`DecodeError`][epochcache.DecodeError] naming its key,
the field and the fields it has; with ``on_error="skip"`` it is skipped and counted instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import DecodeError
from ..limits import DEFAULT_MAX_SAMPLE_BYTES
from ..options import DecodeFn
from ..store.records import Value
from .decode import decode_bytes, extensions, make_decoder

KEY_FIELD = "__key__"
Selection = tuple[tuple[str, ...], ...]


def parse_fields(fields: str | Sequence[str]) -> Selection:
    """``("jpg;png", "cls")`` (or ``"jpg;png cls"``) -> ``(("jpg", "png"), ("cls",))``.

    Raises:
        ValueError: an empty selection or position, or something that is not strings.
    """
    items = fields.split() if isinstance(fields, str) else fields
    if isinstance(items, Mapping) or not isinstance(items, Sequence) or not items:
        raise ValueError(f"fields: expected field names such as ('jpg;png', 'cls'), got "
                         f"{fields!r}")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"fields: each position is a field name or 'a;b' alternatives, "
                             f"got {item!r} in {fields!r}")
        alternatives = tuple(name.strip() for name in item.split(";") if name.strip())
        if not alternatives:
            raise ValueError(f"fields: empty position {item!r} in {fields!r}")
        out.append(alternatives)
    return tuple(out)


def blob_fields(key: str) -> list[str]:
    """The names a sample stored as one object answers to: its key's extensions
    (``a/x.0001.jpg`` -> ``0001.jpg``, as WebDataset names tar members) and the last of them
    that is not a compression (``jpg``; ``npy`` for ``x.npy.gz``)."""
    exts = extensions(key, False)
    names = [".".join(exts)]
    content = [ext for ext in exts if ext not in ("gz", "gzip")]
    if content and content[-1] != names[0]:
        names.append(content[-1])
    return names


def _find(names: Sequence[str], alternatives: tuple[str, ...]) -> str | None:
    """The first alternative ``names`` holds, else the first it holds ignoring case."""
    exact = next((name for name in alternatives if name in names), None)
    if exact is not None:
        return exact
    lowered = {name.lower(): name for name in names}  # (only when no name matches exactly)
    return next((lowered[n.lower()] for n in alternatives if n.lower() in lowered), None)


def resolve(names: Sequence[str], selection: Selection, key: str) -> list[str]:
    """The field name chosen for each position (``__key__`` stays as it is).

    Raises:
        DecodeError: a position none of whose alternatives the sample has.
    """
    chosen = []
    for alternatives in selection:
        name = _find(names, alternatives)
        if name is None:
            if KEY_FIELD in alternatives:
                name = KEY_FIELD
            else:
                have = ", ".join(names) or "none"
                raise DecodeError(
                    f"sample {key!r}: no field {';'.join(alternatives)!r} (it has: {have}); "
                    "choose fields= that every sample has, or on_error='skip' to skip such "
                    "samples", key=key)
        chosen.append(name)
    return chosen


class FieldSelector:
    """A decoder that returns the selected fields of each sample as a tuple; picklable.

    Args:
        fields: the selection (see the module docstring).
        decode: ``"auto"`` decodes only the selected fields; ``"raw"`` gives their bytes; a
            callable ``fn(key, value)`` runs first and must return a dict of fields.
        allow_pickle: as for `AutoDecoder`.
        image: the form images decode to.
        max_sample_bytes: the most a selected field may decompress to.
    """

    def __init__(self, fields: str | Sequence[str], decode: str | DecodeFn | None = "auto",
                 allow_pickle: bool = False, image: str = "numpy",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
        self.selection = parse_fields(fields)
        self.decoder = make_decoder(decode, allow_pickle, image, max_sample_bytes)
        self.mode = "auto" if decode == "auto" else "raw" if decode in ("raw", None) else "fn"
        self.allow_pickle, self.image = allow_pickle, image
        self.max_sample_bytes = max_sample_bytes

    def __call__(self, key: str, value: Value | memoryview) -> tuple[Any, ...]:
        if self.mode == "fn":
            value = self.decoder(key, value)
            if not isinstance(value, Mapping):
                raise DecodeError(f"sample {key!r}: fields= needs the decoder to return a dict "
                                  f"of fields, got {type(value).__name__}", key=key)
            names = list(value)
            return tuple(key if name == KEY_FIELD and name not in value else value[name]
                         for name in resolve(names, self.selection, key))
        if isinstance(value, Mapping):
            fields: Mapping[str, Any] = value
        else:
            fields = dict.fromkeys(blob_fields(key), value)
        out: list[Any] = []
        for name in resolve(list(fields), self.selection, key):
            if name == KEY_FIELD and name not in fields:
                out.append(key)
            elif self.mode == "raw":
                out.append(bytes(fields[name]))
            elif isinstance(value, Mapping):
                out.append(decode_bytes(name, fields[name], is_field=True,
                                        allow_pickle=self.allow_pickle, image=self.image,
                                        max_sample_bytes=self.max_sample_bytes))
            else:  # decoded by the key's extensions, gz and all
                out.append(decode_bytes(key, value, allow_pickle=self.allow_pickle,
                                        image=self.image, max_sample_bytes=self.max_sample_bytes))
        return tuple(out)
