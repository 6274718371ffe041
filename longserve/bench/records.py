"""Committed benchmark records as text: plain, gzip (`.gz`) or xz (`.xz`, what benchmarks/results/ keeps since the
nineteenth session: ~20% smaller than gzip on `bench compare`'s results.json and the server's step logs, and the
tree the GPU machine copies has a 64 MiB cap shared with the vLLM anchor: tests/unit/test_repo_size.py)."""

from __future__ import annotations

import gzip
import lzma
import os
import re
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


# benchmarks/results/DATE_COMMIT_WHAT: the date and the commit (with any +suffix) a record folder's name starts with
_CALL = re.compile(r"(\d{4}-\d\d-\d\d)_([0-9a-f]{7}[^_]*)")


def call_name(folder: str | Path) -> str:
    """'MM-DD commit' of the call a record folder holds, from its name or its parent's (a mode's folder inside a
    call's); the folder's own name when neither is a call's."""
    path = os.path.normpath(folder)
    name = os.path.basename(path)
    m = _CALL.match(name) or _CALL.match(os.path.basename(os.path.dirname(path)))
    return f"{m.group(1)[5:]} {m.group(2)}" if m else name
