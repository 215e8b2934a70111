"""Invariant 7: DataLoader worker RSS stays flat across epochs (a generous bound; bench has the figure)."""

from __future__ import annotations

from pathlib import Path

from common.writer import fill

from epochcache import Cache


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _worker_pids(loader: object) -> list[int]:
    iterator = getattr(loader.loader, "_iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", [])]


def test_worker_rss_flat_over_ten_epochs(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 3000, floats=256)
    cache = Cache(tmp_path / "c", sync=False)
    per_epoch: list[dict[int, int]] = []
    for _epoch, loader in cache.epochs(10, batch_size=64, num_workers=2, transform=_identity,
                                       multiprocessing_context="spawn"):
        for _batch in loader:
            pass
        per_epoch.append({pid: rss_kib(pid) for pid in _worker_pids(loader)})
    # Persistent workers: the two alternating loaders keep the same processes all along.
    assert per_epoch[2].keys() == per_epoch[8].keys() and len(per_epoch[2]) == 2
    assert per_epoch[3].keys() == per_epoch[9].keys()
    for early, late in ((per_epoch[2], per_epoch[8]), (per_epoch[3], per_epoch[9])):
        for pid, kib in early.items():
            assert late[pid] <= kib * 1.25 + 4096, (pid, kib, late[pid])


def _identity(x: object) -> object:
    return x
