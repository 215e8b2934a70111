"""One cell of the S3 configuration matrix (tests/test_s3_matrix.py): open a source the way a
daemon's sampler does, list it, read every object with one client, and say what came back.

Run in the test process, or as a script in a process of its own (a cell that needs its own
``/etc/hosts``, for virtual-hosted addressing at ``<bucket>.localhost``)::

    python -m common.s3matrix '{"url": ..., "options": {...}, "client": ..., "env": {...}}'

prints one JSON object: ``{"client": who read, "values": {key: hex bytes or "Error: ..."}}``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def read_source(url: str, options: dict[str, Any], client: str
                ) -> tuple[str, dict[str, bytes | str]]:
    """``(who read the objects, {key: bytes, or "ErrorClass: message"})`` of ``url``."""
    import s3fs

    from epochcache.ingest.layouts import SourceSpec, open_source

    # s3fs keeps a filesystem per set of options: one made under another environment would
    # be handed back
    s3fs.S3FileSystem.clear_instance_cache()
    spec = SourceSpec(url=url, storage_options=options, checks=(), client=client,
                      pattern="**", timeout_s=10, connect_timeout_s=5, retries=1)
    source = open_source(spec)
    values: dict[str, bytes | str] = {}
    for ref, value in source.fetch_many(source.list_keys()):
        values[ref.key] = value if isinstance(value, bytes) else f"{type(value).__name__}: {value}"
    s3fs.S3FileSystem.clear_instance_cache()
    return source.client, values


def main(argv: list[str]) -> int:
    cell = json.loads(argv[1])
    os.environ.update(cell.get("env") or {})
    who, values = read_source(cell["url"], cell["options"], cell["client"])
    print(json.dumps({"client": who, "values": {
        key: value.hex() if isinstance(value, bytes) else value for key, value in values.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
