"""One contract for both S3 clients (issue 34, item 2): S3 configured every way users configure
it, read by s3fs, by obstore and by ``client: auto``, with the same bytes expected.

A row is a configuration (where the endpoint, the credentials, the region, the CA and the
addressing come from); a server is moto's (as everywhere in the suite) or s3rver (npm: a second
implementation, which checks signatures); TLS and regions come from `common.s3front` in
front of them (s3rver serves TLS itself). Each test is one row on one server and reads the
same objects with each client. The expected outcome per client is the contract, written
down in docs/howto/sources.md ("S3 configurations tested"):

* s3fs and ``auto`` read every object;
* obstore reads every object except keys it cannot name (``//``, ``.`` segments, control
  characters), which come back as a `PermanentRemoteError` naming the key (the sampler
  quarantines them); ``auto`` reads those with s3fs;
* where obstore cannot honour a setting, ``auto`` reads with s3fs and ``obstore`` is a
  `ConfigError` naming the setting.

The full matrix is slow; a representative row per dimension runs by default. Configuration
files are written to the test's tmp dir (``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``):
the real ``~/.aws`` is never read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from common.s3front import S3Front
from common.s3matrix import read_source
from conftest import free_port

from epochcache.errors import ConfigError, PermanentRemoteError

REPO = Path(__file__).resolve().parents[1]
S3RVER = REPO / ".tools" / "npm" / "node_modules" / ".bin" / "s3rver"
BUCKET, FAR_BUCKET, FAR_REGION = "matrix-bucket", "matrix-frankfurt", "eu-central-1"
PLAIN = {"a.bin": b"alpha", "sub/b.bin": b"beta" * 100, "sub/deeper/c.bin": b"\x00" * 3000}
#: Keys S3 allows and botocore writes (relative to the prefix ``odd/``), each with a kind.
ODD = {"sp ace.bin": "space", "\u00fcn\u00efc\u00f6de-\u6570\u636e.bin": "unicode",
       "q?x.bin": "query", "h#x.bin": "hash", "p%41.bin": "percent", "plus+x.bin": "plus",
       "x//y.bin": "empty segment", "/lead.bin": "empty segment",
       "d/./e.bin": "dot segment", "ctl\x01x.bin": "control", "tab\tx.bin": "control"}
#: The kinds of key obstore cannot name (clients.obstore_refuses_key).
OBSTORE_REFUSES = {"empty segment", "dot segment", "control"}
#: What s3rver keeps as written (it stores objects as files: '//' and '.' are folded, control
#: characters dropped).
S3RVER_KEEPS = {"space", "unicode", "query", "hash", "percent", "plus"}


@dataclass
class Server:
    """One S3 implementation as the matrix reaches it."""

    name: str
    http: str  # http://localhost:<port>
    https: str  # the same objects over TLS, signed by the test's CA
    regional: str  # http, in front: FAR_BUCKET lives in FAR_REGION
    key: str
    secret: str
    keeps: set[str]
    ca_file: Path


@dataclass
class Cell:
    """What a row configures: the URL, the options, the environment and files."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    expected: dict[str, bytes] = field(default_factory=lambda: dict(PLAIN))
    own_hosts: bool = False  # needs <bucket>.localhost to resolve (virtual-hosted)
    obstore_refused: str = ""  # the setting obstore cannot honour ("": none)


# -- the servers -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path, Path, Path]:
    """A private CA made for this session (trustme) and a certificate for localhost: the
    server context, the CA's PEM, the server's key and certificate chain files."""
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    ca_file, key_file, chain_file = folder / "ca.pem", folder / "key.pem", folder / "cert.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert.private_key_pem.write_to_path(str(key_file))
    chain_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    return context, ca_file, key_file, chain_file


def _wait_listening(port: int, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port} after 30 s")


@pytest.fixture
def s3rver(tmp_path_factory: pytest.TempPathFactory,
           tls: tuple[ssl.SSLContext, Path, Path, Path]) -> Iterator[tuple[str, str]]:
    """s3rver's http and https endpoints (one data directory), or a skip saying why. Per
    test: no process outlives its test (conftest's check)."""
    if not S3RVER.exists():
        reason = ("npm is not installed" if shutil.which("npm") is None else
                  "scripts/setup-env test was not run since s3rver joined it")
        pytest.skip(f"s3rver (npm) is not installed in .tools/npm: {reason}; s3rver cells "
                    "need it")
    data = tmp_path_factory.mktemp("s3rver")
    _context, _ca, key_file, chain_file = tls
    processes = []
    endpoints = []
    try:
        for extra in ((), ("--key", str(key_file), "--cert", str(chain_file))):
            port = free_port()
            process = subprocess.Popen(
                [str(S3RVER), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--silent",
                 "--service-endpoint", "localhost", *extra],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            processes.append(process)
            _wait_listening(port, process)
            endpoints.append(f"{'https' if extra else 'http'}://localhost:{port}")
        yield endpoints[0], endpoints[1]
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)


def _upload(endpoint: str, key: str, secret: str, keys: dict[str, bytes]) -> None:
    import s3fs

    for bucket, region in ((BUCKET, "us-west-2"), (FAR_BUCKET, FAR_REGION)):
        # moto wants a bucket's location constraint to match the region the request is for
        fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=key, secret=secret,
                               client_kwargs={"region_name": region}, skip_instance_cache=True)
        if not fs.exists(bucket):
            fs.mkdir(bucket, region_name=region)
        fs.pipe({f"{bucket}/{name}": data for name, data in keys.items()})


@pytest.fixture
def server(request: pytest.FixtureRequest, tls: tuple[ssl.SSLContext, Path, Path, Path],
           moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """The server named by the test's ``server`` parameter, holding the matrix's objects."""
    context, ca_file, _key, _chain = tls
    fronts: list[S3Front] = []
    if request.param == "moto":
        request_ = urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request_, timeout=10) as response:
            response.read()
        http = moto_endpoint.replace("127.0.0.1", "localhost")
        key, secret = "matrix-key-id", "matrix-secret-value"
        keeps = set(ODD.values())
        https = S3Front(moto_endpoint, context=context).start()
        fronts.append(https)
        https_endpoint = https.endpoint
    else:
        http, https_endpoint = request.getfixturevalue("s3rver")
        key = secret = "S3RVER"  # s3rver checks signatures with these
        keeps = S3RVER_KEEPS
    regional = S3Front(http, regions={FAR_BUCKET: FAR_REGION}).start()
    fronts.append(regional)
    odd = {f"odd/{name}": name.encode() for name, kind in ODD.items() if kind in keeps}
    _upload(http, key, secret, {**{f"plain/{k}": v for k, v in PLAIN.items()}, **odd})
    try:
        yield Server(request.param, http, https_endpoint, regional.endpoint, key, secret, keeps,
                     ca_file)
    finally:
        for front in fronts:
            front.close()


# -- the rows ----------------------------------------------------------------------------------


def _files(tmp: Path, config: str = "", credentials: str = "") -> dict[str, str]:
    (tmp / "config").write_text(config)
    (tmp / "credentials").write_text(credentials)
    return {"AWS_CONFIG_FILE": str(tmp / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "credentials")}


def _env_keys(s: Server) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": s.key, "AWS_SECRET_ACCESS_KEY": s.secret}


def _lab_credentials(s: Server) -> str:
    return f"[lab]\naws_access_key_id = {s.key}\naws_secret_access_key = {s.secret}\n"


def row_options(s: Server, tmp: Path) -> Cell:
    """Everything in storage_options (what the suite did everywhere before)."""
    return Cell(f"s3://{BUCKET}/plain", {"endpoint_url": s.http, "key": s.key,
                                         "secret": s.secret,
                                         "client_kwargs": {"region_name": "us-west-2"}},
                _files(tmp))


def row_env(s: Server, tmp: Path) -> Cell:
    """AWS_ENDPOINT_URL=http://... and keys in the environment (MinIO, Ceph RGW)."""
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp), **_env_keys(s),
                                             "AWS_ENDPOINT_URL": s.http,
                                             "AWS_DEFAULT_REGION": "us-west-2"})


def row_env_s3(s: Server, tmp: Path) -> Cell:
    """AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL (here a port nobody listens on)."""
    return Cell(f"s3://{BUCKET}/plain", {}, {
        **_files(tmp), **_env_keys(s), "AWS_ENDPOINT_URL_S3": s.http,
        "AWS_ENDPOINT_URL": f"http://localhost:{free_port()}", "AWS_DEFAULT_REGION": "us-west-2"})


def row_profile(s: Server, tmp: Path) -> Cell:
    """AWS_PROFILE: its endpoint_url and region in the config file, its keys in the
    credentials file."""
    config = f"[profile lab]\nregion = us-west-2\nendpoint_url = {s.http}\n"
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp, config, _lab_credentials(s)),
                                             "AWS_PROFILE": "lab"})


def row_services(s: Server, tmp: Path) -> Cell:
    """The profile names a services section whose s3 endpoint_url is the server."""
    config = (f"[profile lab]\nregion = us-west-2\nservices = lab-s3\n\n[services lab-s3]\n"
              f"s3 =\n  endpoint_url = {s.http}\n")
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp, config, _lab_credentials(s)),
                                             "AWS_PROFILE": "lab"})


def row_profile_option(s: Server, tmp: Path) -> Cell:
    """``profile`` in storage_options (s3fs's option), no AWS_PROFILE."""
    config = f"[profile lab]\nregion = us-west-2\nendpoint_url = {s.http}\n"
    return Cell(f"s3://{BUCKET}/plain", {"profile": "lab"},
                _files(tmp, config, _lab_credentials(s)))


def row_credentials_file(s: Server, tmp: Path) -> Cell:
    """The default profile's keys in the credentials file, the endpoint in the environment."""
    credentials = f"[default]\naws_access_key_id = {s.key}\naws_secret_access_key = {s.secret}\n"
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp, "", credentials),
                                             "AWS_ENDPOINT_URL": s.http,
                                             "AWS_DEFAULT_REGION": "us-west-2"})


def row_https_ca_env(s: Server, tmp: Path) -> Cell:
    """An https endpoint signed by a private CA, given by AWS_CA_BUNDLE."""
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp), **_env_keys(s),
                                             "AWS_ENDPOINT_URL": s.https,
                                             "AWS_CA_BUNDLE": str(s.ca_file),
                                             "AWS_DEFAULT_REGION": "us-west-2"})


def row_https_ca_profile(s: Server, tmp: Path) -> Cell:
    """The private CA as the profile's ca_bundle."""
    config = (f"[profile lab]\nregion = us-west-2\nendpoint_url = {s.https}\n"
              f"ca_bundle = {s.ca_file}\n")
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp, config, _lab_credentials(s)),
                                             "AWS_PROFILE": "lab"})


def row_https_verify_option(s: Server, tmp: Path) -> Cell:
    """The private CA as client_kwargs.verify in storage_options."""
    return Cell(f"s3://{BUCKET}/plain", {"endpoint_url": s.https,
                                         "client_kwargs": {"verify": str(s.ca_file),
                                                           "region_name": "us-west-2"}},
                {**_files(tmp), **_env_keys(s)})


def row_virtual_hosted(s: Server, tmp: Path) -> Cell:
    """The profile's ``s3 = addressing_style = virtual``: requests go to
    ``<bucket>.localhost`` (resolved by a hosts file of the cell's own)."""
    config = (f"[profile lab]\nregion = us-west-2\nendpoint_url = {s.http}\n"
              "s3 =\n  addressing_style = virtual\n")
    return Cell(f"s3://{BUCKET}/plain", {}, {**_files(tmp, config, _lab_credentials(s)),
                                             "AWS_PROFILE": "lab"}, own_hosts=True)


def row_other_region(s: Server, tmp: Path) -> Cell:
    """A bucket in eu-central-1 while AWS_DEFAULT_REGION is us-west-2: the server answers
    requests signed for us-west-2 with AWS's 301 (botocore follows it; obstore asks the
    bucket where it lives)."""
    return Cell(f"s3://{FAR_BUCKET}/plain", {}, {**_files(tmp), **_env_keys(s),
                                                 "AWS_ENDPOINT_URL": s.regional,
                                                 "AWS_DEFAULT_REGION": "us-west-2"})


def row_odd_keys(s: Server, tmp: Path) -> Cell:
    """Keys with '//', '/./', spaces, unicode, '?', '#', '%', '+' and control characters."""
    cell = row_env(s, tmp)
    cell.url = f"s3://{BUCKET}/odd"
    cell.expected = {name: name.encode() for name, kind in ODD.items() if kind in s.keeps}
    return cell


def row_s3fs_only_option(s: Server, tmp: Path) -> Cell:
    """An option only s3fs takes (a proxy table for botocore): auto keeps s3fs and says why;
    obstore is a config error naming it."""
    cell = row_options(s, tmp)
    cell.options["config_kwargs"] = {"proxies": {}}
    cell.obstore_refused = "storage_options.config_kwargs.proxies"
    return cell


ROWS: dict[str, Callable[[Server, Path], Cell]] = {
    name[len("row_"):]: value for name, value in sorted(globals().items())
    if name.startswith("row_")}
#: One row per dimension, run by default on moto (the rest, and s3rver's, are slow).
DEFAULT = {("moto", "https_ca_env"), ("moto", "other_region"), ("moto", "odd_keys"),
           ("s3rver", "services")}
#: Cells a server cannot serve (the reason).
UNSERVED = {("s3rver", "virtual_hosted"): "s3rver 3.7 answers <bucket>.localhost requests as "
                                          "for a bucket that does not exist"}
CELLS = [pytest.param(server, row, id=f"{server}-{row}", marks=(
             () if (server, row) in DEFAULT else (pytest.mark.slow,)) + (
             (pytest.mark.skip(reason=UNSERVED[server, row]),)
             if (server, row) in UNSERVED else ()))
         for server in ("moto", "s3rver") for row in ROWS]


# -- reading a cell ----------------------------------------------------------------------------


def _read_elsewhere(cell: Cell, client: str, tmp: Path) -> tuple[str, dict[str, bytes | str]]:
    """Read the cell in a process with its own /etc/hosts (a mount namespace), where the
    bucket's virtual host resolves to 127.0.0.1."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("virtual-hosted cells need unshare and root (a hosts file of their own)")
    hosts = tmp / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text()
                     + f"\n127.0.0.1 {BUCKET}.localhost {FAR_BUCKET}.localhost\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    payload = json.dumps({"url": cell.url, "options": cell.options, "client": client,
                          "env": cell.env})
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f'mount --bind "{hosts}" /etc/hosts && exec '
         f'"{sys.executable}" -m common.s3matrix "$0"', payload],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    if done.returncode != 0 and "mount" in done.stderr and "permission" in done.stderr.lower():
        pytest.skip(f"virtual-hosted cells need a mount namespace: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["client"], {key: bytes.fromhex(value) if not value.startswith(
        tuple(f"{name}:" for name in ("PermanentRemoteError", "SourceUnavailable",
                                      "SourceRefused", "RemoteTimeout", "CorruptSample")))
        else value for key, value in found["values"].items()}


def _read(cell: Cell, client: str, tmp: Path, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[str, dict[str, bytes | str]]:
    if cell.own_hosts:
        return _read_elsewhere(cell, client, tmp)
    with monkeypatch.context() as patch:
        for name, value in cell.env.items():
            patch.setenv(name, value)
        return read_source(cell.url, cell.options, client)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("server,row", CELLS, indirect=["server"])
def test_both_clients_read_the_same_bytes(server: Server, row: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    cell = ROWS[row](server, tmp_path)
    expected = cell.expected
    assert expected, "a cell that reads nothing proves nothing"
    # s3fs: every object.
    who, values = _read(cell, "s3fs", tmp_path, monkeypatch)
    assert who == "s3" and values == expected, values
    # obstore: every object it can name, the same bytes; those it cannot, refused by name.
    if cell.obstore_refused:
        with pytest.raises(ConfigError, match=cell.obstore_refused.replace(".", r"\.")):
            _read(cell, "obstore", tmp_path, monkeypatch)
    else:
        who, values = _read(cell, "obstore", tmp_path, monkeypatch)
        assert who == "obstore"
        refused = {key for key in expected if ODD.get(key) in OBSTORE_REFUSES}
        assert {k: v for k, v in values.items() if k not in refused} == \
            {k: v for k, v in expected.items() if k not in refused}, values
        for key in refused:
            assert str(values[key]).startswith("PermanentRemoteError: ") and \
                "obstore cannot name this key" in str(values[key]), values[key]
    # auto: every object; obstore where it honours the whole configuration, else s3fs,
    # saying why in one log line. (Where obstore reads everything, auto is obstore: the
    # daemon test of test_s3_environment reads with it; here it is read where it differs.)
    refusing = cell.obstore_refused or any(ODD.get(key) in OBSTORE_REFUSES for key in expected)
    if not refusing and (server.name, row) in DEFAULT:
        return
    with caplog.at_level(logging.INFO, logger="epochcache"):
        who, values = _read(cell, "auto", tmp_path, monkeypatch)
    assert values == expected, values
    if cell.obstore_refused:
        assert who == "s3"
        said = [r.getMessage() for r in caplog.records if "not obstore" in r.getMessage()]
        assert len(said) == 1 and cell.obstore_refused in said[0], said
    else:
        assert who == "obstore"
        if any(ODD.get(key) in OBSTORE_REFUSES for key in expected):
            said = [r.getMessage() for r in caplog.records if "read with s3fs" in r.getMessage()]
            assert len(said) == 1, said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", ["moto"], indirect=True)
def test_a_region_given_wrongly_is_followed_by_s3fs_and_refuses_the_source_for_obstore(
        server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``client_kwargs.region_name`` names another region than the bucket's: botocore follows
    the 301; obstore signs for the region it was given, and the 301 is a refusal of the whole
    source (`SourceRefused`, not retried) naming the setting to fix."""
    cell = row_other_region(server, tmp_path)
    cell.options = {"client_kwargs": {"region_name": "us-west-2"}}
    who, values = _read(cell, "s3fs", tmp_path, monkeypatch)
    assert values == PLAIN
    who, values = _read(cell, "obstore", tmp_path, monkeypatch)
    assert who == "obstore" and set(values) == set(PLAIN)
    for value in values.values():
        assert str(value).startswith("SourceRefused: ") and "another region" in str(value)
        assert "client_kwargs.region_name" in str(value)


def _shard_source(s3: Any, name: str, client: str, options: dict[str, Any]) -> Any:
    """A tar source over one shard of two samples (``a``, ``b``) uploaded as ``odd/NAME``."""
    import io
    import tarfile

    import s3fs

    from epochcache.ingest.layouts import SourceSpec, open_source

    body = io.BytesIO()
    with tarfile.open(fileobj=body, mode="w") as tar:
        for member, data in (("a.cls", b"1"), ("b.cls", b"2")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    s3fs.S3FileSystem(**s3.storage_options).pipe(f"{s3.bucket}/odd/{name}", body.getvalue())
    spec = SourceSpec(url=f"s3://{s3.bucket}/odd", layout="tar", pattern="**",
                      storage_options=options, checks=(), client=client, timeout_s=10,
                      connect_timeout_s=5, retries=1)
    return open_source(spec)


@pytest.mark.timeout(120)
def test_obstore_reads_shards_with_the_credentials_of_the_environment(s3: Any) -> None:
    """Credentials only in the environment (botocore's chain, as s3fs finds them): obstore
    streams a shard's body with them too (`clients.obstore_store`)."""
    options = {key: value for key, value in s3.storage_options.items()
               if key not in ("key", "secret")}
    source = _shard_source(s3, "shard.tar", "obstore", options)
    assert source.client == "obstore"
    values = {ref.key: value for ref, value in source.fetch_many(source.list_keys())}
    assert values == {"shard.tar/a": {"cls": b"1"}, "shard.tar/b": {"cls": b"2"}}, values


@pytest.mark.timeout(120)
@pytest.mark.parametrize("client", ["auto", "obstore"])
def test_a_shard_whose_key_obstore_cannot_name(s3: Any, client: str) -> None:
    """A tar shard under ``x//`` (legal in S3; obstore would read another key): ``auto``
    reads it with s3fs, its samples whole; ``obstore`` refuses it by name, as the files layout
    refuses such an object."""
    source = _shard_source(s3, "/shard.tar", client, s3.storage_options)
    assert source.client == "obstore"
    values = {ref.key: value for ref, value in source.fetch_many(source.list_keys())}
    if client == "auto":
        assert values == {"/shard.tar/a": {"cls": b"1"}, "/shard.tar/b": {"cls": b"2"}}, values
    else:
        assert values and all(isinstance(v, PermanentRemoteError) and
                              "obstore cannot name this key" in str(v)
                              for v in values.values()), values
