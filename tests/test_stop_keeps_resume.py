"""An orderly stop keeps the epoch a checkpoint named, as a kill does (issue 26, item 3).

The events: a scheduler's SIGTERM, Ctrl-C, ``stream.close()`` or a plain exit of the process
after the loop took its loader's state. Each released the lease that the state had kept for a
resume, so the resumed job found it gone and retrained the interrupted epoch from its start on
a new snapshot (or a stream skipped the rest of the epoch). Here each stop is followed by a
writer turning the cache over, then the resume must yield exactly the rest of the epoch; and
when a lease is gone for good, the resume's warning says why.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from common.procs import spawn_script
from common.writer import fill
from torch.utils.data import DataLoader

from epochcache import Cache

pytestmark = [  # torchdata's
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


def _turn_over(path: str, start: int, count: int = 40) -> None:
    """A writer adds samples to the full cache: the oldest that no lease protects go (had the
    stop released the epoch's lease, the epoch's own samples)."""
    fill(path, start, count, capacity="60KiB", headroom="4KiB")


def _id(cache: Cache, seq: Any) -> int:
    return int(cache.info(int(seq)).key.split("/")[-1].split(".")[0])


def _full_cache(path: str) -> Cache:
    fill(path, 0, 200, capacity="60KiB", headroom="4KiB")
    return Cache(path, sync=False)


def test_epochs_closed_after_a_state_resumes_exactly(tmp_path: Path) -> None:
    """A user loop takes the loader's state at a checkpoint, then stops (Ctrl-C caught, or
    any exception): the generator is closed mid-epoch."""
    path = str(tmp_path / "c")
    cache = _full_cache(path)
    epochs = cache.epochs(2, batch_size=10, seed=5, resume_grace_s=600)
    seen: list[int] = []
    for _epoch, loader in epochs:
        order = [_id(cache, s) for s in loader.seqs]
        for i, batch in enumerate(loader):
            seen.extend(_ids(batch))
            if i == 5:
                state = pickle.loads(pickle.dumps(loader.state_dict()))
                break
        break
    epochs.close()  # what a KeyboardInterrupt through the loop does
    lease = {x.lease_id: x for x in cache.leases()}.get(state["lease"])
    assert lease is not None and lease.pid == 0  # left for the resume, held by nobody
    _turn_over(path, 1000)
    rest: list[int] = []
    for _epoch, loader in cache.epochs(1, batch_size=10, seed=5, resume=state):
        rest = [i for batch in loader for i in _ids(batch)]
    assert seen + rest == order  # none again, none skipped, in the epoch's order
    assert cache.leases() == []


SIGTERMED = """
import pickle, sys, time
from epochcache import Cache
cache = Cache(sys.argv[1])
for epoch, loader in cache.epochs(2, batch_size=10, seed=5, resume_grace_s=600):
    seen = []
    for i, batch in enumerate(loader):
        seen.extend(int(v) for v in batch[:, 0])
        if i == 5:
            order = [int(cache.info(int(s)).key.split("/")[-1][:-4]) for s in loader.seqs]
            with open(sys.argv[2], "wb") as f:
                pickle.dump({"state": loader.state_dict(), "seen": seen, "order": order}, f)
            print("CHECKPOINT", flush=True)
            time.sleep(600)  # a training step when the scheduler's SIGTERM comes
"""


def test_epochs_ended_by_sigterm_after_a_state_resumes_exactly(tmp_path: Path) -> None:
    """A plain script (Python's default SIGTERM action: the process ends at once)."""
    path = str(tmp_path / "c")
    cache = _full_cache(path)
    saved = tmp_path / "state.pkl"
    trainer = spawn_script(tmp_path, "trainer", SIGTERMED, path, str(saved))
    try:
        trainer.wait_line("CHECKPOINT", 120)
        trainer.popen.send_signal(signal.SIGTERM)
        assert trainer.wait(60) == -signal.SIGTERM
    finally:
        trainer.close()
    checkpoint = pickle.loads(saved.read_bytes())
    _turn_over(path, 1000)
    rest: list[int] = []
    for _epoch, loader in cache.epochs(1, batch_size=10, seed=5, resume=checkpoint["state"]):
        rest = [i for batch in loader for i in _ids(batch)]
    assert checkpoint["seen"] + rest == checkpoint["order"]


def test_a_stream_closed_after_a_state_resumes_exactly(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    path = str(tmp_path / "c")
    cache = _full_cache(path)
    whole = [i for b in DataLoader(cache.stream(seed=2), batch_size=8) for i in _ids(b)]
    stream = cache.stream(seed=2)
    loader = StatefulDataLoader(stream, batch_size=8)
    it = iter(loader)
    # 64 samples: two whole chunks of 32 read and released, none after the state.
    seen = [i for _ in range(8) for i in _ids(next(it))]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    del it
    stream.close()  # the job stops in order
    _turn_over(path, 1000)
    again = cache.stream(seed=2)
    again.load_state_dict(state)
    rest = [i for b in DataLoader(again, batch_size=8) for i in _ids(b)]
    assert seen + rest == whole[: len(seen) + len(rest)] and len(seen + rest) == len(whole)
    again.close()
    assert cache.leases() == []


def test_a_resume_whose_lease_ran_out_says_why(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "c")
    cache = _full_cache(path)
    epochs = cache.epochs(1, batch_size=10, resume_grace_s=0.5)
    for _epoch, loader in epochs:
        next(iter(loader))
        state = loader.state_dict()
        break
    epochs.close()
    time.sleep(1.0)  # longer than the grace
    _turn_over(path, 1000, 20)  # a writer reclaims the lease that ran out
    with caplog.at_level(logging.WARNING, logger="epochcache"):
        for _epoch, _loader in cache.epochs(1, batch_size=10, resume=state):
            pass
    assert "longer than the resume grace" in caplog.text, caplog.text
    assert "cache.resume_grace_s" in caplog.text
