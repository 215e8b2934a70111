"""cache.stream() resumed with another number of DataLoader workers (issue 28, item 1).

A StatefulDataLoader's whole state loaded into the stream and read with more workers than
wrote it yields the rest of the interrupted epoch, each sample once; the pass after it is the
next epoch, whole, each sample once, whatever the number of workers of the loaders that
follow. On 0a8011a that pass read 163 samples of which 129 distinct: every later loader's
workers received the loaded state again (the main process's copy of the stream still held
it) and some of them resumed the old epoch a second time.

Under torch.distributed a stream's epoch cannot be resumed: the refusal says what to do.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from common.writer import fill
from torch.utils.data import DataLoader

from epochcache import Cache

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # three workers on a two-core machine: torch's advice, not a fault
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _epoch(stream: Any, workers: int) -> list[int]:
    return [i for b in DataLoader(stream, batch_size=10, num_workers=workers) for i in _ids(b)]


def test_two_workers_to_three_the_rest_then_whole_next_epochs(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    path = str(tmp_path / "c")
    fill(path, 0, 168)
    cache = Cache(path, sync=False)
    loader = StatefulDataLoader(cache.stream(seed=1), batch_size=10, num_workers=2)
    it = iter(loader)
    first = [i for _ in range(5) for i in _ids(next(it))]
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint stores it
    del it, loader

    stream = cache.stream(seed=1)
    stream.load_state_dict(state)
    rest = _epoch(stream, 3)
    # The rest of epoch 0: with what was read before, every sample once.
    assert len(first) == 50
    assert sorted(first + rest) == list(range(168))
    # The pass after it is epoch 1, whole, each sample once; and so is the one after that,
    # with a plain loader of another number of workers.
    for workers in (3, 2):
        after = _epoch(stream, workers)
        assert sorted(after) == list(range(168)), (workers, len(after), len(set(after)))
    stream.close()
    assert cache.leases() == []  # none left behind (a second resume of epoch 0 leaked one)
    cache.close()


def test_a_resumed_stream_under_ddp_is_refused_saying_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 50)
    cache = Cache(path, sync=False)
    stream = cache.stream(seed=1)
    it = iter(DataLoader(stream, batch_size=10))
    next(it)
    state = stream.state_dict()
    del it
    stream.close()
    # A rank of a two-rank torchrun job (the environment is what detect_placement() reads).
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    other = cache.stream(seed=1)
    with pytest.raises(ValueError, match=r"set_epoch\(1\)") as failed:
        other.load_state_dict(state)
    assert "epochs(resume=" in str(failed.value)
    other.close()
    cache.close()


_SAVE_AND_WAIT = """
import pickle, sys, warnings
warnings.simplefilter("ignore")
from torchdata.stateful_dataloader import StatefulDataLoader
from epochcache import Cache

cache = Cache(sys.argv[1])
loader = StatefulDataLoader(cache.stream(seed=1), batch_size=10, num_workers=2)
it = iter(loader)
ids = [int(v) for _ in range(5) for v in next(it)[:, 0]]
with open(sys.argv[2], "wb") as f:
    pickle.dump({"loader": loader.state_dict(), "ids": ids}, f)
print("SAVED", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_loader_resumed_with_other_workers_says_what_to_do(tmp_path: Path) -> None:
    """A job with StatefulDataLoader(cache.stream(), num_workers=2) saves its state mid-epoch
    and is killed (SIGKILL); the state loaded whole into a StatefulDataLoader with 3 workers
    cannot go on (torchdata gives each worker its own state and resumes only with the
    num_workers that saved it): the error names both numbers and the way that works, which
    then yields the rest of the epoch. On 3c6d3cb the workers said "the state has no position
    for readers [1] of 2 ... load the whole StatefulDataLoader state_dict() into the stream"
    (issue 33, item 5), though the whole state was loaded."""
    from common.procs import REPO, Job
    from torchdata.stateful_dataloader import StatefulDataLoader

    path = str(tmp_path / "c")
    fill(path, 0, 120)
    saved = tmp_path / "state.pkl"
    script = tmp_path / "save_and_wait.py"
    script.write_text(_SAVE_AND_WAIT)
    job = Job([sys.executable, str(script), path, str(saved)], stdin=subprocess.PIPE,
              stdout=subprocess.PIPE, text=True, cwd=tmp_path,
              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert job.popen.stdout is not None
        line = job.popen.stdout.readline()  # blocks until SAVED, or the end of a failed job
        assert line.strip() == "SAVED", f"the job exited {job.popen.wait()} before saving"
    finally:
        job.kill()  # every process of it, its DataLoader workers too (a node failure)
    checkpoint = pickle.loads(saved.read_bytes())
    cache = Cache(path, sync=False)
    stream = cache.stream(seed=1)
    loader = StatefulDataLoader(stream, batch_size=10, num_workers=3)
    loader.load_state_dict(checkpoint["loader"])
    with pytest.raises(ValueError, match="num_workers=2") as failed:
        list(loader)
    message = str(failed.value)
    assert "num_workers=3" in message and "stream.load_state_dict" in message, message
    _shut_down_half_built(failed.value)
    del failed, loader
    stream.close()

    stream = cache.stream(seed=1)
    stream.load_state_dict(checkpoint["loader"])  # the way the message gives
    rest = _epoch(stream, 3)
    assert sorted(checkpoint["ids"] + rest) == list(range(120))
    stream.close()
    cache.close()


def _shut_down_half_built(error: BaseException) -> None:
    """A loader iterator that failed in its constructor is held by the error's traceback
    only, its workers with it: shut them down now (the garbage collector's way waited 5 s a
    worker)."""
    tb = error.__traceback__
    while tb is not None:
        iterator = tb.tb_frame.f_locals.get("self")
        if hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            return
        tb = tb.tb_next
