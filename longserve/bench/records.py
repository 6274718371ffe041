"""Committed benchmark records as text: plain, gzip (`.gz`) or xz (`.xz`, what benchmarks/results/ keeps since the
nineteenth session: ~20% smaller than gzip on `bench compare`'s results.json and the server's step logs, and the
tree the GPU machine copies has a 64 MiB cap shared with the vLLM anchor: tests/unit/test_repo_size.py)."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path
from typing import IO


def open_record(path: str | Path, errors: str = "strict") -> IO[str]:
    """A record file opened for reading text, decompressed by its suffix (errors: as open's, for tools' logs)."""
    name = str(path)
    if name.endswith(".xz"):
        return lzma.open(name, "rt", encoding="utf-8", errors=errors)
    if name.endswith(".gz"):
        return gzip.open(name, "rt", encoding="utf-8", errors=errors)
    return open(name, encoding="utf-8", errors=errors)  # noqa: SIM115 (the caller's `with` closes it)


def find_record(folder: str | Path, name: str) -> Path:
    """folder/name as committed: plain, `.xz` or `.gz` (the first that exists)."""
    for suffix in ("", ".xz", ".gz"):
        path = Path(folder) / (name + suffix)
        if path.exists():
            return path
    raise FileNotFoundError(f"no {name}, {name}.xz or {name}.gz in {folder}")
