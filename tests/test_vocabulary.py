"""One name, one meaning: no two modules, classes or public functions of the package share a name.

Two ``schema.py`` or two ``Part`` classes make a reader ask which one is meant (issue 36,
docs/glossary.md "one word per concept"). The checks read the source with ``ast`` (nothing is
imported, well under a second):

1. module file names are unique (``__init__``/``__main__`` aside);
2. class names are unique, private ones too (``_Slot`` twice is two meanings);
3. public top-level function names are unique across modules;
4. every name an internal module exports (``__all__``) is used by another file of the
   package, tests or scripts: an export nothing imports is dead code vulture cannot see
   (it counts ``__all__`` as a use; ``split_for_rank`` was one).
5. no word renamed away (``RETIRED``) is an identifier of the package again.

``KNOWN`` lists today's exceptions: a ratchet that only shrinks. A new duplicate fails (rename
one of the two), and so does an entry that no longer is one (remove it from ``KNOWN``).
``SAME_THING`` lists names that are one thing reached two ways, for good.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "epochcache"

#: Duplicates of today, each to be renamed away (then its line removed here): none left
#: (tar's ``Part`` is a ``Piece``, store/capacity.py's ``check_format`` ``check_stored_format``).
KNOWN: dict[str, set[str]] = {
    "module": set(),
    "class": set(),
    "function": set(),
}

#: One thing with two doors, kept: the name is the same because the meaning is.
SAME_THING: dict[str, set[str]] = {
    "function": {
        "load_config",  # epochcache.load_config: config.load_config, without importing pydantic
    },
}

#: Words renamed away (issue 36), each with its successor: none may come back as an identifier
#: of the package (a class, function, argument, attribute, variable or imported name).
#: Comments and strings are free (a docstring may say what a thing was called).
RETIRED: dict[str, str] = {
    "MapGate": "RemapLock",
    "CompressGate": "CompressionTrial",
    "BackOff": "Capacity",
    "ByteBudget": "InFlight",
    "ScheduleSampler": "ScheduleIndices",
    # a tar shard's samples handed over together: a piece ("part" is a release plan's)
    "OnPart": "OnPiece",
    "on_part": "on_piece",
    "part_bytes": "piece_bytes",
    "PART_BYTES": "PIECE_BYTES",
    "part_origins": "piece_origins",
    "_hand_over_part": "_hand_over_piece",
    "ListingJob": "PagedListing",  # "job" is the launcher's job
    "HOLDERS_FILE": "WRITERS_FILE",  # a lease's process is its owner; writers hold the file
    "_holders": "_writers",
    "probe_workers": "check_workers",  # a probe raises a limit to test it
    "Store": "Env",  # store/env.py's; the store is the storage layer (torch's TCPStore aside)
    # a stream's epoch handed to its workers: a ticket (a node's share is its part of a source)
    "Share": "Ticket",
    "claim_share": "claim_ticket",
    "publish_share": "publish_ticket",
    "Planner": "Preparer",  # an epoch is prepared; a plan is a release plan
    "planner": "preparer",
    # a manifest's run of keys is a span (a record is a sample as stored in LMDB)
    "Record": "Span",
    "TrainedRecord": "TrainedSpans",
    "epoch_records": "epoch_spans",
    "read_records": "read_spans",
    # one process reading the cache: a trainer ("job" is the launcher's job, all its ranks)
    "jobs": "trainers",
    "note_job": "note_trainer",
    "forget_job": "forget_trainer",
    "job_name": "trainer_doc",
    "JOB_PREFIX": "TRAINER_PREFIX",
}


def _names(package: Path) -> dict[str, dict[str, list[str]]]:
    """``{kind: {name: [where, ...]}}`` for modules, classes and public functions."""
    found: dict[str, dict[str, list[str]]] = {kind: defaultdict(list)
                                              for kind in ("module", "class", "function")}
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        if path.stem not in ("__init__", "__main__"):
            found["module"][path.stem].append(where)
        tree = ast.parse(path.read_text(), where)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found["class"][node.name].append(where)
        for node in tree.body:
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not node.name.startswith("_")):
                found["function"][node.name].append(where)
    return found


def _duplicates(package: Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    return {kind: {name: where for name, where in names.items() if len(where) > 1}
            for kind, names in _names(package).items()}


def test_no_two_modules_classes_or_public_functions_share_a_name() -> None:
    problems = []
    for kind, duplicates in _duplicates().items():
        allowed = KNOWN.get(kind, set()) | SAME_THING.get(kind, set())
        for name, where in sorted(duplicates.items()):
            if name not in allowed:
                problems.append(f"{kind} {name!r} is defined {len(where)} times "
                                f"({', '.join(where)}): rename one (one name, one meaning; "
                                "docs/glossary.md)")
    assert not problems, "\n".join(problems)


def test_every_known_duplicate_is_still_one() -> None:
    duplicates = _duplicates()
    stale = [f"{kind} {name!r} is no longer defined twice: remove it from "
             f"{'KNOWN' if name in KNOWN.get(kind, set()) else 'SAME_THING'} in {__file__}"
             for listing in (KNOWN, SAME_THING) for kind, names in listing.items()
             for name in sorted(names) if name not in duplicates[kind]]
    assert not stale, "\n".join(stale)


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name ``tree`` defines, binds, reads or imports (not its comments or strings)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, ast.alias):
            found.update((node.name.rpartition(".")[2], node.asname or ""))
    return found


def test_no_retired_word_is_back() -> None:
    back = [f"{path.relative_to(PACKAGE.parent)}: {word} (now {RETIRED[word]})"
            for path in sorted(PACKAGE.rglob("*.py"))
            for word in sorted(_identifiers(ast.parse(path.read_text())) & RETIRED.keys())]
    assert not back, "a renamed word is back (one name, one meaning): " + ", ".join(back)


def test_the_retired_check_sees_each_kind_of_identifier() -> None:
    source = ("from x import MapGate as G\nclass ByteBudget: ...\n"
              "def f(on_part=1): return g(part_bytes=2).part_origins + PART_BYTES\n")
    assert _identifiers(ast.parse(source)) & RETIRED.keys() == {
        "MapGate", "ByteBudget", "on_part", "part_bytes", "part_origins", "PART_BYTES"}
    assert not _identifiers(ast.parse('"""MapGate, once."""  # ByteBudget\n')) & RETIRED.keys()


def test_every_exported_name_is_used_elsewhere() -> None:
    root = PACKAGE.parent
    texts = {path: path.read_text() for folder in ("epochcache", "tests", "scripts")
             for path in (root / folder).rglob("*.py")}
    words: dict[Path, set[str]] = {path: set(re.findall(r"\w+", text))
                                   for path, text in texts.items()}
    unused = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue  # the public API: its users are outside the repository
        for node in ast.parse(texts[path]).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple))
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                for item in node.value.elts:
                    name = ast.literal_eval(item)
                    if not any(name in found for other, found in words.items() if other != path):
                        unused.append(f"{path.relative_to(root)}: {name}")
    assert not unused, ("exported in __all__ and used nowhere else (delete it if nothing uses "
                        "it, else drop it from __all__): " + ", ".join(unused))


def test_the_check_finds_each_kind_of_duplicate(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    for sub, source in (("a", "class Part:\n    class _Slot: ...\n\ndef run(): ...\n"),
                        ("b", "class _Slot: ...\n\nasync def run(): ...\n\ndef _run(): ...\n")):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("def helper(): ...\n")
        (package / sub / "schema.py").write_text(source)
    found = _duplicates(package)
    assert found["module"] == {"schema": ["pkg/a/schema.py", "pkg/b/schema.py"]}
    assert found["class"] == {"_Slot": ["pkg/a/schema.py", "pkg/b/schema.py"]}
    assert found["function"] == {"helper": ["pkg/a/__init__.py", "pkg/b/__init__.py"],
                                 "run": ["pkg/a/schema.py", "pkg/b/schema.py"]}
