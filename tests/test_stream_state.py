"""cache.stream() state: torchdata's StatefulDataLoader and Lightning resume an epoch exactly
(issue 21, item 5).

* A StatefulDataLoader's state loaded into a new loader yields the rest of the epoch in the same
  order, with and without workers; loaded into a stream, the rest with another num_workers.
* A trainer killed with SIGKILL while a writer turns the cache over resumes from its saved state:
  every sample of the epoch once, none skipped (the lease outlived the trainer).
* A Lightning fit killed mid-epoch and resumed from its last checkpoint trains on each sample of
  that epoch once (the steps before the checkpoint, then the resumed ones).

Internals: a lease's plan (``reads.read_seqs``) shows what the resumed epoch kept.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from common.procs import spawn_script, wait_until_gone
from common.writer import Writer, fill
from torch.utils.data import DataLoader

from epochcache import Cache
from epochcache.store.reads import read_seqs

pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loader_resumes_the_epoch_in_the_same_order(tmp_path: Path,
                                                               workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    path = str(tmp_path / "c")
    fill(path, 0, 300)
    cache = Cache(path, sync=False)
    whole = [i for b in StatefulDataLoader(cache.stream(seed=1), batch_size=10,
                                           num_workers=workers) for i in _ids(b)]
    loader = StatefulDataLoader(cache.stream(seed=1), batch_size=10, num_workers=workers)
    it = iter(loader)
    first = [i for _ in range(7) for i in _ids(next(it))]
    state = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint stores it
    del it
    assert first == whole[:70]
    again = StatefulDataLoader(cache.stream(seed=1), batch_size=10, num_workers=workers)
    again.load_state_dict(state)
    assert [i for b in again for i in _ids(b)] == whole[70:]
    # Into the stream itself: the same remaining samples with any number of workers.
    stream = cache.stream(seed=1)
    stream.load_state_dict(state)
    other = 1 if workers != 1 else 2
    rest = [i for b in DataLoader(stream, batch_size=10, num_workers=other) for i in _ids(b)]
    assert sorted(rest) == sorted(whole[70:])
    # And the epoch after it is the next one, in full.
    nxt = [i for b in DataLoader(stream, batch_size=10, num_workers=other) for i in _ids(b)]
    assert sorted(nxt) == sorted(whole)
    stream.close()
    assert cache.leases() == []


def test_a_state_with_another_seed_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 50)
    cache = Cache(path, sync=False)
    stream = cache.stream(seed=1)
    it = iter(DataLoader(stream, batch_size=10))
    next(it)
    state = stream.state_dict()
    other = cache.stream(seed=2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        next(iter(DataLoader(other, batch_size=10)))
    with pytest.raises(ValueError, match="state_dict"):
        other.load_state_dict({"something": "else"})


TRAINER = """
import json, pickle, sys, time, warnings
warnings.simplefilter("ignore")
from torchdata.stateful_dataloader import StatefulDataLoader
from epochcache import Cache
cache = Cache(sys.argv[1])
# release="epoch": what the workers read ahead of the last checkpoint stays cached, so the
# resume is exact while writers turn the cache over (docs/guide/resume.md, "cache.stream()
# with StatefulDataLoader and Lightning").
loader = StatefulDataLoader(cache.stream(seed=3, release=sys.argv[3]), batch_size=10,
                            num_workers=2)
seen = []
for i, batch in enumerate(loader):
    seen.extend(int(v) for v in batch[:, 0])
    time.sleep(0.01)
    if i == 0:
        print("WORKERS", *[w.pid for w in loader._iterator._workers], flush=True)
    if i == 6:
        with open(sys.argv[2], "wb") as f:
            pickle.dump({"state": loader.state_dict(), "seen": seen}, f)
        print("CHECKPOINT", flush=True)
    if i == 10:
        print("DIE", flush=True)
        time.sleep(600)
"""


@pytest.mark.parametrize("release", ["epoch", "progressive"])
def test_sigkill_then_resume_from_the_saved_state(tmp_path: Path, release: str) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 260, capacity="100KiB", headroom="8KiB")  # full
    saved = tmp_path / "state.pkl"
    with Writer(path, start=260, per_batch=5, pause_s=0.01):  # sample id == sequence number
        trainer = spawn_script(tmp_path, "trainer", TRAINER, path, str(saved), release)
        try:
            workers = [int(pid) for pid in trainer.wait_line("WORKERS", 120).split()[1:]]
            trainer.wait_line("DIE", 120)
        finally:
            trainer.close()  # SIGKILL of the trainer alone (the OOM killer's choice)
        # Its workers see it gone and exit normally: they must not release the lease its
        # state kept for the resume (issue 26, item 4: the last one did, ~4.5 s later).
        wait_until_gone(workers, 60)
        checkpoint = pickle.loads(saved.read_bytes())
        cache = Cache(path, sync=False)
        stream = cache.stream(seed=3, release=release)
        stream.load_state_dict(checkpoint["state"])
        rest = [i for b in DataLoader(stream, batch_size=10, num_workers=2) for i in _ids(b)]
    seen = checkpoint["seen"]
    (state,) = [w["dataset_state"] for w in
                checkpoint["state"]["_snapshot"]["_worker_snapshots"].values()][:1]
    snapshot = read_seqs(cache.path, state["lease"])  # kept while the lease lives: None after
    assert len(seen) == 70 and len(set(seen + rest)) == len(seen + rest)  # none twice
    if release == "epoch":
        assert len(seen + rest) == state["count"]  # none skipped
    else:
        # The workers released what they read beyond the checkpoint (chunks and prefetched
        # batches), and the writer evicted some of it: those are skipped, nothing else is.
        epoch = set(range(state["lo"], state["hi"]))  # sample id == sequence number
        skipped = epoch - set(seen) - set(rest)
        assert len(seen + rest) + len(skipped) == state["count"]
        assert not any(cache.contains_many([f"s/{i:07d}.npy" for i in skipped]))  # evicted
    assert snapshot is None and cache.leases() == []  # released once the epoch was done
    stream.close()


LIGHTNING = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from epochcache import Cache

cache_dir, root, log_path, die_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 1)

    # Taking the iterator (no batch argument) stops Lightning from fetching a batch ahead: the
    # loader state it saves then covers exactly the batches trained on. With the default
    # fetcher the batch fetched ahead at a checkpoint is skipped on resume (torchdata #1520).
    def training_step(self, dataloader_iter):
        batch, _index, _loader = next(dataloader_iter)
        with open(log_path, "a") as f:
            f.write(json.dumps({"epoch": self.current_epoch, "step": self.global_step,
                                "ids": [int(v) for v in batch[:, 0]]}) + "\\n")
        if self.global_step == die_at:
            print("DIE", flush=True)
            time.sleep(600)
        return self.layer(torch.nan_to_num(batch)).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


cache = Cache(cache_dir)
loader = StatefulDataLoader(cache.stream(seed=0), batch_size=10, num_workers=2)
trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=root,
                    callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=5,
                                               save_top_k=-1, save_last=True)])
ckpt = root + "/last.ckpt" if die_at < 0 else None
trainer.fit(Tiny(), loader, ckpt_path=ckpt)
print("DONE", flush=True)
"""


def test_lightning_fit_killed_mid_epoch_resumes_each_sample_once(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 200)
    root, log = tmp_path / "ckpt", tmp_path / "steps.jsonl"
    first = spawn_script(tmp_path, "fit", LIGHTNING, path, str(root), str(log), "27")
    try:
        first.wait_line("DIE", 240)  # epoch 1, 7 steps in (20 steps per epoch)
    finally:
        first.close()
    steps_before = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = spawn_script(tmp_path, "resume", LIGHTNING, path, str(root), str(log), "-1")
    try:
        resumed.wait_line("DONE", 240)
    finally:
        resumed.close()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    after = rows[len(steps_before):]
    # The last checkpoint was taken after step 25 (every 5 steps): steps 25.. were redone.
    kept = [row for row in steps_before if row["epoch"] == 1 and row["step"] < 25]
    redone = [row for row in after if row["epoch"] == 1]
    assert [row["step"] for row in redone][:1] == [25]
    ids = [i for row in kept + redone for i in row["ids"]]
    assert sorted(ids) == list(range(200))  # each sample of the epoch once
