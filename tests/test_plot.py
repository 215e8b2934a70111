"""What run.png shows a new user (issue 37, item 7): stored bytes went above the capacity
line with no capacity + headroom line (the limit they never cross), so the picture looked like
a broken promise; the epochs-per-sample histogram's labels ran together.

The figure is drawn from the rows a run records (the cache's history, ``metrics.jsonl``) and
checked as matplotlib laid it out.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")

from epochcache.coverage import BUCKETS
from epochcache.plot import run_figure

MIB = 1024 * 1024


def _history() -> list[dict[str, Any]]:
    # a 6 MiB cache with 10% headroom, filled, then held past its capacity by an epoch's lease
    stored = [0, 2, 4, 6, 6.5, 6.6, 6.2, 6.5]
    return [{"time": 1000.0 + 10 * i, "bytes": int(mib * MIB), "capacity": 6 * MIB,
             "headroom": int(0.6 * MIB), "inserted": 300 * i, "evicted": 100 * max(0, i - 3)}
            for i, mib in enumerate(stored)]


def _metrics() -> list[dict[str, Any]]:
    histogram = {label: 0 for label, _lo, _hi in BUCKETS}
    histogram.update({"0": 7200, "1": 1500, "2": 800, "3": 300, "4-7": 150, "8-15": 40,
                      "16-31": 10})
    return [{"epoch": e, "loss": 1.0 / (e + 1), "data_wait_fraction": 0.05,
             "time": 1015.0 + 15 * e, "coverage": {"histogram": histogram}} for e in range(4)]


def test_the_fill_panel_draws_the_limit_and_the_histogram_labels_do_not_run_together(
        ) -> None:
    import matplotlib.pyplot as plt

    coverage = [{"time": 1010.0 + 10 * i, "source": "", "covered": 500 * i, "samples": 10000}
                for i in range(6)]
    fig = run_figure(_metrics(), _history(), coverage=coverage)
    try:
        fig.set_dpi(110)  # as run.png is written
        fig.canvas.draw()
        fill = fig.axes[3]  # second row, first column
        lines = {line.get_label(): line for line in fill.get_lines()}
        limit = lines.get("capacity + headroom (the limit)")
        assert limit is not None, sorted(lines)
        assert "capacity" in lines and "stored bytes" in lines
        stored = lines["stored bytes"].get_ydata()
        assert max(stored) > max(lines["capacity"].get_ydata())  # above the capacity...
        assert max(stored) <= min(limit.get_ydata())  # ...never above the limit
        legend = fill.get_legend()
        assert legend is not None
        assert "capacity + headroom (the limit)" in [t.get_text() for t in legend.get_texts()]

        histogram = next(ax for ax in fig.axes
                         if ax.get_title() == "epochs each sample was trained in")
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        boxes = [label.get_window_extent(renderer) for label in histogram.get_xticklabels()
                 if label.get_text()]
        assert len(boxes) >= 7, [label.get_text() for label in histogram.get_xticklabels()]
        # "64-127128-254" ran together: 2 px apart, less than a space at that size
        gaps = [round(b.x0 - a.x1, 1) for a, b in zip(boxes, boxes[1:])]
        assert min(gaps) >= 4, gaps
    finally:
        plt.close(fig)


def test_a_histogram_of_numeric_bucket_names_draws_without_a_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    # Early in a run only the buckets "0" and "1" hold samples: bar() given those names as
    # categories logged an INFO line about categorical units per figure, twice in
    # `scripts/demo`'s output.
    import logging

    import matplotlib.pyplot as plt

    metrics = _metrics()
    histogram = {label: 0 for label, _lo, _hi in BUCKETS}
    histogram.update({"0": 9000, "1": 1000})
    for row in metrics:
        row["coverage"] = {"histogram": histogram}
    coverage = [{"time": 1010.0 + 10 * i, "source": "", "covered": 500 * i, "samples": 10000}
                for i in range(6)]
    with caplog.at_level(logging.INFO):
        fig = run_figure(metrics, _history(), coverage=coverage)
    try:
        assert not [r for r in caplog.records if r.name.startswith("matplotlib")], \
            [r.getMessage() for r in caplog.records]
        ax = next(ax for ax in fig.axes if ax.get_title() == "epochs each sample was trained in")
        assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
        assert [round(p.get_height()) for p in ax.patches] == [9000, 1000]
    finally:
        plt.close(fig)
