"""The documentation cannot drift from the code (issues 23, 29): the generated reference pages
are current, the MkDocs site builds with --strict (a broken link fails) and its Python API page
holds every public name, and every code block of the README and docs/ is run, checked, or says
why it cannot be.

Every ``bash``, ``python`` and ``yaml`` block carries a marker on the line before it:

* ``<!-- test: run -->``: run, in order with the document's other such blocks, in a fresh
  directory (holding ``configs/``, as a checkout does); ``<!-- test: run s3 -->`` the same with
  a moto S3 server as the bucket: ``EPOCHCACHE_S3_URL`` (a prefix of an empty bucket),
  ``EPOCHCACHE_S3_ENDPOINT``, AWS credentials, and ``EPOCHCACHE_CACHE_DIR``/``EPOCHCACHE_RUN_DIR``
  in the directory;
* ``<!-- test: config -->`` (yaml): validated as a config, over the required keys a fragment
  leaves out, with no environment variable set (a node with an instance role has none);
* ``<!-- test: skip (why) -->``: not run, for the reason given (a cluster, a GPU, a real
  bucket, a fragment of your own program);
* ``<!-- test: file (NAME) -->`` (bash): a script the page names NAME, which a test runs as
  written (`files`: the Slurm section's batch scripts, submitted by tests/test_slurm.py).

Whatever the marker, a python block compiles, a bash block passes ``bash -n`` and each
``epochcache`` command in it parses with the CLI's parser, and a yaml block parses. A block
without a language, or of a language not listed, fails: ``text`` is for output.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
#: Languages whose blocks must be run, checked or marked; ``text`` (output, usage) needs nothing.
CHECKED = ("bash", "python", "yaml")
#: Other spellings, refused so that no block escapes the markers by its language's name.
ALIASES = {"sh": "bash", "shell": "bash", "console": "bash", "py": "python", "yml": "yaml"}
MARKER = re.compile(r"<!--\s*test:\s*(run s3|run|config|skip|file)\s*(?:\((.*)\))?\s*-->")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a document, and the marker on the line before it."""

    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    marker: str | None  # "run", "run s3", "config", "skip"; None: no marker
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def blocks(document: Path) -> list[Block]:
    """The fenced blocks of ``document``, in order (indented ones, in list items, too)."""
    lines = document.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = re.match(r"^(\s*)(`{3,})([^`\s]*)", lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence, language = opening.groups()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        code = "".join(line.removeprefix(indent) + "\n" for line in lines[index + 1 : end])
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marked = MARKER.fullmatch(lines[before].strip()) if before >= 0 else None
        found.append(Block(document, index + 1, language, code,
                           marked.group(1) if marked else None,
                           (marked.group(2) or "").strip() if marked else ""))
        index = end + 1
    return found


ALL_BLOCKS = [block for document in DOCUMENTS for block in blocks(document)]


def files(document: Path) -> dict[str, str]:
    """The scripts of ``document`` marked ``<!-- test: file (NAME) -->``, by NAME."""
    return {block.reason: block.code for block in blocks(document) if block.marker == "file"}


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
    """The site built with ``-q``, which hides the warnings ``--strict`` counts, so this test
    passed while ``mkdocs build --strict`` (and ``mkdocs serve``: mkdocs.yml sets ``strict``)
    aborted on two cross-references to objects the API page did not render (issue 37)."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR)\b", line)]
    assert result.returncode == 0 and not warnings, "\n".join(warnings) or output[-3000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    _check_the_python_api_page(tmp_path / "site" / "reference" / "python" / "index.html")


#: A Sphinx role (``:class:`X```): mkdocstrings shows it raw. Write ``[X][epochcache.x.X]`` (a
#: cross-reference to a documented object) or ``X`` in backticks.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`")


def _check_the_python_api_page(page: Path) -> None:
    """docs/reference/python.md rendered 3 of the 12 Cache members it listed (the inherited
    ones were dropped, and --strict did not notice), no constructor, and raw Sphinx roles.
    Every name of ``epochcache.__all__`` and every public member of ``Cache`` has its
    heading now, the constructor's signature shows, and no role is left raw."""
    import html

    import epochcache

    text = page.read_text()
    ids = set(re.findall(r'id="(epochcache[^"]*)"', text))
    missing = [name for name in epochcache.__all__
               if not any(anchor.rsplit(".", 1)[-1] == name for anchor in ids)]
    missing += [f"Cache.{name}" for name in dir(epochcache.Cache)
                if not name.startswith("_") and f"epochcache.Cache.{name}" not in ids]
    assert not missing, f"not on the Python API page: {missing}"
    shown = html.unescape(re.sub(r"<[^>]+>", "", text))
    assert "Cache(path, capacity=None" in shown, "the constructor's signature is missing"
    raw = re.findall(r":(?:class|meth|func|mod|data|attr|exc|obj):\S+", shown)
    assert not raw, f"raw Sphinx roles on the Python API page: {raw[:10]}"
    unresolved = re.findall(r"\[[^\]]*\]\[epochcache[\w.]*\]", shown)
    assert not unresolved, f"cross-references left raw on the Python API page: {unresolved}"


def test_docstrings_use_cross_references_mkdocstrings_understands() -> None:
    found = [f"{path.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}"
             for path in sorted((REPO / "epochcache").rglob("*.py"))
             for text in [path.read_text()] for match in SPHINX_ROLE.finditer(text)]
    assert not found, (f"{len(found)} Sphinx roles, e.g. {found[:5]}: write [X][epochcache.x.X] "
                       "for a documented object, else X in backticks")


def test_every_block_is_run_or_says_why_not() -> None:
    problems = []
    for block in ALL_BLOCKS:
        if block.language == "":
            problems.append(f"{block.where}: a block without a language (text, for output)")
        elif block.language in ALIASES:
            problems.append(f"{block.where}: write {ALIASES[block.language]}, not "
                            f"{block.language}")
        elif block.language not in CHECKED:
            continue
        elif block.marker is None:
            problems.append(f"{block.where}: a {block.language} block without a marker: "
                            "<!-- test: run -->, <!-- test: config --> (yaml) or "
                            "<!-- test: skip (why it cannot run) -->")
        elif block.marker == "file" and (block.language != "bash" or not block.reason):
            problems.append(f"{block.where}: a file is a bash script with a name: "
                            "<!-- test: file (NAME) -->")
        elif block.marker == "skip" and not block.reason:
            problems.append(f"{block.where}: say why it is skipped: <!-- test: skip (why) -->")
        elif block.marker.startswith("run") and block.language not in ("bash", "python"):
            problems.append(f"{block.where}: only bash and python blocks run")
        elif block.marker == "config" and block.language != "yaml":
            problems.append(f"{block.where}: only yaml blocks are configs")
    assert not problems, "\n".join(problems)


def _epochcache_commands(code: str) -> list[list[str]]:
    """The argument lists of the ``epochcache`` commands in a shell block (also ``-m
    epochcache`` under python or torchrun); heredoc bodies and comments left out."""
    text = code.replace("\\\n", " ")
    lines: list[str] = []
    heredoc: str | None = None
    for line in text.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        match = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        heredoc = match.group(1) if match else None
        lines.append(line)
    commands: list[list[str]] = []
    for line in lines:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&", "&&", "|", "||", "(", ")"):
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words.pop(0)  # VAR=value before the command
                for at in reversed([i for i, w in enumerate(words) if re.fullmatch(r"[<>]+&?", w)]):
                    del words[at : at + 2]  # a redirection and its target (and its fd number)
                    if at and words[at - 1].isdigit():
                        del words[at - 1]
                if words and words[0] == "epochcache":
                    commands.append(words[1:])
                elif "-m" in words and words[words.index("-m") + 1 :][:1] == ["epochcache"]:
                    commands.append(words[words.index("-m") + 2 :])
                words = []
            else:
                words.append(token)
    return commands


def test_every_block_parses() -> None:
    """Also the skipped ones: a renamed option or a typo fails here, not for a user."""
    from epochcache.cli import build_parser

    problems = []
    for block in ALL_BLOCKS:
        if block.language == "python":
            try:
                compile(block.code, block.where, "exec")
            except SyntaxError as exc:
                problems.append(f"{block.where}: {exc}")
        elif block.language == "yaml":
            try:
                yaml.safe_load(block.code)
            except yaml.YAMLError as exc:
                problems.append(f"{block.where}: {exc}")
        elif block.language == "bash":
            done = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True,
                                  text=True, check=False)
            if done.returncode != 0:
                problems.append(f"{block.where}: bash -n: {done.stderr.strip()}")
            for argv in _epochcache_commands(block.code):
                try:
                    build_parser().parse_args(argv)
                except SystemExit as exc:
                    if exc.code == 0:  # --version, --help: parsed, and answered
                        continue
                    problems.append(f"{block.where}: epochcache {shlex.join(argv)}: does not "
                                    "parse (see the error above)")
    assert not problems, "\n".join(problems)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = (_merged(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.marker == "config"],
                         ids=lambda block: block.where)
def test_config_blocks_are_valid(block: Block) -> None:
    """A config as a page shows it validates, with no environment variable set; a fragment
    (a section or two) validates over the required keys it leaves out."""
    from epochcache.config import parse_config

    data = yaml.safe_load(block.code)
    base: dict[str, Any] = {"source": {"url": "memory://docs/train"},
                            "cache": {"dir": "/tmp/epochcache-docs", "capacity": "1MiB"}}
    if "sources" in data:
        del base["source"]
    parse_config(_merged(base, data), origin=block.where, environ={})


def _run_env(tmp_path: Path, request: pytest.FixtureRequest, s3: bool) -> dict[str, str]:
    bucket = request.getfixturevalue("s3") if s3 else None  # moto; it sets AWS_* in os.environ
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", "COLUMNS": "120"}
    if bucket is not None:
        env.update(EPOCHCACHE_S3_URL=bucket.url("docs"),
                   EPOCHCACHE_S3_ENDPOINT=bucket.endpoint_url,
                   EPOCHCACHE_CACHE_DIR=str(tmp_path / "s3-cache"),
                   EPOCHCACHE_RUN_DIR=str(tmp_path / "runs" / "s3"))
    return env


RUN_DOCUMENTS = sorted({b.document for b in ALL_BLOCKS if (b.marker or "").startswith("run")})


@pytest.mark.parametrize("document", RUN_DOCUMENTS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_marked_examples_run(document: Path, tmp_path: Path,
                             request: pytest.FixtureRequest) -> None:
    runs = [b for b in blocks(document) if (b.marker or "").startswith("run")]
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the pages are read in a checkout
    env = _run_env(tmp_path, request, s3=any(b.marker == "run s3" for b in runs))
    for block in runs:
        if block.language == "python":
            argv = [sys.executable, "-c", block.code]
        else:
            argv = ["bash", "-euo", "pipefail", "-c", block.code]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=240, check=False)
        assert result.returncode == 0, (
            f"{block.where}:\n{block.code}\n--- stdout ---\n"
            f"{result.stdout[-2000:]}\n--- stderr ---\n{result.stderr[-4000:]}")


def test_the_layer_map_names_every_module() -> None:
    """docs/contributing.md's "Layout" is where a newcomer finds the room for a change: it
    names every module of the package (it once left 12 out)."""
    layout = (REPO / "docs" / "contributing.md").read_text().split("## Development")[0]
    missing = [str(path.relative_to(REPO)) for path in sorted((REPO / "epochcache").rglob("*.py"))
               if path.stem not in ("__init__", "__main__") and f"`{path.stem}`" not in layout
               and f"{path.stem}`" not in layout and f"`{path.stem}" not in layout]
    assert missing == [], f"modules the layer map does not name: {missing}"
