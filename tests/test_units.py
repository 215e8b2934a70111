"""Sizes and durations parsed once at the boundary."""

from __future__ import annotations

import pytest

from epochcache.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200GiB", 200 * 2**30),
        ("1GB", 10**9),
        ("64MB", 64 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        (" 10 kb ", 10_000),
        ("0", 0),
        (1024, 1024),
        (2.5, 2),
        ("1e3", 1000),
    ],
)
def test_parse_size(text: str | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "lots", "5 parsecs", True, None, -3])
def test_parse_size_rejects_and_names(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        parse_size(bad, name="capacity")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("30s", 30.0), ("5m", 300.0), ("250ms", 0.25), (12.5, 12.5), ("2h", 7200.0)],
)
def test_parse_duration(text: str | float, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["soon", "-1s", "3 weeks", False])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="timeout"):
        parse_duration(bad, name="timeout")  # type: ignore[arg-type]


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(200 * 2**30) == "200.0 GiB"
