"""Source contract on the local filesystem (``file://``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .contract import Backend, SourceContract


class TestFileSource(SourceContract):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Backend:
        root = tmp_path / "remote"
        root.mkdir()

        def put(key: str, data: bytes) -> None:
            path = root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

        return Backend(root=f"file://{root}", put=put)
