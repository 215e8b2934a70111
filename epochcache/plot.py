"""Plots of a cache's fill over time and of a run's epochs (matplotlib, headless).

``epochcache plot CACHE_DIR -o fill.png``: stored bytes against capacity, ingest rate and
evictions over time, from the cache's stats history (appended by the daemon).
A run writes ``run.png`` in its run directory: the same panels plus loss and the data-wait
fraction per epoch.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: no display on training nodes

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

_GIB = 1024**3


def _rates(history: Sequence[dict[str, Any]], t0: float) -> tuple[list[float], list[float], list[float]]:
    times, ingest, evictions = [], [], []
    for prev, row in zip(history, history[1:]):
        dt = row["time"] - prev["time"]
        if dt <= 0:
            continue
        times.append((row["time"] - t0) / 60)
        ingest.append((row["inserted"] - prev["inserted"]) / dt)
        evictions.append((row["evicted"] - prev["evicted"]) / dt)
    return times, ingest, evictions


def _fill_axes(ax_fill: Axes, ax_rate: Axes, history: Sequence[dict[str, Any]]) -> None:
    if not history:
        ax_fill.text(0.5, 0.5, "no stats history yet (the daemon appends it)", ha="center", va="center",
                     transform=ax_fill.transAxes)
        return
    t0 = history[0]["time"]
    minutes = [(row["time"] - t0) / 60 for row in history]
    scale, unit = (_GIB, "GiB") if max(row["capacity"] for row in history) >= _GIB else (1024**2, "MiB")
    ax_fill.plot(minutes, [row["bytes"] / scale for row in history], ".-", label="stored")
    ax_fill.plot(minutes, [row["capacity"] / scale for row in history], "--", label="capacity")
    ax_fill.set_ylabel(f"cache size ({unit})")
    ax_fill.set_xlabel("time (minutes)")
    ax_fill.set_title("cache fill")
    ax_fill.legend(loc="lower right")
    times, ingest, evictions = _rates(history, t0)
    ax_rate.plot(times, ingest, ".-", label="ingest")
    ax_rate.plot(times, evictions, ".-", label="evictions")
    ax_rate.set_ylabel("samples / s")
    ax_rate.set_xlabel("time (minutes)")
    ax_rate.set_title("ingest and eviction rate")
    ax_rate.legend(loc="upper right")


def plot_cache(history: Sequence[dict[str, Any]], out: str | os.PathLike[str], title: str = "") -> None:
    """Cache fill against capacity, and ingest/eviction rates, over time."""
    fig, (ax_fill, ax_rate) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    _fill_axes(ax_fill, ax_rate, history)
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_run(
    metrics: Sequence[dict[str, Any]],
    history: Sequence[dict[str, Any]],
    out: str | os.PathLike[str],
    title: str = "",
) -> None:
    """A run's four panels: loss, data-wait fraction per epoch, cache fill, rates."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    epochs = [row["epoch"] for row in metrics]
    ax = axes[0][0]
    ax.plot(epochs, [row.get("loss", float("nan")) for row in metrics], "o-")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax = axes[0][1]
    ax.bar(epochs, [100 * row.get("data_wait_fraction", 0.0) for row in metrics])
    ax.set_xlabel("epoch")
    ax.set_ylabel("data wait (% of epoch time)")
    ax.set_title("time the loop waited on data")
    for axis in (axes[0][0], axes[0][1]):
        axis.set_xticks(epochs)
    _fill_axes(axes[1][0], axes[1][1], history)
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _cmd_plot(args: argparse.Namespace) -> int:
    from .cache import Cache
    from .errors import CacheError

    if not os.path.isdir(args.cache_dir):
        raise CacheError(f"{args.cache_dir}: no such directory")
    cache = Cache(args.cache_dir, readonly=True)
    try:
        history = cache.history()
    finally:
        cache.close()
    plot_cache(history, args.output, title=f"epochcache {cache.path}")
    print(f"wrote {args.output} ({len(history)} stats rows)")
    return 0


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plot", help="plot cache fill, ingest rate and evictions over time"
    )
    parser.add_argument("cache_dir")
    parser.add_argument("-o", "--output", default="fill.png", help="PNG file to write")
    parser.set_defaults(func=_cmd_plot)
    return parser
