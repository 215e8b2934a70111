"""A small tmpfs mounted for one test: a real disk that fills (``ENOSPC`` from the kernel)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str = "8m") -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``mnt`` (created) for the block; skip the test where that
    is not allowed (mounting needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
