"""The daemon process that [`epochcache.Daemon`][epochcache.Daemon] starts: ``python -m epochcache.ingest.daemon_main``.

It reads its config from stdin (JSON, `EpochcacheConfig.to_transfer`: credentials never touch
a file or the command line), then runs `run_daemon` as
``epochcache daemon`` does. One JSON line on stdout tells the parent how the start went::

    {"event": "ready", "pid": 1234}                                     samplers are starting
    {"event": "error", "type": "SourceUnavailable", "message": "..."}  nothing was started

Logs go to stderr as ``LEVEL logger: message`` lines, which the parent relays into its own
logging. The daemon stops in order on SIGTERM/SIGINT, and when its parent process is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

from ..errors import EpochcacheError

#: The log line format the parent parses (`epochcache.daemon.LOG_LINE`).
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def serve() -> int:
    """Entry point; returns the exit status (2: nothing was started)."""
    parent_pid = os.getppid()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from ..config import EpochcacheConfig
    from .supervisor import run_daemon

    started = False

    def ready(_daemon: Any) -> None:
        nonlocal started
        started = True
        _say({"event": "ready", "pid": os.getpid()})

    try:
        config = EpochcacheConfig.from_transfer(json.loads(sys.stdin.read()))
        return run_daemon(config, parent_pid=parent_pid, ready=ready)
    except EpochcacheError as exc:
        if started:
            logging.getLogger(__name__).error("the daemon failed: %s", exc)
            return 1
        _say({"event": "error", "type": type(exc).__name__, "message": str(exc)})
        return 2
    except BaseException as exc:
        if not started:
            _say({"event": "error", "type": type(exc).__name__,
                  "message": f"{type(exc).__name__}: {exc}"})
        raise


if __name__ == "__main__":
    raise SystemExit(serve())
