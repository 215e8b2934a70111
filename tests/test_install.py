"""The extras of every supported remote install together.

s3fs pins fsspec to its own release (``fsspec==X``), and gcsfs did the same before 2026.6: a
user asking for ``epochcache[s3,gcs]`` would get no resolution, or pip would move one client
off the fsspec it needs. ``scripts/setup-env`` installs all the extras in one resolution
(``test`` holds them); this checks that what it installed satisfies, transitively, every
requirement of the remote extras as ``pyproject.toml`` states them now, so a pin that breaks
the set fails here, in a second, without the network.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]
#: The extras of the remotes epochcache supports.
REMOTE_EXTRAS = ("s3", "obstore", "gcs")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_remote_extras_install_together() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(text) for extra in REMOTE_EXTRAS
            for text in project["optional-dependencies"][extra]]
    assert {_name(r.name) for r in todo} >= {"s3fs", "obstore", "gcsfs"}
    checked: dict[str, str] = {}
    broken: list[str] = []
    while todo:
        requirement = todo.pop()
        name = _name(requirement.name)
        try:
            found = distribution(requirement.name)
        except PackageNotFoundError:
            broken.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(found.version, prereleases=True):
            broken.append(f"{requirement} (installed: {found.version})")
        if name in checked:
            continue
        checked[name] = found.version
        for text in found.requires or []:
            nested = Requirement(text)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    assert not broken, broken
    # the clients share one fsspec: each one's own pin holds for it
    assert {"fsspec", "s3fs", "gcsfs", "obstore"} <= set(checked), sorted(checked)
