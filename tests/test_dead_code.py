"""The dead-code step of scripts/check (vulture) is not vacuous, and its whitelist does not rot.

vulture reports unused names in epochcache/; scripts/vulture_whitelist.py names those that are
used where vulture cannot see it (Python, pydantic, configs, tests), each with why. A line of
the whitelist whose name is gone from the package would hide the next dead name of that
spelling, so each one must still name something real.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHITELIST = ROOT / "scripts" / "vulture_whitelist.py"
VULTURE = Path(sys.executable).with_name("vulture")


def _has(owner: Any, name: str) -> bool:
    """Whether ``owner`` has ``name``: an attribute, a field, or one ``__init__`` sets."""
    if hasattr(owner, name) or name in getattr(owner, "__annotations__", {}):
        return True
    try:
        return f"self.{name} =" in inspect.getsource(owner)
    except (OSError, TypeError):
        return False


def test_every_whitelisted_name_exists() -> None:
    tree = ast.parse(WHITELIST.read_text())
    names: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), str(WHITELIST), "exec"), names)
    listed = [node.value for node in tree.body if isinstance(node, ast.Expr)
              and isinstance(node.value, (ast.Name, ast.Attribute))]
    assert len(listed) > 10
    missing = []
    for expr in listed:
        if isinstance(expr, ast.Name):
            if expr.id not in names:
                missing.append(expr.id)
            continue
        owner = eval(compile(ast.Expression(expr.value), str(WHITELIST), "eval"), names)
        if not _has(owner, expr.attr):
            missing.append(ast.unparse(expr))
    assert not missing, (f"scripts/vulture_whitelist.py names what the package no longer has: "
                         f"{', '.join(missing)}; remove those lines")


@pytest.mark.skipif(not VULTURE.exists(), reason="vulture is not installed (the test extra)")
def test_vulture_reports_a_function_nothing_calls(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def used() -> int:\n    return 1\n\n\ndef forgotten() -> int:\n"
                      "    return used()\n")
    result = subprocess.run([str(VULTURE), str(module), "--min-confidence", "60"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unused function 'forgotten'" in result.stdout
    assert "'used'" not in result.stdout
