"""scripts/bench_ingest.py times the daemon's fill between two polls of the cache; a fill that
ended between two polls timed as 0 s and the benchmark died dividing by it (issue 22, item 7).
A real daemon fills 10 samples: they commit in one transaction, so one poll sees a tenth and
all of them."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def test_a_fill_that_ends_between_two_polls_is_timed(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from ingest_remotes import daemon_fill
    finally:
        sys.path.remove(str(REPO / "scripts"))
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(10):
        (remote / f"{i}.bin").write_bytes(b"x" * 100)
    work = tmp_path / "work"
    work.mkdir()
    result = daemon_fill({"url": remote.as_uri(), "pattern": "*.bin", "checks": []}, 10, work,
                         processes=1, concurrency=4, batch_size=64, sync=False,
                         capacity=64 * 1024**2)
    assert result["seconds"] > 0 and math.isfinite(result["seconds"]), result
    assert result["whole_fill"] is True  # timed from the start, and said so
