"""The 16-bit decode GEMV (kernels/dense_gemv.py) under TRITON_INTERPRET=1 against its reference F.linear: M = 1,
3, 8, float32/bf16/fp16, split-K with its fixed-order reduction, bias, N and K not multiples of the tiles; its
default grid on an H200; and its switch (DENSE_GEMV_MAX_TOKENS) routing the unquantized linear layers, the
logits and the MoE router of a model (a tiny Qwen3-MoE checkpoint: greedy tokens equal with it off and on).
Its compilation for sm90 runs in tests/unit/test_quant_gemv.py (scripts/dev/compile_quant_gemv.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels import dense_gemv as dg  # noqa: E402

CASES = [  # m, n, k, config overrides, bias
    (1, 96, 256, {}, False),
    (1, 70, 200, {"BLOCK_N": 8, "BLOCK_K": 64, "SPLIT_K": 2}, True),  # partial last tile and row block
    (3, 40, 384, {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 3}, True),
    (8, 33, 96, {"BLOCK_N": 4, "BLOCK_K": 32}, False),
]
TOLS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLS), ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,cfg,bias", CASES)
def test_gemv_equals_f_linear(m, n, k, cfg, bias, dtype) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = dg.dense_gemv(x, w, b, config=cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # exact products, fp32 sums
    torch.testing.assert_close(out.float(), ref, atol=TOLS[dtype], rtol=TOLS[dtype])


def test_split_k_is_deterministic_and_equal_to_one_split() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 512, generator=g), torch.randn(64, 512, generator=g)
    one = dg.dense_gemv(x, w, config={"SPLIT_K": 1, "BLOCK_K": 32})
    many = [dg.dense_gemv(x, w, config={"SPLIT_K": 5, "BLOCK_K": 32}) for _ in range(2)]
    assert torch.equal(many[0], many[1])
    torch.testing.assert_close(many[0], one, atol=1e-5, rtol=1e-5)


def test_config_fills_an_h200_with_few_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the A3B and 8B decode shapes the default grid runs >= 2 programs per SM (132 SMs) without splitting
    K; only the router's 128 rows split, as far as 2 tiles a split allow (4 of its 8)."""
    monkeypatch.setattr(dg, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for n, k, split in ((5120, 2048, 1), (2048, 4096, 1), (151936, 2048, 1), (6144, 4096, 1), (128, 2048, 4)):
        cfg = dg.dense_gemv_config(1, n, k, cuda)
        assert split > 1 or -(-n // cfg["BLOCK_N"]) >= 2 * 132, (n, k, cfg)
        assert cfg["SPLIT_K"] == split and cfg["BLOCK_K"] == 256, (n, k, cfg)


def test_the_switch_routes_decode_sizes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = dg.dense_gemv
    monkeypatch.setattr(dg, "dense_gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    w = torch.randn(24, 64)
    for m in (1, 5):
        dg.dense_linear(torch.randn(m, 64), w)
    assert calls == []  # off by default
    monkeypatch.setattr(dg, "DENSE_GEMV_MAX_TOKENS", 4)
    for m in (1, 4, 5):
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(dg.dense_linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert calls == [1, 4]


def test_a_moe_model_decodes_the_same_through_the_gemv(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE (attention projections, a dense MLP layer, router, logits) with the switch at 4: the
    decode steps' products (2 rows) go through the GEMV, the prefill's (8) not, and the greedy tokens equal
    the switch off."""
    from longserve import LLM, SamplingParams
    from longserve.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen3_moe", num_layers=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[3, 17, 29, 4, 11], [5, 8, 13]]
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=512, enable_prefix_caching=False) as llm:
        off = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        monkeypatch.setattr(dg, "DENSE_GEMV_MAX_TOKENS", 4)
        calls: list[int] = []
        real = dg.dense_gemv
        monkeypatch.setattr(
            dg, "dense_gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw)
        )
        on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert on == off
    assert 2 in calls and 8 not in calls, sorted(set(calls))  # the batch's decode steps; the prefill not
