"""The batch ring (data/ring.py): epochs()' workers reuse their shared batch buffers, and a
buffer is written again only once nothing in the trainer refers to its batch."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import torch
from common.writer import npy_bytes, sample_array

from epochcache import Cache
from epochcache.data import ring

FLOATS = 16384  # 64 KiB samples: batches of 8 are 512 KiB, above the pipe's 256 KiB


def _cache(path: Path, count: int, zeros_every: int = 0) -> Cache:
    """``count`` raw .npy samples; with ``zeros_every``, every such sample is an all-zero
    array instead, which the cache stores compressed (so its batch takes the general path)."""
    cache = Cache(path, "64MiB", sync=False)
    cache.put_many([(f"s/{i:07d}.npy",
                     npy_bytes(np.zeros(FLOATS, np.float32) if zeros_every and i % zeros_every == 3
                               else sample_array(i, FLOATS)))
                    for i in range(count)])
    return cache


def _mapped_file(address: int) -> tuple[str, int]:
    """The file (path, inode) mapped at ``address`` in this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return (fields[5].strip() if len(fields) > 5 else ""), int(fields[4])
    raise AssertionError(f"nothing mapped at {address:#x}")


def _in_process(cache: Cache, **kwargs: object) -> list[bytes]:
    got = []
    for _epoch, loader in cache.epochs(1, batch_size=8, num_workers=0, seed=5, **kwargs):
        got.extend(batch.numpy().tobytes() for batch in loader)
    return got


def test_workers_write_batches_into_the_same_shared_buffers(tmp_path: Path) -> None:
    """An epoch of 40 batches from 2 workers, each batch dropped by the loop: every batch is
    the in-process one, and they all live in a few shared-memory files (a new file per batch
    before the ring). Every fifth batch has a compressed sample: its raw read is abandoned
    after taking a buffer (the general path reads it), and that buffer is freed too."""
    cache = _cache(tmp_path / "c", 320, zeros_every=40)
    expected = _in_process(cache)
    files, got = set(), []
    for _epoch, loader in cache.epochs(1, batch_size=8, num_workers=2, seed=5):
        for batch in loader:
            got.append(batch.numpy().tobytes())
            name, inode = _mapped_file(batch.data_ptr())
            assert "/dev/shm/" in name, name
            files.add(inode)
    assert got == expected and len(got) == 40
    # 2 workers, each with up to prefetch_factor (2) batches queued, one in the loop's hands,
    # one being written, and one abandoned read per fifth batch
    assert len(files) <= 2 * 5, len(files)
    gc.collect()
    assert not ring._received  # epochs() unmapped the rings of its exited workers


def test_batches_the_loop_keeps_are_never_written_again(tmp_path: Path) -> None:
    """Kept batches stay as they were delivered while the workers go on (past the ring's
    bound: the rest are allocated the usual way); dropped ones are written again."""
    cache = _cache(tmp_path / "c", 480)
    expected = _in_process(cache)
    kept: dict[int, torch.Tensor] = {}
    changed: dict[int, bytes] = {}
    for _epoch, loader in cache.epochs(1, batch_size=8, num_workers=2, seed=5):
        for index, batch in enumerate(loader):
            assert batch.numpy().tobytes() == expected[index]
            batch.add_(1)  # a batch is the loop's to change, kept or not
            if index % 3 == 0 or index >= 30:  # the last 30: more than the ring holds
                kept[index], changed[index] = batch, batch.numpy().tobytes()
    assert len(kept) == 40
    for index, batch in kept.items():
        assert batch.numpy().tobytes() == changed[index], index


def test_a_batch_dropped_in_a_forked_child_is_not_freed_for_its_parent(tmp_path: Path) -> None:
    """A batch inherited through fork and dropped in the child (its Python objects die
    there) still belongs to the parent: the worker must not write over it."""
    cache = _cache(tmp_path / "c", 320)
    expected = _in_process(cache)
    held: torch.Tensor | None = None
    for _epoch, loader in cache.epochs(1, batch_size=8, num_workers=2, seed=5):
        for index, batch in enumerate(loader):
            if index == 0:
                held = batch
            if index == 1:  # (the loader no longer refers to batch 0)
                pid = os.fork()
                if pid == 0:  # the child: drop its copy of batch 0, collect, exit
                    code = 0
                    try:
                        del held
                        gc.collect()
                    except BaseException:
                        code = 1
                    os._exit(code)
                assert os.waitpid(pid, 0)[1] == 0
    assert held is not None and held.numpy().tobytes() == expected[0]
