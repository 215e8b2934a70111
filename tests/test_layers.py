"""The layering is a test: import contracts (import-linter) and a torch-free ingest layer.

docs/contributing.md "Layout" describes the layers; pyproject.toml's ``[tool.importlinter]`` states them as
contracts, and that no package's modules import each other in a cycle. These tests run the
real ``lint-imports`` on the package, show that it fails on a deliberate violation and a
deliberate cycle (so the contracts are not vacuous), and check at run time that the ingest
layer and the daemon command never import torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(root: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    only = [arg for contract in contracts for arg in ("--contract", contract)]
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", *only], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "epochcache", tmp_path / "epochcache",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_its_import_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "violation", "contract"),
    [
        ("ingest/keyorder.py", "import torch", "ingest"),
        ("store/snapshot.py", "from ..data import dataset", "store"),
        ("store/copy_cache.py", "from ..coverage import ledger", "store"),
        ("coverage/ledger.py", "from ..ingest import remote", "coverage"),
        ("data/schedule.py", "from ..ingest import remote", "data"),
        ("config/schema.py", "import fsspec", "base"),
    ],
)
def test_a_violation_breaks_its_contract(tmp_path: Path, module: str, violation: str,
                                         contract: str) -> None:
    root = _copy_package(tmp_path)
    path = root / "epochcache" / module
    path.write_text(path.read_text() + f"\n{violation}  # deliberate violation\n")
    result = _lint(root, contract)
    assert result.returncode != 0, f"{contract}: {violation!r} went unnoticed"
    assert "BROKEN" in result.stdout and module.removesuffix(".py").replace("/", ".") in result.stdout


def test_a_cycle_breaks_the_acyclic_contract_even_when_only_types_close_it(
        tmp_path: Path) -> None:
    # verify imports records; records importing verify back, only for a type, is a cycle.
    root = _copy_package(tmp_path)
    path = root / "epochcache" / "store" / "records.py"
    path.write_text(path.read_text() + "\nimport typing  # deliberate cycle\n\n"
                    "if typing.TYPE_CHECKING:\n    from .verify import VerifyReport\n")
    result = _lint(root, "acyclic")
    assert result.returncode != 0, "a cycle through a TYPE_CHECKING import went unnoticed"
    assert "No cycles are allowed in epochcache.store" in result.stdout, result.stdout
    assert ".records -> .verify" in result.stdout or ".verify -> .records" in result.stdout, \
        result.stdout


def test_ingest_and_the_daemon_command_never_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import epochcache.ingest.supervisor, epochcache.ingest.sampler, epochcache.store.verify\n"
        "from epochcache.cli import main\n"
        f"assert main(['daemon', {str(tmp_path / 'missing.yaml')!r}]) == 2\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
