"""A moto S3 server in its own process, preloaded from a local directory before it listens.

For outage tests: SIGKILL the process and every connection to it dies at once (a real outage,
not a server that stops accepting while keep-alive connections go on being served, which is what
``ThreadedMotoServer.stop()`` gives). Starting it again on the *same* port serves the same objects,
because they are loaded into moto's backend before the port opens.

Layout of the preload directory: ``<dir>/<bucket>/<key path>``. Run as a script::

    python -m common.s3server PORT DIR      # prints "READY <endpoint>" when listening
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _serve(port: int, data_dir: str) -> None:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for bucket in sorted(os.listdir(data_dir)):
        backend.create_bucket(bucket, "us-west-2")
        root = os.path.join(data_dir, bucket)
        for folder, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                key = os.path.relpath(path, root)
                with open(path, "rb") as handle:
                    backend.put_object(bucket, key, handle.read())
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    print(f"READY http://127.0.0.1:{port}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


class S3ServerProcess:
    """Start/kill/restart a preloaded moto server process on one fixed (free) port."""

    def __init__(self, port: int, data_dir: Path, log_path: Path) -> None:
        self.port = port
        self.data_dir = data_dir
        self.log_path = log_path
        self.endpoint = f"http://127.0.0.1:{port}"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), str(REPO)])
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "common.s3server", str(self.port), str(self.data_dir)],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"s3 server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1) as response:
                    response.read()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"s3 server did not listen on {self.endpoint} in {timeout_s}s")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)
        self.popen = None


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
