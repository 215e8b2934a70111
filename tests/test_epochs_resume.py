"""epochs(resume=state): an epoch interrupted by SIGKILL continues on the same snapshot, in the
same order, from the sample after the checkpointed position, while a writer keeps turning the
cache over (issue 21, items 4 and 5). The trainer releases only what its checkpoint covered,
so nothing after the position can have been evicted."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from common.procs import kill_job, spawn_script
from common.writer import Writer, fill

from epochcache import Cache

TRAINER = """
import json, sys, time
from epochcache import Cache
cache = Cache(sys.argv[1])
out = sys.argv[2]
for epoch, loader in cache.epochs(3, batch_size=10, seed=7, num_workers=int(sys.argv[3])):
    loader.release_as_consumed = False  # release what checkpoints cover only
    seen = []
    for i, batch in enumerate(loader):
        seen.extend(int(v) for v in batch[:, 0])
        time.sleep(0.01)
        if epoch == 1 and i == 6:  # a checkpoint after 7 batches
            state = loader.state_dict()
            loader.keep_for_resume(600.0)
            loader.release(state["batches"])
            json.dump({"state": state, "seen": seen, "order": [int(s) for s in loader.seqs]},
                      open(out, "w"))
            print("CHECKPOINT", flush=True)
        if epoch == 1 and i == 9:
            print("DIE", flush=True)  # killed here: three batches after the checkpoint
            time.sleep(600)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_sigkill_mid_epoch_then_resume_exactly(tmp_path: Path, workers: int) -> None:
    path = str(tmp_path / "c")
    # ~380 B records: 100 KiB holds ~270 samples; a small headroom, so writers evict what
    # they can while the epoch runs and after the trainer died.
    fill(path, 0, 260, capacity="100KiB", headroom="8KiB")
    out = tmp_path / "checkpoint.json"
    with Writer(path, start=260, per_batch=5, pause_s=0.01):  # sample id == sequence number
        trainer = spawn_script(tmp_path, "trainer", TRAINER, path, str(out), str(workers))
        try:
            trainer.wait_line("DIE", 120)
        finally:
            kill_job(trainer)  # SIGKILL of the whole trainer, its DataLoader workers too
            trainer.close()
        time.sleep(1.0)  # the writer keeps evicting what nothing protects
        saved: dict[str, Any] = json.loads(out.read_text())
        cache = Cache(path, sync=False)
        rest: list[int] = []
        epochs = []
        for epoch, loader in cache.epochs(1, batch_size=10, seed=7, resume=saved["state"]):
            epochs.append(epoch)
            rest.extend(int(v) for batch in loader for v in batch[:, 0])
    assert epochs == [1]
    order, seen = saved["order"], saved["seen"]
    position = saved["state"]["position"]
    assert position == 70 and seen == order[:70]
    # Exactly the samples after the checkpoint, in the same order: none again, none skipped.
    assert rest == order[70:]
    assert cache.leases() == []
    cache.close()


def test_resume_refuses_another_order(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 50)
    cache = Cache(path, sync=False)
    for _epoch, loader in cache.epochs(1, batch_size=10, seed=1):
        for _batch in loader:
            state = loader.state_dict()
            break
    with pytest.raises(ValueError, match="seed"):
        cache.epochs(1, batch_size=10, seed=2, resume=state)
    cache.close()
