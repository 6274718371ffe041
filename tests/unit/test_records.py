"""longserve.bench.records: a committed record reads the same plain, gzipped or xz-compressed, and is found by name
whichever it is (benchmarks/results/ moved from gzip to xz in the nineteenth session)."""

from __future__ import annotations

import gzip
import lzma

import pytest

from longserve.bench.records import find_record, open_record


def test_a_record_reads_alike_in_every_form(tmp_path) -> None:
    text = '{"runs": [{"requests": []}]}\n' * 100
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "results.json").write_text(text, encoding="utf-8")
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "results.json.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    (tmp_path / "xz").mkdir()
    with lzma.open(tmp_path / "xz" / "results.json.xz", "wt", encoding="utf-8") as f:
        f.write(text)
    for kind, suffix in (("plain", ""), ("gz", ".gz"), ("xz", ".xz")):
        path = find_record(tmp_path / kind, "results.json")
        assert path.name == "results.json" + suffix
        with open_record(path) as f:
            assert f.read() == text
    with pytest.raises(FileNotFoundError, match="results.json.xz"):
        find_record(tmp_path, "results.json")
