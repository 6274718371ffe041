"""Where code may import from: the tokenization package stays below the server and the engine, runner/ never
imports the worker program (it spawns it by name, and that name resolves), and no script imports `tests`
(the tiny-checkpoint maker is longserve.testing)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    """Absolute module names a file imports anywhere (function-level ones too); `from a import b` gives a and
    a.b. Relative imports are not used in this repository."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def offending(files: list[Path], banned: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files
        for name in imports_of(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


def test_the_reader_finds_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import a.b\nfrom c import d\n\ndef f():\n    from e.f import g\n")
    assert imports_of(src) == {"a.b", "c", "c.d", "e.f", "e.f.g"}
    engine = [ROOT / "longserve" / "engine.py"]
    assert offending(engine, ("longserve.tokenization",)) != []
    assert offending(engine, ("longserve.tok",)) == []  # a prefix of a name is not that name


def test_tokenization_imports_nothing_above_it() -> None:
    files = sorted((ROOT / "longserve" / "tokenization").glob("*.py"))
    assert {p.name for p in files} >= {"tokenizer.py", "prefix_token_cache.py", "detokenizer.py", "pool.py"}
    above = ("longserve.server", "longserve.engine", "longserve.runner", "longserve.llm", "longserve.bench")
    assert offending(files, above) == []


def test_runner_spawns_the_worker_program_by_a_name_that_resolves() -> None:
    from longserve.runner import tp_workers

    assert offending(sorted((ROOT / "longserve" / "runner").glob("*.py")), ("longserve.worker",)) == []
    module, _, name = tp_workers.WORKER_ENTRY.partition(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_no_script_imports_the_tests() -> None:
    scripts = sorted((ROOT / "scripts").rglob("*.py"))
    assert len(scripts) >= 10
    assert offending(scripts, ("tests",)) == []
