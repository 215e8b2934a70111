"""The README's quick start as users write it: a plain top-level script, no
``if __name__ == "__main__":`` guard, a transform defined in the script and DataLoader workers.

Workers start the platform's way (fork on Linux): a forkserver or spawn start would re-import
the script in every worker and fail in "the bootstrapping phase" (issue 20, item 2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """\
import io

import numpy as np
import epochcache as ec

cache = ec.Cache({path!r}, capacity="64MiB")
if cache.stats()["samples"] == 0:
    def npy(i):
        buf = io.BytesIO()
        np.save(buf, np.full(8, i, dtype=np.float32))
        return buf.getvalue()
    cache.put_many([(f"s{{i:04d}}.npy", npy(i)) for i in range(400)])


def my_augment(sample):
    return sample * 2


seen = 0
for epoch, loader in cache.epochs(num_epochs=3, batch_size=32, min_samples=400, seed=0,
                                  transform=my_augment, num_workers=2):
    for batch in loader:
        assert float(batch[0, 0]) % 2 == 0  # the transform ran
        seen += len(batch)
print("SEEN", seen)
"""


def test_plain_script_with_a_transform_and_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(path=str(tmp_path / "cache")))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SEEN 1200" in proc.stdout
    assert "Traceback" not in proc.stderr and "bootstrapping" not in proc.stderr, proc.stderr
