"""Fail on what should not be in the repository: binaries and large files.

Only files tracked by git are checked (`git ls-files`), so build outputs and virtual
environments never count. Binaries (a NUL byte in the first 8 KiB, as git itself decides)
are allowed only where the repository keeps pictures on purpose (DATA_GLOBS); any file over
MAX_BYTES fails wherever it is. A wheel committed by accident (2.9 MB, 11b2336) is the case
this exists for.

Usage: python scripts/check_tree.py   (exit status 1 listing each offending path)
"""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

# The docs' pictures (the README's run, the scale benchmark's plot).
DATA_GLOBS = ("docs/*.png", "docs/**/*.png")
# benchmarks.md, the largest text file, is ~70 KiB; the pictures ~180 KiB.
MAX_BYTES = 512 * 1024


def _is_binary(path: Path) -> bool:
    with path.open("rb") as fh:
        return b"\0" in fh.read(8192)


def offenders(root: Path) -> list[str]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True
    ).stdout.decode().split("\0")
    found = []
    for name in filter(None, names):
        path = root / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        size = path.stat().st_size
        if size > MAX_BYTES:
            found.append(f"{name}: {size:,} bytes (over {MAX_BYTES:,}; keep data out of git)")
        elif _is_binary(path) and not any(fnmatch.fnmatch(name, g) for g in DATA_GLOBS):
            found.append(f"{name}: a binary file outside {', '.join(DATA_GLOBS)}")
    return found


def main() -> int:
    found = offenders(Path(__file__).resolve().parent.parent)
    for line in found:
        print(f"scripts/check_tree.py: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
