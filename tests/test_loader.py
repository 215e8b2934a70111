"""epochs(): exact-once epochs over growing snapshots, background preparation, seeding, options."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from common.writer import Writer, fill

from epochcache import Cache, PrepareFailed
from epochcache.data.schedule import epoch_order


def _ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _info_or_none(cache: Cache, seq: int) -> Any:
    try:
        return cache.info(seq)
    except KeyError:
        return None


@pytest.mark.parametrize("workers", [2, 0])  # 0: planned inline, in the training thread
def test_three_epochs_with_workers_while_a_writer_inserts_and_evicts(tmp_path: Path,
                                                                     workers: int) -> None:
    path = str(tmp_path / "c")
    # ~380 B records: 400 KiB keeps ~1075 samples, so the writer forces eviction; the large
    # headroom keeps it from waiting (back-pressure) on the two leases of epochs k and k+1.
    fill(path, 0, 1000, capacity="400KiB", headroom="16MiB")
    cache = Cache(path, sync=False)
    delivered: list[list[int]] = []
    snapshots: list[np.ndarray] = []
    with Writer(path, start=1000, per_batch=20, pause_s=0.01):
        context = {"multiprocessing_context": "spawn"} if workers else {}
        for epoch, loader in cache.epochs(3, batch_size=50, num_workers=workers, **context):
            ids = []
            for batch in loader:
                ids.extend(_ids(batch))
                time.sleep(0.06)  # a training step: the writer gets to run
            delivered.append(ids)
            seqs = loader.dataset.seqs.copy()
            snapshots.append(seqs)
            assert len(loader) == -(-len(loader.dataset) // 50), epoch
            # The snapshot's own keys are what was delivered (those not evicted yet: delivered
            # samples are released as the epoch goes, progressive release).
            keys = {int(info.key[2:9]) for s in seqs[:: max(1, len(seqs) // 25)]
                    if (info := _info_or_none(cache, int(s))) is not None}
            assert keys <= set(ids)
    assert cache.counters().evicted > 0
    for ids, seqs in zip(delivered, snapshots):
        # Exactly once: the sample ids delivered are the snapshot's, without repeats.
        assert len(ids) == len(set(ids)) == len(seqs)
    # Each epoch sees samples added during the previous one.
    assert max(delivered[1]) > max(delivered[0]) and max(delivered[2]) > max(delivered[1])
    assert cache.leases() == []


def test_same_seed_same_order_and_epochs_differ(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 200)
    cache = Cache(tmp_path / "c", sync=False)

    def run(seed: int) -> list[list[int]]:
        return [[i for b in loader for i in _ids(b)] for _e, loader in
                cache.epochs(2, batch_size=16, seed=seed)]

    first, again, other = run(1), run(1), run(2)
    assert first == again and first != other and first[0] != first[1]
    assert sorted(first[0]) == list(range(200))
    seqs = np.arange(10, dtype=np.uint64)
    np.testing.assert_array_equal(epoch_order(seqs, 3, seed=5), epoch_order(seqs, 3, seed=5))


def test_samples_per_epoch_resamples_a_small_cache(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 30)
    cache = Cache(tmp_path / "c", sync=False)
    for _epoch, loader in cache.epochs(2, samples_per_epoch=100, batch_size=25):
        ids = [i for b in loader for i in _ids(b)]
        assert len(ids) == 100 and len(loader) == 4
        counts = np.bincount(ids, minlength=30)
        assert counts.min() >= 3 and counts.max() <= 4  # whole permutations, not iid draws


@pytest.mark.parametrize("context", ["spawn", pytest.param("fork", marks=pytest.mark.slow)])
def test_user_collate_and_transform_with_workers(tmp_path: Path, context: str) -> None:
    # fork is marked slow: once, in a full run, its workers timed out (not reproduced alone).
    fill(str(tmp_path / "c"), 0, 64)
    cache = Cache(tmp_path / "c", sync=False)
    for _epoch, loader in cache.epochs(1, batch_size=8, transform=_double, num_workers=2,
                                       collate_fn=_count_collate, drop_last=True, timeout=60,
                                       pin_memory=False, prefetch_factor=2,
                                       multiprocessing_context=context):
        assert list(loader) == [8] * 8


_NO_ACCELERATOR = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")


@pytest.mark.parametrize("pin_memory", [False, pytest.param(True, marks=_NO_ACCELERATOR)])
def test_in_process_epochs_deliver_every_sample_with_or_without_pinning(tmp_path: Path,
                                                                     pin_memory: bool) -> None:
    # In process, batches come from epochcache's own loop unless pinning is asked for, which
    # goes through DataLoader's iterator (on a machine without an accelerator it pins nothing).
    fill(str(tmp_path / "c"), 0, 70, floats=1024)  # raw 4 KiB arrays: the fast path
    cache = Cache(tmp_path / "c", sync=False)
    for _epoch, loader in cache.epochs(2, batch_size=16, pin_memory=pin_memory,
                                       collate_fn=None):
        batches = list(loader)
        assert [len(b) for b in batches] == [16, 16, 16, 16, 6]
        assert sorted(i for b in batches for i in _ids(b)) == list(range(70))


@pytest.mark.parametrize("pin_memory", [False, pytest.param(True, marks=_NO_ACCELERATOR)])
def test_a_timeout_without_workers_is_refused_with_or_without_pinning(tmp_path: Path,
                                                                      pin_memory: bool) -> None:
    # torch's timeout is for batches from workers: with pinned batches (a GPU) epoch 0 failed
    # with PrepareFailed (torch asserts timeout == 0 in process), on the CPU it was ignored.
    fill(str(tmp_path / "c"), 0, 20)
    cache = Cache(tmp_path / "c", sync=False)
    for workers in ({}, {"num_workers": 0}):
        with pytest.raises(ValueError, match=r"timeout=5.*num_workers > 0"):
            cache.epochs(1, batch_size=5, timeout=5, pin_memory=pin_memory, **workers)
    assert cache.leases() == []  # nothing was started
    for _epoch, loader in cache.epochs(1, batch_size=5, timeout=60, num_workers=1,
                                       pin_memory=pin_memory):
        assert sum(len(batch) for batch in loader) == 20


def _double(x: np.ndarray) -> np.ndarray:
    return np.concatenate([x, x])  # no float arithmetic: the random bits include NaNs


def _count_collate(samples: list[np.ndarray]) -> int:
    return len(samples)


def test_background_failure_is_reraised_from_its_cause(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 20)
    cache = Cache(tmp_path / "c", sync=False)
    store = cache  # what epochs() takes its snapshots from
    original = store.snapshot

    calls = []

    def failing_snapshot(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk on fire")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    store.snapshot = failing_snapshot  # type: ignore[method-assign]
    with pytest.raises(PrepareFailed, match="epoch 1") as info:
        for _epoch, loader in cache.epochs(3, batch_size=5):
            list(loader)
    assert isinstance(info.value.__cause__, OSError)
    assert cache.leases() == []


_CTRL_C_LOOP = """
import os, sys, time
from epochcache import Cache

go = os.environ["MARKS"]


def init(worker_id):
    # The second loader's worker (epoch 1's, started while epoch 0 runs) takes its time,
    # so the loop waits for epoch 1 to be prepared.
    try:
        os.open(os.path.join(go, "first"), os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        open(os.path.join(go, "preparing"), "w").close()
        time.sleep(120)


cache = Cache(sys.argv[1])
try:
    for epoch, loader in cache.epochs(3, batch_size=5, num_workers=1, worker_init_fn=init):
        for batch in loader:
            pass
        print(f"EPOCH {epoch} DONE", flush=True)
except KeyboardInterrupt:
    print("KEYBOARDINTERRUPT", flush=True)
    sys.exit(130)
except BaseException as exc:
    print(f"OTHER {type(exc).__name__}: {exc}", flush=True)
    sys.exit(1)
"""


def test_ctrl_c_while_the_next_epoch_is_prepared_is_a_keyboard_interrupt(
        tmp_path: Path) -> None:
    """A real Ctrl-C (SIGINT to the process group, workers included) while a plain epochs()
    loop waits for its next epoch to be prepared reaches the loop as KeyboardInterrupt, with
    the leases released (issue 36, item 5: it was PrepareFailed, from the KeyboardInterrupt
    raised in the wait)."""
    from common.procs import spawn_script

    fill(str(tmp_path / "c"), 0, 40)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = spawn_script(tmp_path, "ctrl_c_loop", _CTRL_C_LOOP, str(tmp_path / "c"),
                        env={"MARKS": str(marks)})
    try:
        proc.wait_line("EPOCH 0 DONE", timeout_s=120)
        deadline = time.monotonic() + 60
        while not (marks / "preparing").exists():  # epoch 1's worker in its start-up
            assert time.monotonic() < deadline, "epoch 1's worker never started"
            time.sleep(0.05)
        time.sleep(0.3)  # the loop is in its wait for epoch 1 (nothing else is left to do)
        os.kill(proc.pid, signal.SIGINT)
        for child in _children(proc.pid):
            os.kill(child, signal.SIGINT)  # a terminal signals the whole foreground group
        line = proc.wait_line("", timeout_s=60)
        while not line.startswith(("KEYBOARDINTERRUPT", "OTHER")):
            line = proc.wait_line("", timeout_s=60)
        assert line == "KEYBOARDINTERRUPT", f"{line}\n{proc.stderr()}"
        assert proc.wait(60) == 130
    finally:
        proc.close()
    cache = Cache(tmp_path / "c", readonly=True)
    try:
        assert cache.leases() == []
    finally:
        cache.close()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a loop's DataLoader workers)."""
    from common.procs import all_procs

    return [child for child, stat in all_procs().items() if stat.ppid == pid]


def test_waits_for_min_samples_then_times_out_clearly(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 5)
    cache = Cache(tmp_path / "c", sync=False)
    with pytest.raises(TimeoutError, match="min_samples=50"):
        next(iter(cache.epochs(1, min_samples=50, wait_timeout_s=0.3)))
    with Writer(str(tmp_path / "c"), start=5, per_batch=10, pause_s=0.01):
        for _epoch, loader in cache.epochs(1, min_samples=50, wait_timeout_s=60):
            assert len(loader.dataset) >= 50


def test_invalid_arguments_are_named(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 5)
    cache = Cache(tmp_path / "c", sync=False)
    with pytest.raises(ValueError, match="batch_size"):
        cache.epochs(1, batch_size=0)
    with pytest.raises(ValueError, match="shuffle"):
        cache.epochs(1, sampler=None)
    with pytest.raises(ValueError, match="samples_per_epoch"):
        cache.epochs(1, samples_per_epoch=0)


def test_breaking_out_releases_every_lease(tmp_path: Path) -> None:
    fill(str(tmp_path / "c"), 0, 100)
    cache = Cache(tmp_path / "c", sync=False)
    gen = cache.epochs(5, batch_size=10)
    for _epoch, loader in gen:
        next(iter(loader))
        break
    gen.close()  # type: ignore[attr-defined]
    assert cache.leases() == []


def test_min_samples_beyond_capacity_fails_instead_of_waiting_forever(tmp_path: Path) -> None:
    """A cache that starts evicting before min_samples are cached can never reach them."""
    import threading

    from epochcache.data.schedule import wait_for_samples

    cache = Cache(tmp_path / "small", capacity="64KiB", headroom=0.0)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            cache.put(f"w{i}", os.urandom(4096))
            i += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        with pytest.raises(ValueError, match="min_samples=1000 cannot be reached"):
            wait_for_samples(cache, 1000, timeout_s=30, poll_s=0.05)
    finally:
        stop.set()
        thread.join()
        cache.close()


def _draws(_x: np.ndarray) -> tuple[int, int, int]:
    import random

    return (int(np.random.randint(2**62)), random.getrandbits(62),
            int(torch.randint(2**62, (1,))))


def _rank_draws(cache: Cache, monkeypatch: pytest.MonkeyPatch, rank: int) -> list[tuple[int, ...]]:
    # Where a rank sits is read from torchrun's variables (no process group is needed to
    # seed the workers): two ranks of one node, each reading its half of the snapshot.
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    draws = []
    for _epoch, loader in cache.epochs(2, batch_size=4, num_workers=2, transform=_draws,
                                       collate_fn=list, seed=7, timeout=60):
        draws += [d for batch in loader for d in batch]
    return draws


def test_worker_seeds_differ_across_ranks_and_repeat_for_a_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fill(str(tmp_path / "c"), 0, 32)
    cache = Cache(tmp_path / "c", sync=False)
    rank0, rank1 = (_rank_draws(cache, monkeypatch, r) for r in (0, 1))
    assert len(rank0) == len(rank1) == 32  # 16 samples per rank and epoch
    for name, i in (("numpy", 0), ("random", 1), ("torch", 2)):
        # Identical draws on every rank would give every rank the same augmentations.
        assert not {d[i] for d in rank0} & {d[i] for d in rank1}, name
    assert _rank_draws(cache, monkeypatch, 0) == rank0  # same seed and rank: same draws


def test_next_snapshot_is_taken_near_the_end_of_an_epoch_with_prefetching_workers(
        tmp_path: Path) -> None:
    """With workers, an epoch's first batches wait in the prefetch queue: the time to the first
    one is no batch gap. Taken as one, it made the next epoch's snapshot (and its lease) start
    at the beginning of the epoch, so a full cache turned over only every other epoch."""
    path = str(tmp_path / "c")
    fill(path, 0, 400)
    cache = Cache(path, sync=False)
    seen: dict[int, list[str]] = {}
    for epoch, loader in cache.epochs(3, batch_size=10, num_workers=1):
        for i, _batch in enumerate(loader):
            time.sleep(0.03)  # a training step
            if i == 20:  # half-way through the epoch's 40 batches (~1.2 s)
                seen[epoch] = sorted(lease.label for lease in cache.leases())
    for epoch in (1, 2):
        assert seen[epoch] == [f"epochs() epoch {epoch}"], seen


def _run_config(path: str, **loader: object) -> dict[str, object]:
    """What a run with this ``loader:`` section gives epochs(), as its keywords."""
    from epochcache.config import parse_config
    from epochcache.run.job import _loader_options

    config = parse_config({"source": {"url": "file:///nowhere"},
                           "cache": {"dir": path, "capacity": "1GiB"},
                           "loader": {"batch_size": 8, **loader},
                           "train": {"min_samples": 0}})
    values = (config.epoch_options(), _loader_options(config))
    kwargs = {f.name: getattr(v, f.name) for v in values for f in dataclasses.fields(v)
              if f.name != "collate_fn"}  # (the tests give their own)
    dataloader = kwargs.pop("dataloader")
    return {**kwargs, **dataloader, "options": config.loader.reader_options()}


def _pid(_x: np.ndarray) -> int:
    return os.getpid()


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers_of_a_run_config_mean_what_they_say(tmp_path: Path,
                                                               persistent: bool) -> None:
    """``loader.persistent_workers: false`` reached epochs() as None, its default: True."""
    path = str(tmp_path / "c")
    fill(path, 0, 32)
    cache = Cache(path, sync=False)
    kwargs = _run_config(path, num_workers=1, persistent_workers=persistent)
    pids = []
    for _epoch, loader in cache.epochs(3 if persistent else 2, transform=_pid, collate_fn=list,
                                       **kwargs):
        pids.append({pid for batch in loader for pid in batch})
    if persistent:  # two loaders alternate: epochs 0 and 2 share their worker
        assert pids[0] == pids[2], pids
    else:  # a fresh worker every epoch
        assert not pids[0] & pids[1], pids


def test_one_num_workers_default_for_runs_and_the_api(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The run config's default was 2 workers, epochs()' 0 (without a transform): one default,
    resolved by epochs() in both cases."""
    from epochcache.data.epochs import default_num_workers

    path = str(tmp_path / "c")
    fill(path, 0, 16)
    cache = Cache(path, sync=False)
    kwargs = _run_config(path)
    assert kwargs["num_workers"] is None  # the run leaves the choice to epochs()
    for _epoch, loader in cache.epochs(1, **kwargs):
        assert loader.loader.num_workers == 0 == default_num_workers(None, 1)
        list(loader)
    cores = len(os.sched_getaffinity(0))
    assert default_num_workers(_pid, 1) == cores
    # Under DDP the ranks of a node share its cores: cores // local world size each, at least 1.
    assert default_num_workers(_pid, 2) == max(1, cores // 2)
    assert default_num_workers(_pid, 4 * cores) == 1


@pytest.mark.parametrize("floats", [256, 16384])  # 1 KiB and 64 KiB samples
def test_worker_batches_are_the_in_process_batches(tmp_path: Path, floats: int) -> None:
    # Batches from the workers' rings (data/ring.py): the trainer gets the same writable
    # tensors as in process, a field named twice as one tensor twice.
    from common.writer import npy_bytes, sample_array

    cache = Cache(tmp_path / "c", "64MiB", sync=False)
    cache.put_many([(f"s/{i:07d}.npy", npy_bytes(sample_array(i, floats))) for i in range(40)])
    got: dict[int, list[bytes]] = {}
    for workers in (0, 2):
        got[workers] = []
        for _epoch, loader in cache.epochs(1, batch_size=16, num_workers=workers, seed=3,
                                           fields=("npy", "npy")):
            for first, second in loader:
                assert first is second and isinstance(first, torch.Tensor)
                assert first.shape[1:] == (floats,) and first.dtype == torch.float32
                got[workers].append(first.numpy().tobytes())
                first.add_(1)  # a batch is the trainer's to change
    assert got[0] == got[2] and len(got[0]) == 3
