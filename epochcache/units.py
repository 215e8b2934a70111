"""Parse human sizes ("200GiB", "64MB", 1024) and durations ("30s", "5m") into ints and floats.

Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units are distinct: "1GB" is 10**9
bytes and "1GiB" is 2**30. Values are parsed once at the boundary (config, constructor).
"""

from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes.

    Raises:
        ValueError: the value is negative or not a size; the message names ``name``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size such as 200GiB or 1000000, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _NUMBER_UNIT.match(value)
        if match is None:
            raise ValueError(
                f"{name}: cannot read {value!r} as a size (use e.g. 200GiB, 512MiB, 10GB or bytes)"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise ValueError(f"{name}: expected a size such as 200GiB, got {type(value).__name__}")
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"{name}: unknown unit {unit!r} in {value!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    if number < 0:
        raise ValueError(f"{name}: must not be negative, got {value!r}")
    return int(number * _SIZE_UNITS[unit])


def parse_duration(value: int | float | str, *, name: str = "duration") -> float:
    """Return ``value`` in seconds ("30s", "5m", "250ms", 12.5)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a duration such as 30s, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _NUMBER_UNIT.match(str(value))
        if match is None or match.group(2).lower() not in _DURATION_UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a duration (use e.g. 30s, 5m, 250ms)")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"{name}: must not be negative, got {value!r}")
    return number * _DURATION_UNITS[unit]


def parse_headroom(value: float | int | str, *, name: str = "headroom") -> float | int:
    """A fraction of capacity (``0.1``, ``"10%"``) as a float, or a size (``"2GiB"``, ``500``) as
    int bytes: `headroom_bytes` turns either into bytes for a given capacity.

    Raises:
        ValueError: a fraction outside [0, 10] or not a size; the message names ``name``.
    """
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            value = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ValueError(f"{name}: cannot read {value!r} as a percentage") from None
    if isinstance(value, float):
        if not 0 <= value <= 10:
            raise ValueError(f"{name}: a fraction of capacity must be between 0.0 and 10.0 "
                             f"(0%-1000%), or give a size such as 2GiB; got {value!r}")
        return value
    return parse_size(value, name=name)


def headroom_bytes(headroom: float | int, capacity_bytes: int) -> int:
    """Bytes of a headroom from `parse_headroom`: a fraction of the capacity, or a size."""
    return int(capacity_bytes * headroom) if isinstance(headroom, float) else int(headroom)


def format_size(num_bytes: float) -> str:
    """Render bytes with a binary unit, e.g. ``1.5 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(count: float, noun: str, plural: str | None = None) -> str:
    """``1 rank``, ``2 ranks``, ``1,500 samples``: a whole count (a float, such as a mean
    over ranks, is rounded) and its noun in the number it takes."""
    whole = int(round(count))
    return f"{whole:,} {noun if whole == 1 else plural or noun + 's'}"


def format_duration(seconds: float | None) -> str:
    """``3h 20m``, ``2d 4h``, ``45s``; ``unknown`` for None."""
    if seconds is None:
        return "unknown"
    seconds = max(0.0, float(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for (unit, size), (sub, sub_size) in zip(units, units[1:]):
        if seconds >= size:  # the unit and the next one down
            return f"{int(seconds // size)}{unit} {int(seconds % size // sub_size)}{sub}"
    return f"{seconds:.0f}s"
