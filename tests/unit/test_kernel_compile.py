"""The sm90 compile check (longserve/testing/kernel_compile.py): an interpreted launch is recorded with its
argument types and constexpr values, and the real compiler, with no GPU, builds the good kernel and refuses the
one the interpreter runs happily (a helper returning two types from constexpr branches, as the MoE kernel's
did before it failed on an H200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from longserve.testing import kernel_compile, sass  # noqa: E402


@triton.jit
def _pick(x, MODE: tl.constexpr):
    if MODE == 1:
        return x * 2.0, 1.0
    return x.to(tl.int32), 1.0  # a second return of another type: the compiler refuses, the interpreter not


@triton.jit
def _good_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, OUT_TY: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, (x * scale).to(OUT_TY), mask=offs < n)


@triton.jit
def _bad_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    y, s = _pick(x, MODE)
    tl.store(out_ptr + offs, y * s, mask=offs < n)


@triton.jit
def _rounded_sum_kernel(x_ptr, a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """out = round(x + round(a * b)) in bf16, as torch computes x + a * b; under the interpreter a plain sum (its
    own path, as the kernels' INTERPRET_BF16 paths are)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if INTERPRET_BF16:
        y = x + a * b
    else:
        y = x + (a * b).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + offs, y.to(tl.bfloat16), mask=offs < n)


@triton.jit(do_not_specialize=["m"])
def _strided_kernel(x_ptr, out_ptr, n, m, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs * stride, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x + m, mask=offs < n)


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
def test_launch_record_names_types_and_constexprs():
    kernel_compile.record_launches()
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty(10, dtype=torch.bfloat16)
    _good_kernel[(1,)](x, out, 10, 0.5, BLOCK=16, OUT_TY=tl.bfloat16, num_warps=2)
    torch.testing.assert_close(out.float(), x * 0.5)
    rec = kernel_compile.launch_record(_good_kernel.fn, (x, out, 10, 0.5), {"BLOCK": 16, "OUT_TY": tl.bfloat16,
                                                                            "num_warps": 2})  # fmt: skip
    assert rec["signature"] == {"x_ptr": "*fp32", "out_ptr": "*bf16", "n": "i32", "scale": "fp32",
                                "BLOCK": "constexpr", "OUT_TY": "constexpr"}  # fmt: skip
    assert rec["constexprs"] == {"BLOCK": 16, "OUT_TY": {"tl_dtype": "bf16"}}
    assert rec["specialization"] == {"x_ptr": "D", "out_ptr": "D"}  # n=10 is neither 1 nor a multiple of 16
    assert rec["options"] == {"num_warps": 2} and rec["name"] == "_good_kernel"
    assert any(r == rec for r in kernel_compile._RECORDS.values())  # the launch itself was recorded


def test_a_host_tensor_descriptor_is_typed_by_element_and_block() -> None:
    """A TMA kernel's host descriptors (kernels/swiglu_gemm.py) recorded as the compiler's `tensordesc` type, so its
    variants get the sm90 compile check too."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = TensorDescriptor.from_tensor(torch.zeros(64, 96, dtype=torch.float16), [32, 16])
    assert kernel_compile._arg_type(desc) == "tensordesc<fp16[32, 16]>"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
@pytest.mark.skipif(not _nvidia_backend(), reason="triton's nvidia backend is not installed")
def test_the_compiler_refuses_what_the_interpreter_ran(tmp_path):
    kernel_compile.record_launches()
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8, dtype=torch.float32)
    _bad_kernel[(1,)](x, out, 8, BLOCK=8, MODE=1)  # the interpreter runs it
    torch.testing.assert_close(out, x * 2)
    _good_kernel[(1,)](x, out, 8, 2.0, BLOCK=8, OUT_TY=tl.float32)
    path = tmp_path / "records.jsonl"
    mine = [r for r in kernel_compile._RECORDS.values() if r["module"] == __name__]
    path.write_text("".join(json.dumps(r) + "\n" for r in mine))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # this module is imported by its own name, as pytest did
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([root, here])}
    done = subprocess.run([sys.executable, "-m", "longserve.testing.kernel_compile", str(path)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
    results = {json.loads(line)["kernel"]: json.loads(line) for line in done.stdout.splitlines()}
    assert results["_good_kernel"]["ok"] and results["_good_kernel"]["stages"][-1] == "cubin", results
    assert not results["_bad_kernel"]["ok"], results["_bad_kernel"]
    assert done.returncode == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
@pytest.mark.skipif(not _nvidia_backend(), reason="triton's nvidia backend is not installed")
def test_a_rounding_fused_away_fails_the_check(tmp_path):
    """The GPU's variant of an interpreted launch is compiled (INTERPRET_BF16 recorded True, compiled False), and
    its product rounded before the sum, fused by Triton's default FP fusion into a bf16 FMA, fails the check;
    launched with activation.ROUNDED_AS_TORCH it compiles."""
    from longserve.kernels.activation import ROUNDED_AS_TORCH

    kernel_compile.record_launches()
    x, a, b = (torch.randn(8, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
    out = torch.empty(8, dtype=torch.bfloat16)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([root, here])}
    for options, ok in (({}, False), (ROUNDED_AS_TORCH, True)):
        _rounded_sum_kernel[(1,)](x, a, b, out, 8, BLOCK=8, INTERPRET_BF16=True, **options)
        (rec,) = [
            r
            for r in kernel_compile._RECORDS.values()
            if r["name"] == "_rounded_sum_kernel" and r["options"] == options
        ]
        assert rec["constexprs"]["INTERPRET_BF16"] is True and rec["options"] == options
        path = tmp_path / "records.jsonl"
        path.write_text(json.dumps(rec) + "\n")
        done = subprocess.run([sys.executable, "-m", "longserve.testing.kernel_compile", str(path)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
        (result,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert result["ok"] is ok, result
        if not ok:
            assert "16-bit FMAs" in result["error"] and "fma.rn.bf16" in result["error"], result


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
@pytest.mark.skipif(not _nvidia_backend(), reason="triton's nvidia backend is not installed")
def test_a_launch_compiles_with_the_jits_specializations(tmp_path):
    """As the JIT keys a GPU launch: an integer of 1 becomes a constant and 16-divisible integers and pointers are
    marked, except where the kernel's do_not_specialize says not (m); an odd stride is an argument."""
    kernel_compile.record_launches()
    x = torch.arange(64, dtype=torch.float32)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([root, here])}
    for n, stride, constants, divisible in ((32, 1, ["stride"], ["n", "out_ptr", "x_ptr"]),
                                            (20, 3, [], ["out_ptr", "x_ptr"])):  # fmt: skip
        out = torch.empty(n, dtype=torch.float32)
        _strided_kernel[(1,)](x, out, n, 32, stride, BLOCK=32)
        torch.testing.assert_close(out, x[: n * stride : stride] + 32)
        (rec,) = [r for r in kernel_compile._RECORDS.values()
                  if r["name"] == "_strided_kernel" and r["specialization"].get("stride") == ("1" if stride == 1 else None)]  # fmt: skip
        path = tmp_path / "records.jsonl"
        path.write_text(json.dumps(rec) + "\n")
        done = subprocess.run([sys.executable, "-m", "longserve.testing.kernel_compile", str(path)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=root)  # fmt: skip
        (result,) = [json.loads(line) for line in done.stdout.splitlines()]
        assert result["ok"], result
        assert result["constants"] == constants and result["divisible"] == divisible, result
        assert result["regs"] > 0 and result["local"] == 0, result  # the cubin's resources, read by cuobjdump


_PTX_PRODUCTS = """
import json, re, sys
from longserve.testing import kernel_compile as kc
rec = json.loads(sys.argv[1])
fn = kc.recorded_kernel(rec)
k = kc.compile_sm90(fn, *kc.specialized(fn, rec), **rec["options"])
print(json.dumps(sorted(set(re.findall(r"mma\\.sync\\.aligned\\S*|wgmma\\.mma_async\\S*", k.asm["ptx"])))))
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records interpreted launches")
@pytest.mark.skipif(not _nvidia_backend(), reason="triton's nvidia backend is not installed")
def test_fp8_products_compile_as_the_gpu_runs_them(tmp_path):
    """An interpreted fp8 block GEMM compiles for sm90 with the GPU's products, not the interpreter's: e4m3 operands
    (at FP8_DOT_MAX_IMPRECISE_ACC 0 converted to f16 for mma.sync) where the K step is 32 or more, fp32 (tf32 mma,
    exact for e4m3) under FP8_DOT_MIN_K, where sm90's fp8 dot refuses to compile. Before INTERPRET_* was the rule,
    every recorded fp8 launch compiled as the interpreter's fp32 dot."""
    from longserve.kernels.quant_fp8 import FP8_DOT_MAX_IMPRECISE_ACC, fp8_block_gemm

    assert FP8_DOT_MAX_IMPRECISE_ACC == 0  # else the fp8 variant builds wgmma on e4m3: update the expectation
    kernel_compile.record_launches()
    g = torch.Generator().manual_seed(0)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": root}
    for block_k, products in ((32, ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]),
                              (16, ["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"])):  # fmt: skip
        xq = torch.randn(4, 64, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn)
        # scale blocks 48 rows tall: this test's records among those other tests in the process left
        x_scale, w_scale = torch.rand(4, 64 // block_k, generator=g), torch.rand(1, 64 // block_k)
        fp8_block_gemm(xq, x_scale, w, w_scale, (48, block_k), torch.float32)
        (rec,) = [r for r in kernel_compile._RECORDS.values() if r["name"] == "_fp8_block_gemm_kernel"
                  and (r["constexprs"]["GROUP_N"], r["constexprs"]["BLOCK_K"]) == (48, block_k)]  # fmt: skip
        assert rec["constexprs"]["FP32_DOT"] is (block_k == 16)
        done = subprocess.run([sys.executable, "-c", _PTX_PRODUCTS, json.dumps(rec)], env=env, capture_output=True,
                              text=True, timeout=300, cwd=root)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.splitlines()[-1]) == products


# nvdisasm's layout: a kernel's main loop, then an mbarrier wait's retry block at the function's end branching back
# into it (as the Gluon attention draft's are laid out)
_SASS = """        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ ;
        /*0020*/                   FADD R2, R2, R3 ;
        /*0030*/               @P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
.L_x_1:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], RZ ;
        /*0060*/              @!P0 BRA `(.L_x_0) ;
"""


def test_the_innermost_loop_is_the_main_loop_not_a_retry_branch_across_it() -> None:
    assert len(sass.loop_instructions(_SASS)) == 6  # the longest: the retry branch's span
    main = sass.innermost_loop(_SASS, "HGMMA")
    assert [line.split("*/")[0].strip() + "*/" for line in main] == ["/*0010*/", "/*0020*/", "/*0030*/"]
    assert sass.opcode_counts(main) == {"HGMMA": 1, "FADD": 1, "BRA": 1}
    assert sass.innermost_loop(_SASS, "IMMA") == []
