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

When ``new`` already exists the pair is a merge: ``old``'s imports (re-resolved from ``new``'s
place) join ``new``'s, its body is appended to ``new``'s, imports of one from the other are
dropped (the names are local now), ``old`` is removed, and every reference is rewritten as for a
move. ``old``'s docstring is printed, for a person to fold into ``new``'s; an ``__all__`` or an
aliased import of one from the other is reported.

Re-running the same pairs after they were applied rewrites references only, which is how a
branch's moves are applied again over files that another branch changed (a merge conflict in
import lines: take the other side, re-run).
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


def _import_target(package: str, node: ast.ImportFrom) -> str:
    """The dotted module a relative ``from ... import`` in ``package`` names."""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _rewrite_relative(path: Path, old_module: str, new_module: str,
                      moves: dict[str, str], new_path: Path | None = None) -> str | None:
    """The new text of ``path`` (now at ``new_module``, in ``new_path`` if not ``path``, once
    ``old_module``), or None."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    old_package = _package_of(path, old_module)
    new_package = _package_of(new_path or path, new_module)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        target = _import_target(old_package, node)
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


def _import_block_end(tree: ast.Module) -> int:
    """The line after the module's leading docstring and imports (1-based, exclusive)."""
    end = 0
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            end = node.end_lineno or node.lineno
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and end == 0:
            end = node.end_lineno or node.lineno
        else:
            break
    return end


def _drop_self_imports(path: Path, module: str, others: set[str]) -> str:
    """``path``'s text without imports from ``module`` itself or from ``others`` (merged in)."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    package = _package_of(path, module)
    lines = text.splitlines(keepends=True)
    drop: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        target = _import_target(package, node)
        if target == module and any(_file_of(f"{target}.{alias.name}").exists()
                                    for alias in node.names):
            continue  # a package importing its own submodules (``from . import x``)
        if target == module or target in others:
            if any(alias.asname and alias.asname != alias.name for alias in node.names):
                print(f"{path}:{node.lineno}: aliased import of a merged module: fix by hand")
                continue
            drop.update(range(node.lineno - 1, node.end_lineno or node.lineno))
    return "".join(line for index, line in enumerate(lines) if index not in drop)


def _merge(old: str, new: str) -> None:
    """Fold module ``old`` into the existing module ``new`` (see the module docstring)."""
    src, dst = _file_of(old), _file_of(new)
    rewritten = _rewrite_relative(src, old, new, {old: new}, dst)
    text = rewritten if rewritten is not None else src.read_text()
    tree = ast.parse(text)
    doc = ast.get_docstring(tree)
    if any(isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
           for node in tree.body):
        print(f"{src}: has __all__: merge it by hand")
    lines = text.splitlines(keepends=True)
    end = _import_block_end(tree)
    head = [line for line in lines[:end] if line.strip() != "from __future__ import annotations"]
    head_tree = ast.parse("".join(head))
    imports = []
    for node in head_tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append("".join(head[node.lineno - 1 : node.end_lineno]))
    body = "".join(lines[end:]).strip("\n")
    target = dst.read_text()
    target_tree = ast.parse(target)
    target_lines = target.splitlines(keepends=True)
    target_end = _import_block_end(target_tree)
    if "from __future__ import annotations" in text and "from __future__" not in target:
        imports.insert(0, "from __future__ import annotations\n\n")  # a docstring-only target
    merged = ("".join(target_lines[:target_end]) + "".join(imports)
              + "".join(target_lines[target_end:]).rstrip("\n") + "\n\n\n" + body + "\n")
    dst.write_text(merged)
    subprocess.run(["git", "rm", "-q", "-f", str(src)], cwd=ROOT, check=True)
    dst.write_text(_drop_self_imports(dst, new, {old}))
    print(f"--- docstring of {old} (fold into {new}'s):\n{doc}\n---")


def main(argv: list[str]) -> int:
    moves = dict(arg.split("=", 1) for arg in argv)
    merges = {old: new for old, new in moves.items() if _file_of(new).exists()}
    for old, new in merges.items():
        if _file_of(old).exists():  # else merged already: re-running rewrites references only
            _merge(old, new)
        del moves[old]
    _rewrite_everything(moves, merges)
    for new in set(merges.values()):
        path = _file_of(new)
        path.write_text(_drop_self_imports(path, new, set()))
    return 0


def _rewrite_everything(moves: dict[str, str], merges: dict[str, str]) -> None:
    """Move the files of ``moves``, then rewrite references to ``moves`` and ``merges``."""
    # Where each Python file was before the moves, so relative imports resolve from there.
    python = [p for p in _text_files() if p.suffix == ".py"
              and p.relative_to(ROOT).parts[0] in ("epochcache", "tests", "scripts")]
    old_of = {p: p for p in python}
    sources = {old: _file_of(old) for old in moves}  # before any file moves
    for old, new in moves.items():
        src = sources[old]
        if not src.exists():  # moved already: re-running rewrites references only
            continue
        dst = ROOT.joinpath(*new.split(".")).with_suffix(".py")
        if src.name == "__init__.py":  # the package's own module; its other modules move alone
            dst = ROOT.joinpath(*new.split("."), "__init__.py")
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
        old_of[dst] = old_of.pop(src)
    moves = {**moves, **merges}
    for new_path, old_path in old_of.items():
        if new_path.relative_to(ROOT).parts[0] != "epochcache" or not new_path.exists():
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
