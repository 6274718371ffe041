"""Run a module with some of longserve's tuning constants changed, to measure a switch before flipping it.

    python3 scripts/probes/with_constants.py longserve.kernels.quant_gemm.WNA16_GEMV_MAX_TOKENS=16 \
        -- longserve.bench.latency --config llama-3.1-8b --quantization gptq --decode-batch-sizes 1

Each `module.NAME=value` (a Python literal) is set on the imported module before the target module runs as
`__main__` with the arguments after `--` (a path ending in .py runs as that script). The constants must be read
at call time (the switches in kernels/ and models/ are), not copied at import by the module that runs.
"""

from __future__ import annotations

import ast
import importlib
import runpy
import sys
from pathlib import Path


def apply(assignments: list[str]) -> None:
    for item in assignments:
        target, sep, literal = item.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"expected module.NAME=value, got {item!r}")
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"{module_name} has no {name}")
        setattr(module, name, ast.literal_eval(literal))
        print(f"[with_constants] {module_name}.{name} = {getattr(module, name)!r}", flush=True)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    split = argv.index("--")
    apply(argv[:split])
    target, *args = argv[split + 1 :]
    sys.argv = [target, *args]
    if target.endswith(".py"):  # a script (scripts/gpu/bench_quant_accuracy.py): its folder first on the path
        sys.path.insert(0, str(Path(target).resolve().parent))
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
