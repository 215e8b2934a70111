"""A Google Cloud Storage emulator (``gcp-storage-emulator``, from PyPI) in its own process.

It serves GCS's JSON API (listing, media downloads with ``Range``, uploads) on 127.0.0.1 and
keeps objects in a directory on disk, so that an outage is a real one: SIGKILL the process and
every connection dies at once; start it again on the same port and the same objects are there.
gcsfs reaches it through ``endpoint_url`` (anonymous credentials).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


class GcsServerProcess:
    """Start/kill/restart the emulator on one fixed (free) port with its data in ``data_dir``.

    Args:
        port: where it listens.
        data_dir: its objects, kept across restarts.
        log_path: its output.
        bucket: a bucket it creates at start (kept across restarts).
    """

    def __init__(self, port: int, data_dir: Path, log_path: Path, bucket: str) -> None:
        self.port, self.data_dir, self.log_path, self.bucket = port, data_dir, log_path, bucket
        self.endpoint = f"http://127.0.0.1:{port}"
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a source or the demo writer is given to reach it."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def start(self, timeout_s: float = 60.0) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "gcp_storage_emulator", "-d", str(self.data_dir), "start",
                 "--port", str(self.port), "-q", "--default-bucket", self.bucket],
                stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"gcs emulator exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1) as answer:
                    answer.read()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"gcs emulator did not listen on {self.endpoint} in {timeout_s}s")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)
        self.popen = None
