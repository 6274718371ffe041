"""Zero-centered RMSNorm (Qwen3.5's, Qwen3-Next's, Gemma's: the weight is stored as an offset from 1, and the
scale (1 + w) is applied in float32 before the one cast): the reference against transformers' own modules, the
Triton kernel (interpreted on the CPU) against the reference with and without the fused residual add, and
layers.RMSNorm's paths."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from longserve.kernels.norm_reference import fused_add_rms_norm_ref, rms_norm_ref  # noqa: E402
from longserve.models.layers import RMSNorm  # noqa: E402

HIDDEN, EPS = 48, 1e-6  # 48: not a power of two


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hf_class", ["qwen3_5_moe.Qwen3_5MoeRMSNorm", "qwen3_next.Qwen3NextRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_and_layer_equal_transformers(hf_class: str, dtype) -> None:
    """rms_norm_ref(zero_centered=True), its residual-add form and RMSNorm(zero_centered=True) (CPU path, the
    checkpoint's offset loaded as it is) equal HF's module bit for bit; a fresh layer is the identity norm as
    HF's."""
    pytest.importorskip("transformers")
    import importlib

    module, name = hf_class.split(".")
    cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    hf = cls(HIDDEN, eps=EPS).to(dtype)
    ours = RMSNorm(HIDDEN, EPS, zero_centered=True).to(dtype)
    x, res = (3 * randn(7, HIDDEN, seed=1)).to(dtype), randn(7, HIDDEN, seed=2).to(dtype)
    assert torch.equal(ours(x), hf(x))  # both weights zero: the plain normalization
    with torch.no_grad():
        hf.weight.copy_(0.5 * randn(HIDDEN, seed=3))
        ours.weight.copy_(hf.weight)
    assert torch.equal(rms_norm_ref(x, hf.weight, EPS, zero_centered=True), hf(x))
    assert torch.equal(ours(x), hf(x)) and ours(x).dtype == dtype
    y, new_res = ours(x, res)
    assert torch.equal(new_res, res + x) and torch.equal(y, hf(res + x))  # the decoder's residual + hidden
    assert torch.equal(fused_add_rms_norm_ref(x, res, hf.weight, EPS, True)[0], y)
    llama_rounding = rms_norm_ref(x, 1.0 + hf.weight.float(), EPS).to(
        dtype
    )  # cast, then scale: not HF's here
    assert dtype == torch.float32 or not torch.equal(llama_rounding, hf(x))


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize(
    ("dtype", "w_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
     (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
def test_kernel_equals_reference(residual: bool, dtype, w_dtype) -> None:
    """The ZERO_CENTERED variant of the norm kernel against the reference: float16 bit for bit (the one rounding
    where HF rounds; the interpreter rounds to bfloat16 its own way, so bfloat16 is only close), the output in x's
    dtype whatever the weight's, the residual stream exact (bfloat16: close); the Llama variant keeps its promoted
    dtype."""
    pytest.importorskip("triton")
    from longserve.kernels.norm import fused_add_rms_norm, rms_norm

    x, res = (3 * randn(7, HIDDEN, seed=4)).to(dtype), randn(7, HIDDEN, seed=5).to(dtype)
    w = (0.5 * randn(HIDDEN, seed=6)).to(w_dtype)
    if residual:
        y, new_res = fused_add_rms_norm(x, res, w, EPS, True)
        y_ref, new_res_ref = fused_add_rms_norm_ref(x, res, w, EPS, True)
        torch.testing.assert_close(new_res, new_res_ref, atol=0, rtol=0 if dtype != torch.bfloat16 else 1e-2)
    else:
        y, y_ref = rms_norm(x, w, EPS, zero_centered=True), rms_norm_ref(x, w, EPS, zero_centered=True)
    assert y.dtype == y_ref.dtype == dtype
    if dtype == torch.float16:
        assert torch.equal(y, y_ref)
    else:  # float32: the variance sums in another order
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    assert rms_norm(x, w, EPS).dtype == torch.promote_types(dtype, w_dtype)  # Llama's as before


def test_layer_fused_path_and_then_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm(zero_centered=True) with the Triton path forced agrees with its CPU path (the flag reaches the
    kernel), and a row-parallel product followed by it never takes a GEMV's fused norm epilogue (Llama's
    rounding)."""
    pytest.importorskip("triton")
    from longserve.models import layers as layers_mod
    from longserve.models.layers import RowParallelLinear

    norm = RMSNorm(HIDDEN, EPS, zero_centered=True).half()
    with torch.no_grad():
        norm.weight.copy_(0.5 * randn(HIDDEN, seed=7))
    x, res = (3 * randn(5, HIDDEN, seed=8)).half(), randn(5, HIDDEN, seed=9).half()
    ref, ref_add = norm(x), norm(x, res)
    linear = RowParallelLinear(HIDDEN, HIDDEN, bias=False)
    linear.weight.data = (0.1 * randn(HIDDEN, HIDDEN, seed=10)).half()
    then_ref = norm(linear(x), res)

    def epilogue(*args, **kwargs):
        raise AssertionError("a zero-centered norm went to the product's epilogue")

    monkeypatch.setattr(linear.quant_method, "apply_then_norm", epilogue)
    monkeypatch.setattr(layers_mod, "use_triton", lambda t: True)
    assert torch.equal(norm(x), ref)
    assert all(torch.equal(a, b) for a, b in zip(norm(x, res), ref_add, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(linear.then_norm(x, res, norm), then_ref, strict=True))
