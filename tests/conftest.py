"""Shared fixtures: a clean environment for every test, no process left behind by any, and a real
S3 endpoint (moto's server).

Importing this module has no side effects: the moto server starts the first time a test asks for
``s3``, on 127.0.0.1 and a free port, and stops at the end of the session (it is a thread of
this process, not a process).
"""

from __future__ import annotations

import os
import socket
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from common.procs import SESSION_TAG, LeftoverCheck

_LEAKY_ENV_PREFIXES = ("AWS_", "SLURM_")
# Node identity is read from the environment at call time: a value leaking from the machine (or
# from torchrun, or a Slurm job running the suite) would change which keys a test's node samples.
_LEAKY_ENV_NAMES = (
    "EPOCHCACHE_NODE_RANK",
    "EPOCHCACHE_NUM_NODES",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)


def pytest_configure(config: pytest.Config) -> None:
    # Two tests run at once on the suite's two cores, often each with several processes using
    # torch, whose thread pool is sized to every core and whose idle threads spin: the suite
    # spent CPU on oversubscription. One thread a process, as torchrun gives its ranks by
    # default (no test asserts a speed); inherited by every process a test starts.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- no process left behind -------------------------------------------------------------------

#: How long the processes a test started may take to end after it (a daemon stopping its
#: samplers, multiprocessing's resource tracker noticing its pipe closed, on a busy machine).
LEFTOVER_GRACE_S = 15.0


@pytest.fixture(scope="session")
def session_tag() -> tuple[str, str]:
    """``(EPOCHCACHE_TEST_SESSION, value)``, in the environment of this test process only and
    of the processes it starts: whatever session or parent they end up with (a torchrun rank,
    a daemon's orphan re-parented to init), they are found by it. Each pytest worker sets its
    own."""
    value = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[SESSION_TAG] = value
    return SESSION_TAG, value


@pytest.fixture(autouse=True)
def no_process_left_behind(session_tag: tuple[str, str]) -> Iterator[None]:
    """Fail a test that leaves a process running (killed then, with all of its own): every
    process it started must have ended at most :data:`LEFTOVER_GRACE_S` after its teardown.
    Set up before the test's other fixtures, it checks after all their teardowns."""
    leftovers = LeftoverCheck(session_tag, LEFTOVER_GRACE_S)
    yield
    report = leftovers.check()
    if report is not None:
        pytest.fail(report, pytrace=False)


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop credentials and node variables leaking from the machine: tests must not depend on them
    (and must never reach a real account)."""
    for name in list(os.environ):
        if name.startswith(_LEAKY_ENV_PREFIXES) or name in _LEAKY_ENV_NAMES:
            monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the OS pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def unreachable_endpoint() -> str:
    """An http endpoint on 127.0.0.1 where nothing listens (connections are refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def s3_options_for() -> Callable[[str], dict[str, Any]]:
    """``s3_options_for(endpoint)``: storage_options with fake credentials for an endpoint."""
    return s3_options


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of a moto S3 server running for the whole session."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@dataclass
class S3Env:
    """A fresh bucket on the moto server and the options to reach it."""

    endpoint_url: str
    bucket: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, prefix: str = "") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.bucket}/{prefix}".rstrip("/")


def _reset_moto(endpoint: str) -> None:
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def s3_options(endpoint: str) -> dict[str, Any]:
    """storage_options for s3fs against the moto server (fake credentials)."""
    return {
        "key": "testing-key-id",
        "secret": "testing-secret-value",
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": "us-west-2"},
    }


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    """A clean moto server (reset per test) with one empty bucket, ``test-bucket``."""
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-value")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    _reset_moto(moto_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    options = s3_options(moto_endpoint)
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("test-bucket")
    try:
        yield S3Env(moto_endpoint, "test-bucket", options)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def start_daemon(tmp_path: Any) -> Iterator[Callable[..., Any]]:
    """``start_daemon(config, name=..., args=...)``: run ``epochcache daemon CONFIG`` as a process
    (see ``common.daemonproc.DaemonProc``); it and everything in its session is killed at teardown."""
    from common.daemonproc import DaemonProc

    started: list[DaemonProc] = []

    def start(config: Any, name: str = "daemon", args: tuple[str, ...] = (),
              daemon_args: tuple[str, ...] = ()) -> DaemonProc:
        proc = DaemonProc(tmp_path, config, name=f"{name}{len(started)}", args=args,
                          daemon_args=daemon_args)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.close()


@pytest.fixture
def remote_proxy() -> Iterator[Callable[..., Any]]:
    """``remote_proxy(endpoint, latency_s=0.02, rate_per_s=..., ...)``: an object store with
    real manners (first-byte latency, a bandwidth cap per connection, throttling with 503
    SlowDown or 429) in front of ``endpoint`` (``common.remoteproxy``); closed at teardown."""
    from urllib.parse import urlsplit

    from common.remoteproxy import RemoteProxy

    started: list[RemoteProxy] = []

    def start(endpoint: str, **manners: Any) -> RemoteProxy:
        url = urlsplit(endpoint)
        proxy = RemoteProxy(url.hostname or "127.0.0.1", url.port or 80, **manners).start()
        started.append(proxy)
        return proxy

    yield start
    for proxy in started:
        proxy.close()


# -- a one-node Slurm (tests/common/slurm.py) -------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """A real one-node Slurm for the session (started by the first test that asks, as root;
    skipped, saying why, where the packages cannot be installed). Stopped at the session's end,
    its jobs and daemons with it."""
    from common.slurm import SlurmCluster, unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(f"no Slurm: {why}")
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: Any) -> Iterator[Any]:
    """The session's Slurm, with no job of this test left in it afterwards (cancelled)."""
    yield slurm_cluster
    slurm_cluster.cancel_all()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") is not None:  # for pytest_terminal_summary (xdist too)
        item.user_properties.append(("slurm", True))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say whether the Slurm tests ran (CI's output must, tests/common/slurm.py)."""
    counts: dict[str, int] = {}
    reasons: set[str] = set()
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if ("slurm", True) not in getattr(report, "user_properties", ()) or (
                    report.when != "call" and outcome not in ("skipped", "error")):
                continue
            counts[outcome] = counts.get(outcome, 0) + 1
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons.add(str(report.longrepr[2]).removeprefix("Skipped: "))
    if counts:
        said = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        why = f" ({'; '.join(sorted(reasons))})" if reasons else ""
        terminalreporter.write_line(f"Slurm tests (a real one-node Slurm): {said}{why}")
