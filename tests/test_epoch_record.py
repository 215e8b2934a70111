"""The figures a run's log gives agree with each other and with the config (issue 37, item 5).

A new user read "coverage 1,500 of 3,000 samples (50.0%), all seen in 0s" (a node of two that
had seen its share), "all seen in unknown", "0 GETs, 0 LISTs, 710.0 KiB", "600.0 samples"
(a mean over ranks), "concurrency 64" where the config says 32 (two samplers of 32), and "on 1
ranks ... (it ran on 1 node(s) of 1 rank(s))". Each line is built here from the figures a run
records, as ``epochcache run`` builds it (`test_run.test_demo_run_end_to_end` reads a real
run's lines).

Internals: ``plumbing.append_history`` writes the daemon's stats rows a run's log reads.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from epochcache.data.resume import log_resume
from epochcache.data.states import NodeStates
from epochcache.epoch_record import HISTORY, coverage_words, history_row, log_line
from epochcache.ingest.health import describe_requests
from epochcache.placement import Placement
from epochcache.status import collect_stats, render
from epochcache.store import SampleStore
from epochcache.store.plumbing import append_history
from epochcache.units import format_count

ROW: dict[str, Any] = {
    "epoch": 3, "loss": 0.25, "samples": 600.0, "batches": 10, "ranks": 1, "epoch_s": 6.1,
    "data_wait_fraction": 0.011, "cache_bytes": 1 << 20, "cache_samples": 1500, "evicted": 0,
    "new_samples": 1500, "writer_wait_fraction": 0.0,
}


def _coverage(**over: Any) -> dict[str, Any]:
    return {"trained": 1500, "new": 1500, "covered": 1500, "samples": 3000, "fraction": 0.5,
            "share": 3000, "num_nodes": 1, "estimated": False, "eta_s": 120.0, **over}


def test_coverage_says_what_is_left_of_what_this_node_samples() -> None:
    one = coverage_words(_coverage())
    assert one == ("coverage 1,500 of 3,000 samples (50.0%), 1,500 samples new this epoch on "
                   "this rank; every sample seen in about 2m 0s"), one
    # a node of two that has seen its share: not "3,000 samples (50.0%) ... all seen in 0s"
    node = coverage_words(_coverage(share=1500, num_nodes=2, eta_s=0.0, new=0))
    assert node == ("coverage 1,500 of this node's share of 1,500 samples (100.0%; the source "
                    "holds 3,000 over 2 nodes), 0 samples new this epoch on this rank; this "
                    "node's share seen"), node
    done = coverage_words(_coverage(covered=3000, fraction=1.0, eta_s=0.0))
    assert done.endswith("; every sample seen") and "in 0s" not in done, done
    # no ingest rate measured yet (the first epoch): no time, and no "in unknown"
    idle = coverage_words(_coverage(eta_s=None))
    assert idle.endswith("every sample seen in: not known yet (no ingest rate measured)"), idle
    assert "about 3,000" in coverage_words(_coverage(estimated=True))  # tar: counted as fetched


def test_the_epoch_line_counts_whole_samples_and_batches_and_says_per_rank() -> None:
    line = log_line({**ROW, "coverage": _coverage()})
    assert "epoch 3: loss 0.2500, 600 samples in 10 batches, 6.1s" in line, line
    assert "cache 1.0 MiB (1,500 samples)" in line
    ddp = log_line({**ROW, "samples": 749.5, "ranks": 4, "coverage": _coverage()})
    assert "750 samples in 10 batches per rank," in ddp, ddp
    single = log_line({**ROW, "samples": 1, "batches": 1, "coverage": _coverage()})
    assert "1 sample in 1 batch," in single, single
    assert not re.search(r"\d\.\d samples|\(s\)", line + ddp + single)


def test_request_lines_count_in_words_and_per_sampler_as_the_config_does() -> None:
    base = {"gets": 0, "lists": 0, "bytes": 727040, "concurrency": 0, "pace": 0}
    assert describe_requests(base, epoch=True) == (
        "0 GETs, 0 LISTs, 710.0 KiB received (for requests sent before this epoch)")
    assert describe_requests({**base, "gets": 1, "lists": 1}).startswith("1 GET, 1 LIST, ")
    assert describe_requests({**base, "gets": 12}, local=True) == (
        "12 file reads, 0 listings, 710.0 KiB read")
    # sampler.concurrency: 32 with sampler.processes: 2
    assert describe_requests({**base, "gets": 9, "concurrency": 64, "samplers": 2}).endswith(
        ", concurrency 64 (2 samplers x 32)")
    assert describe_requests({**base, "gets": 9, "concurrency": 40, "samplers": 3}).endswith(
        ", concurrency 40 (over 3 samplers)")


@pytest.mark.parametrize(("nodes", "local", "expected"), [
    (1, 1, "in 2 batches per rank on 1 rank (it ran on 1 node of 1 rank)"),
    (2, 4, "in 2 batches per rank on 8 ranks, 4 per node (it ran on 2 nodes of 4 ranks each)"),
])
def test_a_resume_says_its_layouts_in_words(caplog: pytest.LogCaptureFixture, nodes: int,
                                            local: int, expected: str) -> None:
    groups = [NodeStates(f"lease{n}", 5, local) for n in range(nodes)]
    place = Placement(rank=0, world_size=nodes * local, local_rank=0, local_world_size=local,
                      node_rank=0, num_nodes=nodes)
    done = {"resume_continued": 1, "resume_batches": 2, "resume_fresh_ranks": 0,
            "resume_evicted": 0, "resume_left_out": 0, "resume_departed": 0,
            "resume_departed_nodes": 0}
    with caplog.at_level(logging.INFO, logger="epochcache"):
        log_resume(5, done, groups, place)
    assert f"epoch 5 resumes: 1 sample of the interrupted epoch continues {expected}" \
        in caplog.text, caplog.text


def test_format_count() -> None:
    assert [format_count(n, "batch", "batches") for n in (0, 1, 2)] == [
        "0 batches", "1 batch", "2 batches"]
    assert format_count(1499.6, "sample") == "1,500 samples"


def test_an_older_epoch_row_without_a_newer_figure_is_still_listed(tmp_path: Path) -> None:
    """A history row written before a figure existed is an epoch's all the same: ``status``
    lists it, with "-" for what it lacks (a new history field hid every older epoch)."""
    newest = [f.name for f in HISTORY if f.name not in ("epoch", "time")]
    cache = SampleStore(str(tmp_path / "cache"), capacity=1 << 20, sync=False)
    try:
        append_history(cache)  # the daemon's rows never name an epoch
        old = {"epoch": 0, "snapshot_samples": 10}  # an older version's row
        append_history(cache, old)
        append_history(cache, history_row({**dict.fromkeys(newest, 7), "epoch": 1}))
        append_history(cache)
        stats = collect_stats(cache)
    finally:
        cache.close()
    assert [row["epoch"] for row in stats["turnover"]] == [0, 1], stats["turnover"]
    console = Console(record=True, width=200)
    console.print(render(stats))
    text = console.export_text()
    cells = [[cell.strip() for cell in line.split("\u2502")[1:-1]] for line in text.splitlines()]
    older = next(row for row in cells if row[:2] == ["0", "10"])
    shown = [f for f in HISTORY if f.label]
    assert older == ["0", "10"] + ["-"] * (len(shown) - 2), text
