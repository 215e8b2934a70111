"""Move modules of the package and rewrite every reference to them: no shim left behind.

    .venv/bin/python scripts/move_modules.py epochcache.store.ledger=epochcache.coverage.ledger ...

For each ``old=new`` pair (dotted module paths): ``git mv`` the file; then, in every Python
file of the package, the tests and the scripts, rewrite relative imports by resolving them
with `ast` (from the importing file's old place) and writing them again from its new place to
the target's new place; then replace absolute dotted paths (``epochcache.store.ledger``, word
bounded, so ``epochcache.store.ledgers`` stays) and file paths (``epochcache/store/ledger.py``,
``store/ledger.py``) in Python, Markdown, YAML, TOML and the scripts. A ``from pkg import
module`` whose names mix moved modules with other names is reported, not rewritten: split it.
Run ``ruff check --fix`` afterwards for the import order.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".toml", ".cfg", ".txt", ""}
SKIP_DIRS = {".git", ".venv", "site", "__pycache__", "node_modules", ".mypy_cache",
             ".ruff_cache", ".pytest_cache", ".import_linter_cache"}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _file_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _moved(module: str, moves: dict[str, str]) -> str:
    """``module`` after the moves (the longest old path that is ``module`` or a package of it)."""
    for old in sorted(moves, key=len, reverse=True):
        if module == old or module.startswith(old + "."):
            return moves[old] + module[len(old):]
    return module


def _relative(from_package: str, target: str) -> str:
    """``target`` written relative to ``from_package`` (both inside the same top package)."""
    here, there = from_package.split("."), target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return "." * (len(here) - common + 1) + ".".join(there[common:])


def _rewrite_relative(path: Path, old_module: str, new_module: str,
                      moves: dict[str, str]) -> str | None:
    """The new text of ``path`` (now at ``new_module``, once ``old_module``), or None."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    old_package = _package_of(path, old_module)
    new_package = _package_of(path, new_module)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = old_package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        names_moved = [alias.name for alias in node.names if f"{target}.{alias.name}" in moves]
        if names_moved:
            print(f"{path}:{node.lineno}: split by hand: imports moved module(s) {names_moved}")
            continue
        new_target = _moved(target, moves)
        if new_target == target and new_package == old_package:
            continue
        written = _relative(new_package, new_target)
        line = lines[node.lineno - 1]
        match = re.compile(r"from\s+\.+[\w.]*\s+import").search(line, node.col_offset)
        if match is None:
            print(f"{path}:{node.lineno}: not rewritten (unusual form)")
            continue
        edits.append((node.lineno - 1, match.start(), f"{line[:match.start()]}from {written} import"
                      f"{line[match.end():]}"))
    if not edits:
        return None
    for index, _, new_line in edits:
        lines[index] = new_line
    return "".join(lines)


def _text_files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not path.is_symlink():
            found.append(path)
    return found


def main(argv: list[str]) -> int:
    moves = dict(arg.split("=", 1) for arg in argv)
    # Where each Python file was before the moves, so relative imports resolve from there.
    python = [p for p in _text_files() if p.suffix == ".py"
              and p.relative_to(ROOT).parts[0] in ("epochcache", "tests", "scripts")]
    old_of = {p: p for p in python}
    sources = {old: _file_of(old) for old in moves}  # before any file moves
    for old, new in moves.items():
        src = sources[old]
        dst = ROOT.joinpath(*new.split(".")).with_suffix(".py")
        if src.name == "__init__.py":  # the package's own module; its other modules move alone
            dst = ROOT.joinpath(*new.split("."), "__init__.py")
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
        old_of[dst] = old_of.pop(src)
    for new_path, old_path in old_of.items():
        if new_path.relative_to(ROOT).parts[0] != "epochcache":
            continue
        text = _rewrite_relative(new_path, _module_of(old_path), _module_of(new_path), moves)
        if text is not None:
            new_path.write_text(text)
    patterns = []
    for old, new in sorted(moves.items(), key=lambda item: len(item[0]), reverse=True):
        patterns.append((re.compile(rf"\b{re.escape(old)}\b(?!\.py)"), new))
        old_file, new_file = old.replace(".", "/") + ".py", new.replace(".", "/") + ".py"
        patterns.append((re.compile(rf"(?<![\w/]){re.escape(old_file)}\b"), new_file))
        short_old, short_new = old_file.split("/", 1)[1], new_file.split("/", 1)[1]
        patterns.append((re.compile(rf"(?<![\w/.]){re.escape(short_old)}\b"), short_new))
    for path in _text_files():
        if path.name == "CHANGELOG.md" or path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new_text = text
        for pattern, replacement in patterns:
            new_text = pattern.sub(replacement, new_text)
        if new_text != text:
            path.write_text(new_text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
