"""The next RMSNorm in a one-row GEMV's epilogue (kernels/gemv_fused.py, gluon_gemv.NORM_EPILOGUE): the model hands
each o and down projection the norm that follows it (the layer's post-attention norm; the next layer's input norm, the
last layer the model's final norm), and the int4 and block-FP8 GEMVs launch their kernel with the norm's arguments,
or decline (None) where a launch after the kernel would sum its splits. The kernels are Gluon (captured here, not
run; tests/gpu/ runs them against fused_add_rms_norm)."""

from __future__ import annotations

import pytest
import torch

from longserve.kernels.activation_reference import silu_and_mul_ref
from longserve.kernels.norm_reference import fused_add_rms_norm_ref
from longserve.models.linear_method import UnquantizedLinearMethod

pytest.importorskip("triton.experimental.gluon")

from longserve.kernels import fp8_wgmma_gemv as wg  # noqa: E402
from longserve.kernels import gemv_fused, gluon_gemv, split_k  # noqa: E402
from longserve.kernels import int4_mma_gemv as mma  # noqa: E402
from longserve.testing.kernel_compile import CapturedLaunches  # noqa: E402


class Cuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the launchers' routing checked without a GPU."""

    is_cuda = True


def test_the_model_hands_each_projection_the_norm_after_it(tmp_path, monkeypatch) -> None:
    """A one-token decode step through a method that does the add and norm itself (apply_then_norm, the reference's
    math) gives the logits of the plain model, bit for bit, and each layer's o projection got that layer's
    post-attention norm, its down projection the next layer's input norm (the last: the final norm); a prefill of
    several tokens asks too and is declined."""
    from longserve.models import load_hf_config, load_model
    from longserve.testing.checkpoints import make_tiny_checkpoint
    from tests.model.test_models_vs_hf import PAGE_IDS, new_cache, run_step

    path = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=3)
    model = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    ids = torch.arange(5, 14)

    def step(m):
        cache = new_cache(m)
        run_step(m, cache, [ids[:-1]], [0], [PAGE_IDS])
        return run_step(m, cache, [ids[-1:]], [len(ids) - 1], [PAGE_IDS])  # one row

    plain = step(model)
    asked = []

    def fused(self, layer, x, bias, residual, norm_weight, eps, gated=False):
        asked.append((layer, norm_weight, x.shape[0]))
        if x.shape[0] != 1:
            return None
        y = self.apply(layer, silu_and_mul_ref(x) if gated else x, bias)
        return fused_add_rms_norm_ref(y, residual, norm_weight, eps)

    monkeypatch.setattr(UnquantizedLinearMethod, "apply_then_norm", fused, raising=False)
    assert torch.equal(step(model), plain)
    decoder = model.model
    layers = decoder.layers
    want = []
    for i, layer in enumerate(layers):
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.norm
        want += [(layer.self_attn.o_proj, layer.post_attention_layernorm.weight),
                 (layer.mlp.down_proj, after.weight)]  # fmt: skip
    prefill, decode = asked[: len(want)], asked[len(want) :]
    for got in (prefill, decode):
        assert [(a, w) for a, w, _ in got] == [(a, w) for a, w in want]  # the same objects, in order
    assert {rows for *_, rows in prefill} == {len(ids) - 1} and {rows for *_, rows in decode} == {1}


def _int4(n: int, k: int):
    return torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 128, dtype=torch.float16)


@pytest.mark.parametrize("serial", [True, False])
def test_the_int4_ring_takes_the_norm(serial: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """wna16_gemv_then_norm at one row (the 8B o projection): the kernel gets NORM, the next power of two of N, the
    residual, weight, the [2, N] output, one counter and eps, its split summed in the kernel; the results are the
    output's two rows. A split whose partials a launch after would sum: declined before launching. Off, two rows,
    a residual of another dtype: declined."""
    launches = CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(mma, "supported", lambda: True)
    monkeypatch.setattr(mma, "use_pdl", lambda t: False)  # the tensor's faked CUDA: no device to ask
    monkeypatch.setattr(split_k, "num_sms", lambda index: 132)
    monkeypatch.setattr(split_k, "SPLIT_K_SERIAL_REDUCE", serial)
    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", True)
    n = k = 4096
    w, s = _int4(n, k)
    x = torch.zeros(1, k, dtype=torch.bfloat16).as_subclass(Cuda)
    residual, weight = torch.zeros(1, n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    got = gemv_fused.wna16_gemv_then_norm(x, w, s, None, None, 4, 128, None, residual, weight, 1e-5)
    if not serial:
        assert got is None and not launches.calls
        return
    (grid, args, kw) = launches.calls[0]
    assert kw["NORM"] and kw["NORM_BLOCK"] == 4096 and kw["SERIAL"] and kw["PARTIAL"] and grid[1] > 1
    nres, nw, nout, nlock, eps = args[-5:]
    assert nres is residual and nw is weight and nout.shape == (2, n) and nlock.numel() == 1 and eps == 1e-5
    normed, new_residual = got
    assert normed.data_ptr() == nout.data_ptr() and new_residual.data_ptr() == nout[1].data_ptr()
    assert normed.shape == new_residual.shape == (1, n)
    for declined in (
        lambda: gemv_fused.wna16_gemv_then_norm(
            x.repeat(2, 1), w, s, None, None, 4, 128, None, residual, weight, 0
        ),
        lambda: gemv_fused.wna16_gemv_then_norm(
            x, w, s, None, None, 4, 128, None, residual.half(), weight, 0
        ),
    ):
        assert declined() is None
    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", False)
    assert gemv_fused.wna16_gemv_then_norm(x, w, s, None, None, 4, 128, None, residual, weight, 0) is None
    assert len(launches.calls) == 1


def test_a_gated_down_projection_norms_after_silu_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The down projection (gate|up) with the GATED kernels off: silu(gate) * up made first, the norm still in the
    GEMV (int4 and block FP8); with INT4_MMA_GATED on the kernel takes gate|up itself."""
    from longserve.kernels import quant_fp8, quant_gemv

    monkeypatch.setattr(quant_gemv, "INT4_MMA_GATED", False)
    monkeypatch.setattr(quant_fp8, "FP8_WGMMA_GATED", False)
    launches, wg_launches = CapturedLaunches(), CapturedLaunches()
    monkeypatch.setattr(mma, "int4_mma_gemv_kernel", launches)
    monkeypatch.setattr(wg, "fp8_wgmma_gemv_kernel", wg_launches)
    monkeypatch.setattr(mma, "supported", lambda: True)
    monkeypatch.setattr(wg, "supported", lambda: True)
    for module in (mma, wg):
        monkeypatch.setattr(module, "use_pdl", lambda t: False)  # the tensor's faked CUDA: no device to ask
    monkeypatch.setattr(split_k, "num_sms", lambda index: 132)
    monkeypatch.setattr(gluon_gemv, "NORM_EPILOGUE", True)
    made = []
    monkeypatch.setattr(gemv_fused, "silu_and_mul", lambda x: made.append(x) or x[:, : x.shape[1] // 2] * 1)
    n, k = 4096, 14336
    w, s = _int4(n, k)
    gate_up = torch.zeros(1, 2 * k, dtype=torch.bfloat16).as_subclass(Cuda)
    residual, weight = torch.zeros(1, n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    norm = (residual, weight, 1e-6)
    assert (
        gemv_fused.wna16_gemv_then_norm(gate_up, w, s, None, None, 4, 128, None, *norm, gated=True)
        is not None
    )
    assert made[-1] is gate_up and not launches.calls[-1][2]["GATED"] and launches.calls[-1][2]["NORM"]
    monkeypatch.setattr(quant_gemv, "INT4_MMA_GATED", True)
    gemv_fused.wna16_gemv_then_norm(gate_up, w, s, None, None, 4, 128, None, *norm, gated=True)
    assert len(made) == 1 and launches.calls[-1][2]["GATED"] and launches.calls[-1][2]["NORM"]
    w8, s8 = torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n // 128, k // 128)
    assert (
        gemv_fused.fp8_block_linear_then_norm(gate_up, w8, s8, (128, 128), None, *norm, gated=True)
        is not None
    )
    (grid, args, kw) = wg_launches.calls[-1]
    assert made[-1] is gate_up and not kw["GATED"] and kw["NORM"] and kw["NORM_BLOCK"] == 4096
    assert args[-5] is residual and args[-4] is weight
