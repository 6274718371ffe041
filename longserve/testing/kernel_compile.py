"""Compile for sm90, on a machine without a GPU, every Triton kernel variant the CPU tests launch.

Triton's interpreter (TRITON_INTERPRET=1, how CI runs our kernels) runs a kernel as Python: it accepts
programs that the real compiler refuses. On an H200 (2026-12-01) a MoE kernel helper returning two types from
constexpr branches passed every interpreted test and failed to compile on the GPU. The compiler needs no GPU
(triton ships its nvidia backend and ptxas), only the argument types and constexpr values of each launch,
which the interpreter sees: `record_launches()` notes them (one record per kernel, constexpr values, argument
types and the specializations the JIT would key on), and `compile_record()` builds that variant for sm90 down to
cubin in a process where TRITON_INTERPRET is off, as the GPU launches it (interpreter switches INTERPRET* off, integer
arguments of 1 as constants, 16-divisible integers and pointers marked so, as the JIT does), and refuses a 16-bit
FMA in its PTX (FMA16). tests/conftest.py records while the suite runs (LONGSERVE_RECORD_KERNELS=FILE) and
compiles what it recorded at the end (CI); tests/unit/test_kernel_compile.py checks the mechanism.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import subprocess
from collections.abc import Callable
from typing import Any

from longserve.testing import records
from longserve.testing.sass import cubin_tool, innermost_loop, opcode_counts, resource_usage

_RECORDS: dict[str, dict[str, Any]] = {}
# torch dtype name -> Triton's pointer element type
_TYPES = {
    "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
    "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}  # fmt: skip
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is not inspect.Parameter.empty and "constexpr" in (ann if isinstance(ann, str) else repr(ann))


def _encode(value: Any) -> Any:
    """A constexpr value as JSON: numbers, bools, None, strings; Triton dtypes by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None)  # tl.dtype
    if isinstance(name, str):
        return {"tl_dtype": name}
    raise TypeError(f"constexpr value {value!r} cannot be recorded")


def _arg_type(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    block = getattr(value, "block_shape", None)  # a host TMA descriptor (triton.tools.tensor_descriptor)
    if block is not None and isinstance(getattr(value, "base", None), torch.Tensor):
        return f"tensordesc<{_TYPES[str(value.base.dtype).removeprefix('torch.')]}{list(block)}>"
    raise TypeError(f"argument {value!r} of type {type(value).__name__} cannot be typed")


def sm90_compiler_missing() -> str | None:
    """Why this triton cannot compile for sm90 here (no nvidia backend, no ptxas), or None when it can."""
    try:
        import triton
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        return f"triton's nvidia backend is not installed ({e})"
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas) and not os.environ.get("TRITON_PTXAS_PATH"):
        return f"no ptxas at {ptxas}"
    return None


def _specialization(value: Any) -> str:
    """What the JIT keys a launch on for this argument, before a kernel's do_not_specialize lists: "1" (an integer
    equal to 1: compiled as a constant), "D" (an integer, or a pointer's address, divisible by 16), or "": Triton's
    own rule (its native_specialize_impl, Triton 3.6-3.9)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    spec = native_specialize_impl(BaseBackend, value, False, True, True)
    return "1" if spec[0] == "constexpr" else "D" if spec[1] == "D" else ""


def launch_record(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The record of one interpreted launch of @triton.jit function `fn` (the Python function)."""
    import torch

    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})
    signature, constexprs, specialization = {}, {}, {}
    for p in params:
        value = bound.get(p.name, p.default)
        if _is_constexpr(p) or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = _encode(None if value is inspect.Parameter.empty else value)
        else:
            signature[p.name] = _arg_type(value)
            integer = isinstance(value, int) and not isinstance(value, bool)
            if (isinstance(value, torch.Tensor) or integer) and (spec := _specialization(value)):
                specialization[p.name] = spec
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "specialization": specialization, "options": options}  # fmt: skip


def record_launches() -> None:
    """From now on, note every interpreted launch's variant (deduplicated) in this process."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_longserve_recording", False):
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        try:
            rec = launch_record(self.fn, args, kwargs)
            _RECORDS.setdefault(json.dumps(rec, sort_keys=True), rec)
        except (TypeError, KeyError):  # an argument we cannot type: the launch itself is not ours to judge
            pass
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._longserve_recording = True
    InterpretedFunction.run = recording_run


def dump_records(path: str) -> int:
    """Append this process's records to `path` (JSON lines; several processes may write one file)."""
    with open(path, "a") as f:
        for rec in _RECORDS.values():
            f.write(json.dumps(rec, sort_keys=True) + "\n")
    return len(_RECORDS)


def _features(rec: dict[str, Any]) -> set[records.Feature]:
    """What makes a variant's code differ: its constexpr switches (tile sizes aside) and its pointers' types."""
    return records.features(rec, lambda name: name.startswith(("BLOCK", "GROUP_M")))


def load_records(path: str, cover: bool = True, package: str = "") -> list[dict[str, Any]]:
    """The distinct records of `path` of kernels in modules under `package` ("longserve.": ours, not a test's
    own); with `cover`, per kernel only the variants needed to cover every constexpr switch value and pointer
    type seen (greedy, richest first): about 90 of 250 for the unit tests."""
    seen: dict[str, dict[str, Any]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["module"].startswith(package):
                seen.setdefault(json.dumps(rec, sort_keys=True), rec)
    if not cover:
        return list(seen.values())
    by_kernel: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key in sorted(seen):
        rec = seen[key]
        by_kernel.setdefault((rec["module"], rec["name"]), []).append(rec)
    return [rec for recs in by_kernel.values() for rec in records.covering(recs, _features)]


class CapturedLaunches:
    """Stands in for a kernel object (`kernel[grid](*args, **kw)`), recording (grid, args, kw) in `calls` instead of
    launching: a launcher's grid, strides and constants checked on a machine that cannot run the kernel (Gluon)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def compile_sm90(fn: Any, signature: dict, constexprs: dict, attrs: dict | None = None, **options: Any):
    """TTIR -> TTGIR -> LLVM -> PTX -> cubin of `fn` (a @triton.jit or @gluon.jit function, or a wrapper holding
    one in `.fn`) for sm90; `signature` maps every argument name to a Triton type ("*i32", "i32", "constexpr"),
    `attrs` maps argument names to specializations (e.g. [["tt.divisibility", 16]])."""
    import triton
    from triton.backends.compiler import GPUTarget

    while not hasattr(fn, "arg_names"):  # a launch wrapper (kernels/launch.py's FastKernel) around the kernel
        fn = fn.fn
    names = fn.arg_names
    spec = {(names.index(a),): v for a, v in (attrs or {}).items()}
    source = triton.compiler.ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # a @gluon.jit kernel
        from triton.experimental import gluon

        source = gluon._runtime.GluonASTSource
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=spec)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def gluon_sm90_report(fn: Any, signature: dict, constexprs: dict, **options: Any) -> dict[str, Any]:
    """A Gluon kernel built for sm90 here (the nvidia backend and ptxas, no GPU): the cubin's registers, stack and
    spills (`resource_usage`: each partition's warps at the cubin's maximum), its shared memory, the wgmma in the
    PTX, and the shortest loop holding HGMMA (a consumer's key-block loop): its length, its wgmma waits (a
    serialized build waits after every HGMMA) and its 12 most frequent opcodes. `signature` maps the arguments to
    Triton types, the constexprs included ("constexpr")."""
    k = compile_sm90(fn, signature, constexprs, **options)
    loop = innermost_loop(cubin_tool(k.asm["cubin"], "nvdisasm", "-c"), "HGMMA")
    return {
        **resource_usage(k.asm["cubin"]), "shared_meta": k.metadata.shared,
        "wgmma_in_ptx": k.asm["ptx"].count("wgmma.mma_async"), "loop_sass": len(loop),
        "loop_wgmma_waits": sum("WARPGROUP.DEPBAR" in line for line in loop),
        "loop_ops": dict(list(opcode_counts(loop).items())[:12]),
        "setmaxnreg": [x.strip() for x in k.asm["ptx"].splitlines() if "setmaxnreg" in x],
    }  # fmt: skip


def compiled_report(compiled: Any, variant: dict, **extra: Any) -> dict[str, Any]:
    """One JSON line of a scripts/dev/compile_*.py probe: the variant, the stages reached, `extra` facts
    read from the PTX, and the cubin's registers and spills (when cuobjdump runs here)."""
    import triton

    out = {"variant": variant, "triton": triton.__version__, "stages": list(compiled.asm), **extra}
    try:
        out.update(resource_usage(compiled.asm["cubin"]))
    except Exception as e:  # noqa: BLE001
        out["res_usage"] = f"unavailable: {e}"
    return out


def report_variants(report: Callable[[dict], dict], default: list[dict]) -> None:
    """A probe's main: each variant given as a JSON argument (or the probe's defaults), one line each."""
    import sys

    for variant in [json.loads(a) for a in sys.argv[1:]] or default:
        print(json.dumps(report(variant)), flush=True)


def interpreter_switch(name: str) -> bool:
    """A kernel's interpreter-only constexpr (INTERPRET, INTERPRET_*: its own rounding where the interpreter's casts
    truncate, its dots in fp32), False on the GPU: a recorded launch compiles as the GPU launches it. Before the
    names were one rule (fifty-second session) the fp8 dots of moe_gemm and quant_fp8's block GEMM (UPCAST_DOT)
    and the grouped int4 kernel's 16-bit dots (DOT_FP32) compiled in CI as the interpreter's fp32 dots."""
    return name == "INTERPRET" or name.startswith("INTERPRET_")


# A 16-bit FMA in a kernel's PTX is a rounding its source asks for (a product rounded to bf16 before a sum, as
# torch rounds) that LLVM's FP contraction fused away: on an H100 (fiftieth session) the shared expert's gated add
# so compiled had torch's bits in 75-84% of its elements. Such a launch takes activation.ROUNDED_AS_TORCH.
FMA16 = re.compile(r"\bfma\.rn(?:\.ftz)?(?:\.relu)?\.(?:bf16|f16)(?:x2)?\b")


def specialized(fn: Any, rec: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The signature, constexprs and attrs (by argument name, as compile_sm90 takes them) the JIT would compile a
    recorded launch of JITFunction `fn` with: an integer of 1 a constant and a 16-divisible integer or pointer
    marked so (the recorded specialization), unless the kernel's do_not_specialize (on_alignment) lists or a
    float/bool annotation exempt it. On an H100
    (fiftieth session's count, Triton 3.6) the 8B's decode kernel took 255 registers and 400 bytes of stack
    compiled without the marks, 166 and none with them: what the GPU runs is the specialized build."""
    import triton.language as tl

    signature = dict(rec["signature"])
    constexprs = {
        k: False if interpreter_switch(k) else tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v
        for k, v in rec["constexprs"].items()
    }
    attrs = {}
    for kp in fn.params:
        spec = rec.get("specialization", {}).get(kp.name, "")
        annotation = kp.annotation_type if isinstance(kp.annotation_type, str) else ""
        if not spec or kp.do_not_specialize or annotation == "u1" or annotation[:2] in ("fp", "bf"):
            continue
        if spec == "1":
            if not annotation:  # an annotated integer keeps its type, and the JIT marks nothing (Triton 3.6)
                signature[kp.name], constexprs[kp.name] = "constexpr", 1
        elif not kp.do_not_specialize_on_alignment:
            attrs[kp.name] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def recorded_kernel(rec: dict[str, Any]) -> Any:
    """The JITFunction a record names (kernels/launch.py's FastKernel unwrapped)."""
    import importlib

    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    while not hasattr(fn, "arg_names"):  # kernels/launch.py's FastKernel around the JITFunction
        fn = fn.fn
    return fn


def compile_record(rec: dict[str, Any]) -> dict[str, Any]:
    """Compile one recorded variant for sm90, as the GPU launches it (its interpreter_switch-es off, the JIT's
    specializations: `specialized`; TRITON_INTERPRET must be off in this process); a 16-bit FMA in its PTX (FMA16)
    is an error. The result names the arguments compiled as constants or marked divisible, and the cubin's
    registers and spills where cuobjdump runs."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile with the interpreter off"
    fn = recorded_kernel(rec)
    signature, constexprs, attrs = specialized(fn, rec)
    compiled = compile_sm90(fn, signature, constexprs, attrs, **rec["options"])
    fused = sorted(set(FMA16.findall(compiled.asm.get("ptx", ""))))
    if fused:
        raise ValueError(
            f"{rec['name']}: 16-bit FMAs {fused} in its PTX: a rounding of its source fused away"
        )
    constants = sorted(k for k in constexprs if k not in rec["constexprs"])
    out = {
        "kernel": rec["name"],
        **({"tile": rec["tile"]} if "tile" in rec else {}),
        "stages": list(compiled.asm),
        "constants": constants,
        "divisible": sorted(attrs),
    }
    # the cubin's resources where cuobjdump runs (the compile counts without them)
    with contextlib.suppress(OSError, subprocess.SubprocessError, KeyError):
        out.update(resource_usage(compiled.asm["cubin"]))
    return out


def _compile_line(rec: dict[str, Any]) -> dict[str, Any]:
    """compile_record's result as one line of the check's output, a failure with its variant."""
    try:
        return {"ok": True, **compile_record(rec)}
    except Exception as e:  # noqa: BLE001 - every failure is reported with its variant
        return {"ok": False, "kernel": rec["name"], "tile": rec.get("tile"), "module": rec["module"],
                "constexprs": rec["constexprs"], "signature": rec["signature"],
                "error": f"{type(e).__name__}: {e}"[-2000:]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """python -m longserve.testing.kernel_compile RECORDS.jsonl [--all] [--package PREFIX] [--jobs N]: compile the
    recorded variants (those covering every switch, or all; of modules under PREFIX), then the attention and fused
    MoE kernels' launches at the GPU's tiles (testing/gpu_tiles.py; lines with a "tile"), one JSON line each, in
    that order, over N processes (default 1: each compile is single-threaded, MLIR and ptxas); exit status 1 if
    any fails."""
    import multiprocessing
    import sys

    argv = sys.argv[1:] if argv is None else argv
    os.environ["TRITON_INTERPRET"] = "0"
    from longserve.testing.gpu_tiles import gpu_variants  # its kernels' config functions: the GPU's answers

    package = argv[argv.index("--package") + 1] if "--package" in argv else ""
    jobs = int(argv[argv.index("--jobs") + 1]) if "--jobs" in argv else 1
    records = load_records(argv[0], cover="--all" not in argv[1:], package=package)
    variants = records + gpu_variants(records)
    failed = 0
    with contextlib.ExitStack() as stack:
        lines: Any = map(_compile_line, variants)
        if jobs > 1:  # forked: the kernels' modules already imported with the interpreter off
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
            lines = pool.imap(_compile_line, variants)
        for line in lines:
            failed += not line["ok"]
            print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
