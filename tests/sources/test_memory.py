"""Source contract on fsspec's in-memory filesystem (``memory://``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import fsspec
import pytest

from .contract import Backend, SourceContract


class TestMemorySource(SourceContract):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        fs = fsspec.filesystem("memory")
        root = f"/contract-{uuid.uuid4().hex}"

        def put(key: str, data: bytes) -> None:
            fs.pipe_file(f"{root}/{key}", data)

        yield Backend(root=f"memory://{root}", put=put)
        if fs.exists(root):
            fs.rm(root, recursive=True)
