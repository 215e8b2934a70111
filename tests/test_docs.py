"""The documentation cannot drift from the code (issue 23): the generated reference pages are
current, the MkDocs site builds with --strict (a broken link fails), and every code block
marked ``<!-- test: run -->`` in the README and docs/ runs, in order, in a fresh directory
(a renamed argument breaks the build, not a user).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"<!-- test: run -->\n```(\w+)\n(.*?)```", re.S)
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _gen_reference():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  REPO / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_references_are_current() -> None:
    stale = _gen_reference().stale()
    assert stale == [], f"stale: {stale}; run .venv/bin/python scripts/gen_reference.py"


def test_the_config_reference_writes_sizes_as_a_config_would() -> None:
    """Size defaults showed as raw bytes (``4294967296``, ``536870912``): a default is written
    as a config would write it (``4GiB``), and reads back as the default itself."""
    from epochcache.units import parse_size

    page = (REPO / "docs" / "reference" / "config.md").read_text()
    rows = [row.split("|") for row in page.splitlines() if row.startswith("| `")]
    sizes = {cells[1].strip(" `"): cells[3].strip(" `") for cells in rows
             if cells[2].strip().startswith("size")}
    assert sizes["source.manifest_max_bytes"] == "4GiB", sizes
    for key, shown in sizes.items():
        if shown not in ("null", "**required**"):
            assert not shown.isdigit() or int(shown) < 1024, f"{key}: {shown}"
            assert parse_size(shown) > 0, f"{key}: {shown}"


def _torchrun_commands(text: str) -> list[str]:
    """Each ``torchrun ...`` command in ``text`` (continuation lines and ``# `` comment
    prefixes joined), whitespace normalised."""
    text = re.sub(r"^#\s?", "", text, flags=re.M).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines()
            if line.strip().startswith("torchrun ")]


def test_the_multi_node_page_and_configs_ddp_agree() -> None:
    """docs/howto/multi-node.md and configs/ddp.yaml disagreed: the config put each node's cache
    under node-${GROUP_RANK}, the page told shared filesystems to; both passed --node-rank to
    torchrun with the c10d rendezvous, which ignores it (it numbers the nodes as they join)."""
    page = (REPO / "docs" / "howto" / "multi-node.md").read_text()
    config = (REPO / "configs" / "ddp.yaml").read_text()
    in_page, in_config = _torchrun_commands(page), _torchrun_commands(config)
    assert in_page and in_page[0] == in_config[0], (in_page, in_config)
    for command in in_page + in_config:
        assert not ("--rdzv-backend c10d" in command and "--node-rank" in command), command
    assert "GROUP_RANK" not in yaml.safe_load(config.replace("${", "$(")).get("cache", {}).get(
        "dir", "")
    for text in (page, config):
        assert "local disk" in text and "never on a filesystem the nodes share" in " ".join(
            text.replace("#", " ").split())


def test_every_config_key_has_a_description() -> None:
    from pydantic import BaseModel

    from epochcache.config import EpochcacheConfig

    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            sections = [arg for arg in (info.annotation, *getattr(info.annotation, "__args__", ()))
                        if isinstance(arg, type) and issubclass(arg, BaseModel)]
            if sections:  # a section: its docstring describes it
                walk(sections[0], f"{prefix}{name}.")
            elif not info.description:
                missing.append(prefix + name)

    walk(EpochcacheConfig, "")
    assert missing == [], f"config keys without a description: {missing}"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


@pytest.mark.parametrize("document", [doc for doc in DOCUMENTS if MARKED.search(doc.read_text())],
                         ids=lambda doc: str(doc.relative_to(REPO)))
def test_marked_examples_run(document: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    for index, (language, code) in enumerate(MARKED.findall(document.read_text())):
        if language == "python":
            argv = [sys.executable, "-c", code]
        elif language == "bash":
            argv = ["bash", "-euo", "pipefail", "-c", code]
        else:
            raise AssertionError(f"{document.name}: block {index} is {language!r}: only python "
                                 "and bash blocks can be marked to run")
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=240, check=False)
        assert result.returncode == 0, (
            f"{document.name}, example {index + 1}:\n{code}\n--- stdout ---\n"
            f"{result.stdout[-2000:]}\n--- stderr ---\n{result.stderr[-4000:]}")
