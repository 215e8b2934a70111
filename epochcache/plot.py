"""Plots of a cache's fill over time and of a run's epochs (matplotlib, headless).

``epochcache plot CACHE_DIR -o fill.png``: stored bytes against capacity, ingest rate and
evictions over time, from the cache's stats history (appended by the daemon), and once epochs
were trained the coverage curve beside them: the share of each source's samples trained on at
least once, over time (``cache.coverage()``).
A run writes ``run.png`` in its run directory: the same panels plus loss and the data-wait
fraction per epoch.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

INSTALL_HINT = "pip install 'epochcache[plot]'"


def available() -> bool:
    """Whether matplotlib (an extra) can be imported (installed, and not broken)."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        import matplotlib  # noqa: F401 - the package only (~0.1 s), not pyplot
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    """matplotlib.pyplot, headless. Imported on first plot, not with this module: every CLI
    command registers ``plot``, and pyplot costs ~0.3 s to import."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on training nodes
    import matplotlib.pyplot as plt

    return plt


def _say(ax: Axes, text: str) -> None:
    """``text`` in the middle of an empty panel."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


_GIB = 1024**3


def _time_unit(history: Sequence[dict[str, Any]]) -> tuple[float, str]:
    """Seconds for short runs (a demo lasts seconds), minutes or hours for long ones."""
    span = history[-1]["time"] - history[0]["time"] if history else 0.0
    if span < 180:
        return 1.0, "seconds"
    return (60.0, "minutes") if span < 3 * 3600 else (3600.0, "hours")


def _rates(
    history: Sequence[dict[str, Any]], t0: float, unit_s: float
) -> tuple[list[float], list[float], list[float]]:
    times: list[float] = []
    ingest: list[float] = []
    evictions: list[float] = []
    if not history:
        return times, ingest, evictions
    # Rates over windows of at least 1/100 of the span (and 1 s): a run adds a row at each
    # epoch's end, often moments after the daemon's, and a burst over such a sliver of time
    # would read as thousands per second.
    min_dt = max(1.0, (history[-1]["time"] - history[0]["time"]) / 100)
    prev = history[0]
    for row in history[1:]:
        dt = row["time"] - prev["time"]
        if dt < min_dt:
            continue
        times.append((row["time"] - t0) / unit_s)
        ingest.append((row["inserted"] - prev["inserted"]) / dt)
        evictions.append((row["evicted"] - prev["evicted"]) / dt)
        prev = row
    return times, ingest, evictions


def _fill_axes(
    ax_fill: Axes,
    ax_rate: Axes,
    history: Sequence[dict[str, Any]],
    epoch_ends: Sequence[tuple[int, float]] = (),
) -> None:
    if not history:
        for ax in (ax_fill, ax_rate):
            _say(ax, "no stats history yet (the daemon appends it)")
        return
    t0 = history[0]["time"]
    unit_s, unit = _time_unit(history)
    times = [(row["time"] - t0) / unit_s for row in history]
    scale, size_unit = (_GIB, "GiB") if max(row["capacity"] for row in history) >= _GIB else (1024**2, "MiB")
    ax_fill.plot(times, [row["bytes"] / scale for row in history], ".-", label="stored bytes")
    ax_fill.plot(times, [row["capacity"] / scale for row in history], "--", color="tab:red",
                 label="capacity")
    if any(row.get("headroom") for row in history):
        # Stored bytes go past the capacity, up to the headroom, while epochs hold their
        # snapshots (invariant 2): the line they never cross (rows of older versions: none).
        ax_fill.plot(times, [(row["capacity"] + row.get("headroom", 0)) / scale
                             for row in history], ":", color="tab:red",
                     label="capacity + headroom (the limit)")
    ax_fill.set_ylim(bottom=0)
    ax_fill.set_ylabel(f"cache size ({size_unit})")
    ax_fill.set_xlabel(f"time ({unit})")
    ax_fill.set_title("cache fill vs capacity")
    ax_rate.set_xlabel(f"time ({unit})")
    ax_rate.set_ylabel("samples / s")
    ax_rate.set_title("ingest and eviction rate")
    rate_times, ingest, evictions = _rates(history, t0, unit_s)
    ax_rate.plot(rate_times, ingest, ".-", label="ingested")
    ax_rate.plot(rate_times, evictions, ".--", label="evicted")
    ax_rate.set_ylim(bottom=0)
    for ax in (ax_fill, ax_rate):
        for index, (epoch, end) in enumerate(epoch_ends):
            ax.axvline((end - t0) / unit_s, color="grey", lw=0.8, ls=":",
                       label="end of an epoch" if index == 0 else None)
            # Inside the top edge: above it the numbers ran into the panel's title.
            ax.annotate(str(epoch), ((end - t0) / unit_s, 0.99), xycoords=("data", "axes fraction"),
                        ha="left", va="top", fontsize=7, color="grey")
        ax.legend(loc="best", fontsize=8)
    ax_rate.set_xlim(ax_fill.get_xlim())  # one time axis for both panels
    if not rate_times:
        _say(ax_rate, "one stats row: no rate yet")


def _coverage_axes(ax: Axes, coverage: Sequence[dict[str, Any]],
                   history: Sequence[dict[str, Any]]) -> None:
    """The share of each source's samples trained on at least once, over time (the time axis
    of the fill panel when there is a history)."""
    ax.set_title("coverage: samples trained on at least once")
    ax.set_ylabel("% of the listed samples")
    if not coverage:
        _say(ax, "no epoch recorded yet")
        return
    t0 = history[0]["time"] if history else coverage[0]["time"]
    span_rows = list(history) or [{"time": row["time"]} for row in coverage]
    unit_s, unit = _time_unit([span_rows[0], {"time": max(span_rows[-1]["time"],
                                                           coverage[-1]["time"])}])
    for name in sorted({str(row["source"]) for row in coverage}):
        rows = [row for row in coverage if str(row["source"]) == name]
        ax.plot([(row["time"] - t0) / unit_s for row in rows],
                [100 * row["covered"] / row["samples"] if row.get("samples") else 0.0
                 for row in rows], ".-", label=name or "source")
    ax.set_ylim(0, 105)
    ax.set_xlabel(f"time ({unit})")
    ax.legend(loc="lower right", fontsize=8)


def _common_time_axis(axes: Sequence[Axes]) -> None:
    """One time span for the panels drawn against time (coverage rows outlast the history)."""
    spans = [ax.get_xlim() for ax in axes]
    lo, hi = min(span[0] for span in spans), max(span[1] for span in spans)
    for ax in axes:
        ax.set_xlim(lo, hi)


def plot_cache(history: Sequence[dict[str, Any]], out: str | os.PathLike[str], title: str = "",
               coverage: Sequence[dict[str, Any]] = ()) -> None:
    """Cache fill against capacity, and ingest/eviction rates, over time; with ``coverage``
    (`epochcache.coverage.history`) the coverage curve beside them."""
    plt = _pyplot()
    if coverage:
        fig, (ax_fill, ax_rate, ax_cov) = plt.subplots(1, 3, figsize=(16, 4),
                                                       constrained_layout=True)
        _coverage_axes(ax_cov, coverage, history)
    else:
        fig, (ax_fill, ax_rate) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    _fill_axes(ax_fill, ax_rate, history)
    if coverage:
        _common_time_axis([ax_fill, ax_rate, ax_cov])
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_run(
    metrics: Sequence[dict[str, Any]],
    history: Sequence[dict[str, Any]],
    out: str | os.PathLike[str],
    title: str = "",
    coverage: Sequence[dict[str, Any]] = (),
) -> None:
    """A run's panels: loss, data-wait fraction per epoch, cache fill, rates; with
    ``coverage`` the coverage curve under a fifth, the epochs-per-sample histogram."""
    plt = _pyplot()
    fig = run_figure(metrics, history, title, coverage)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_figure(metrics: Sequence[dict[str, Any]], history: Sequence[dict[str, Any]],
               title: str = "", coverage: Sequence[dict[str, Any]] = ()) -> Any:
    """The matplotlib figure `plot_run` writes (close it with ``pyplot.close``)."""
    plt = _pyplot()
    columns = 3 if coverage else 2
    fig, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 7.5), constrained_layout=True)
    epochs = [row["epoch"] for row in metrics]
    ax = axes[0][0]
    ax.plot(epochs, [row.get("loss", float("nan")) for row in metrics], "o-", label="mean loss")
    if any("accuracy" in row for row in metrics):
        acc = ax.twinx()
        acc.plot(epochs, [row.get("accuracy", float("nan")) for row in metrics], "s--",
                 color="tab:green", label="accuracy")
        acc.set_ylabel("accuracy")
        acc.set_ylim(0, 1.05)
        lines = ax.get_lines() + acc.get_lines()
        ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize=8)
    else:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title("training loss per epoch")
    ax = axes[0][1]
    ax.bar(epochs, [100 * row.get("data_wait_fraction", 0.0) for row in metrics], label="data wait")
    ax.set_ylim(0, 100)
    ax.set_xlabel("epoch")
    ax.set_ylabel("data wait (% of epoch time)")
    ax.set_title("time the training loop waited on data")
    for axis in (axes[0][0], axes[0][1]):
        axis.set_xticks(epochs)
    if not metrics:
        _say(axes[0][0], "no finished epoch")
    ends = [(int(row["epoch"]), float(row["time"])) for row in metrics if "time" in row]
    if ends:
        # What the cache did after the last epoch (the run releasing its lease, the daemon
        # stopping) is not part of the run.
        last = max(end for _epoch, end in ends)
        history = [row for row in history if row["time"] <= last + 0.2]
    _fill_axes(axes[1][0], axes[1][1], history, ends)
    if coverage:
        _coverage_axes(axes[1][2], coverage, history)
        _common_time_axis([axes[1][0], axes[1][1], axes[1][2]])
        ax = axes[0][2]
        ax.set_title("epochs each sample was trained in")
        ax.set_xlabel("epochs")
        ax.set_ylabel("samples")
        shown = [row for row in metrics if isinstance(row.get("coverage"), dict)]
        histogram = shown[-1]["coverage"].get("histogram") if shown else None
        if histogram:
            # Buckets up to the last one holding samples (the empty tail of "64-127",
            # "128-254", "255+" ran its labels together), labels turned to fit.
            labels = list(histogram)
            last = max((i for i, label in enumerate(labels) if histogram[label]), default=0)
            labels = labels[: max(last + 1, 2)]
            # At positions, named by ticks: labels that all read as numbers ("0", "1")
            # made matplotlib log an INFO line per plot about categorical units.
            ax.bar(range(len(labels)), [histogram[label] for label in labels])
            ax.set_xticks(range(len(labels)), labels)
            ax.tick_params(axis="x", labelsize=8, labelrotation=45 if len(labels) > 6 else 0)
        else:
            _say(ax, "no histogram yet")
    if title:
        fig.suptitle(title)
    return fig
