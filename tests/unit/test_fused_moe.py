"""Fused MoE: routing, block alignment invariants, the Triton kernel (TRITON_INTERPRET=1 on the CPU) against
the torch reference, the reference against a per-token loop and transformers 5's experts, the config table."""

from __future__ import annotations

import json
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels.fused_moe import fused_moe, moe_align_block_size, padded_size_bound  # noqa: E402
from longserve.kernels.moe_config import (  # noqa: E402
    CONFIG_DIR,
    config_file_name,
    default_moe_config,
    get_moe_config,
    load_table,
)
from longserve.kernels.moe_reference import MoEQuant, fused_moe_ref, route_topk  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = gen(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)  # [E, H, I]
    return w13, w2


def make_logits(num_tokens: int, num_experts: int, load: str, seed: int = 1) -> torch.Tensor:
    """Router logits: "even" (random), or "ragged": most tokens prefer experts 0 and 3, expert 2 none."""
    logits = torch.randn(num_tokens, num_experts, generator=gen(seed))  # [T, E]
    if load == "ragged":
        logits[:, 0] += 4.0
        logits[: num_tokens // 2, 3] += 4.0
        logits[:, 2] = -1e4
    return logits


# (T, E, k, H, I, renormalize, load): one token, k=1, E=6 top-2, E=8 top-3, I = 24/40 (not multiples of 16),
# ragged loads with an expert of 20+ rows (two 16-row blocks) and an expert with no tokens
CASES = {
    "one_token": (1, 4, 2, 32, 24, True, "even"),
    "k1": (9, 4, 1, 32, 40, False, "even"),
    "e6_top2": (11, 6, 2, 48, 24, True, "even"),
    "e8_top3_no_renorm": (13, 8, 3, 32, 40, False, "even"),
    "ragged_empty_expert": (24, 8, 2, 32, 24, True, "ragged"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_reference(case: str, dtype: torch.dtype) -> None:
    num_tokens, num_experts, top_k, hidden, inter, renorm, load = CASES[case]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen(2)).to(dtype)  # [T, H]
    weights, ids = route_topk(make_logits(num_tokens, num_experts, load), top_k, renorm)
    if load == "ragged":
        counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
        assert counts[2] == 0 and counts.max() > 16  # the case really is ragged with an idle expert
    # Mixtral multiplies by fp32 weights, Qwen-MoE by weights rounded to the dtype: both roundings
    for w in {weights, weights.to(dtype)}:
        out = fused_moe(x, w13, w2, w, ids)  # [T, H]
        ref = fused_moe_ref(x, w13, w2, w, ids)  # [T, H]
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        assert (out - ref).float().norm() <= 2e-3 * ref.float().norm() + 1e-6  # rounding-level overall


@pytest.mark.parametrize("case", ["one_token", "k1", "e8_top3_no_renorm", "ragged_empty_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_small_batch_kernels_match_reference(case: str, dtype: torch.dtype, monkeypatch) -> None:
    """moe_gemv (two launches: gate+up per pair, down with the sum over k per token) equals the reference,
    with Mixtral's fp32 and Qwen-MoE's rounded routing weights, through fused_moe under its token limit;
    blocks narrower than H and I (masked tails: I = 24/40, 16-wide tiles)."""
    import longserve.kernels.fused_moe as fm
    from longserve.kernels.moe_gemv import moe_gemv

    num_tokens, num_experts, top_k, hidden, inter, renorm, load = CASES[case]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen(2)).to(dtype)  # [T, H]
    weights, ids = route_topk(make_logits(num_tokens, num_experts, load), top_k, renorm)
    for w in {weights, weights.to(dtype)}:
        ref = fused_moe_ref(x, w13, w2, w, ids)  # [T, H]
        out = moe_gemv(x, w13, w2, w, ids, torch.empty_like(x), up=(16, 16, 4), down=(16, 16, 4))
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        assert (out - ref).float().norm() <= 2e-3 * ref.float().norm() + 1e-6
    calls = []
    monkeypatch.setattr(fm, "MOE_GEMV_MAX_TOKENS", num_tokens)
    real = moe_gemv
    monkeypatch.setattr(
        "longserve.kernels.moe_gemv.moe_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, ids), expected, atol=TOL[dtype], rtol=TOL[dtype]
    )
    assert calls == [1]
    monkeypatch.setattr(fm, "MOE_GEMV_MAX_TOKENS", num_tokens - 1)
    fused_moe(x, w13, w2, weights, ids)
    assert calls == [1]  # over the limit: the grouped GEMMs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_over_k_kernel_equals_torch_sum(dtype: torch.dtype, monkeypatch) -> None:
    """kernels/moe_sum.py: [T, k, H] summed over k in fp32, rounded once, as torch.sum with out= (H not a
    power of two: a masked tail; a strided view of the pairs); fused_moe takes it under its token limit with the
    same result as torch.sum."""
    import longserve.kernels.fused_moe as fm
    from longserve.kernels.moe_sum import moe_sum

    g = gen(7)
    for tokens, k, hidden in ((1, 8, 200), (3, 2, 64), (5, 3, 1030)):
        x = torch.randn(tokens, k, hidden + 6, generator=g).to(dtype)[:, :, 3 : 3 + hidden]
        want = torch.empty(tokens, hidden, dtype=dtype)
        torch.sum(x, dim=1, out=want)
        got = moe_sum(x, torch.empty(tokens, hidden, dtype=dtype))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:  # both round the fp32 sum once: at most one ulp apart where the sums' order differs
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)
    num_tokens, num_experts, top_k, hidden, inter, renorm, load = CASES["one_token"]
    w13, w2 = make_experts(num_experts, hidden, inter, torch.bfloat16)
    x = torch.randn(num_tokens, hidden, generator=gen(3)).bfloat16()
    weights, ids = route_topk(make_logits(num_tokens, num_experts, load), top_k, renorm)
    plain = fused_moe(x, w13, w2, weights.bfloat16(), ids)
    calls = []
    monkeypatch.setattr(fm, "moe_sum", lambda *a, **kw: calls.append(1) or moe_sum(*a, **kw))
    monkeypatch.setattr(fm, "MOE_SUM_TRITON_MAX_TOKENS", num_tokens)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights.bfloat16(), ids), plain, atol=0, rtol=2**-7)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_shared_experts_addend_on_each_path(dtype: torch.dtype, monkeypatch) -> None:
    """fused_moe's `addend` (a Qwen-MoE block's shared expert and its gate logit, the gate a strided column):
    + sigmoid(gate) * shared inside the k-sum's launch at 3 tokens (moe_sum), after torch's sum at 13, after
    moe_gemv's fused down-and-sum with it switched on; each equal to the reference's torch ops to rounding."""
    import longserve.kernels.fused_moe as fm
    from longserve.kernels.moe_sum import moe_sum

    _, num_experts, top_k, hidden, inter, renorm, load = CASES["e6_top2"]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    in_sum = []
    monkeypatch.setattr(
        fm, "moe_sum", lambda *a, **kw: in_sum.append(kw.get("addend") is not None) or moe_sum(*a, **kw)
    )
    for num_tokens, gemv in ((3, False), (13, False), (3, True)):
        monkeypatch.setattr(fm, "MOE_GEMV_MAX_TOKENS", num_tokens if gemv else 0)
        x = torch.randn(num_tokens, hidden, generator=gen(num_tokens)).to(dtype)
        weights, ids = route_topk(make_logits(num_tokens, num_experts, load), top_k, renorm)
        gate = (torch.randn(num_tokens, 5, generator=gen(40)) * 3).to(dtype)[:, 2:3]
        shared = torch.randn(num_tokens, hidden, generator=gen(41)).to(dtype)
        in_sum.clear()
        got = fused_moe(x, w13, w2, weights.to(dtype), ids, addend=(gate, shared))
        want = fused_moe_ref(x, w13, w2, weights.to(dtype), ids, addend=(gate, shared))
        plain = fused_moe_ref(x, w13, w2, weights.to(dtype), ids)
        assert not torch.allclose(want, plain)  # the addend counts
        bound = (want.float().abs() + 2 * shared.float().abs()) * (1e-6 if dtype == torch.float32 else 2**-7)
        assert ((got.float() - want.float()).abs() <= bound + TOL[dtype]).all(), (num_tokens, gemv)
        assert in_sum == ([True] if num_tokens <= fm.MOE_SUM_TRITON_MAX_TOKENS and not gemv else [])


def test_kernel_with_table_config_and_out() -> None:
    """An explicit config (32-row blocks, grouped order, a different down tile) and a caller's out buffer."""
    w13, w2 = make_experts(6, 48, 40, torch.float32)
    x = torch.randn(21, 48, generator=gen(3))  # [T, H]
    weights, ids = route_topk(make_logits(21, 6, "ragged", seed=4), 2, True)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    cfg["down"] = {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
    out = torch.full_like(x, float("nan"))
    assert fused_moe(x, w13, w2, weights, ids, out=out, config=cfg) is out
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 48)


def test_blocks_of_256_rows() -> None:
    """tune_moe.BLOCK_MS's largest, 256 rows on 8 warps (prefill sizes: fewer weight-tile loads per row), and a
    down tile of its own: the reference's output."""
    w13, w2 = make_experts(6, 48, 40, torch.float32)
    x = torch.randn(300, 48, generator=gen(5))  # [T, H]: 600 pairs, one expert past 256 rows
    weights, ids = route_topk(make_logits(300, 6, "ragged", seed=6), 2, True)
    cfg = {"BLOCK_M": 256, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 8, "num_stages": 1}
    cfg["down"] = {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 8, "num_stages": 1}
    got = fused_moe(x, w13, w2, weights, ids, config=cfg)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_an_unknown_expert_quantization_is_refused() -> None:
    """Quantized experts have their own tests (test_quant_kernels.py); a weight type no kernel has is refused."""
    w13, w2 = make_experts(4, 32, 24, torch.float32)
    x = torch.randn(3, 32, generator=gen(5))
    weights, ids = route_topk(make_logits(3, 4, "even"), 2, True)
    quant = MoEQuant("int3", 32, torch.ones(4, 48, 1), torch.ones(4, 32, 1))
    for fn in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError, match="quantized experts 'int3': supported int4, int8, fp8_e4m3"):
            fn(x, w13, w2, weights, ids, quant=quant)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_equals_softmax_topk(renormalize: bool) -> None:
    logits = make_logits(17, 8, "even", seed=6).to(torch.bfloat16)  # [T, E]
    weights, ids = route_topk(logits, 3, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    ref_w, ref_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(17), atol=1e-6, rtol=0)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (17, 3)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=0, rtol=0)
    assert torch.equal(probs.gather(1, ids.long()) >= probs.topk(3).values[:, -1:], torch.ones(17, 3).bool())
    sig_w, sig_ids = route_topk(logits, 2, False, scoring="sigmoid")
    assert torch.equal(sig_ids.long(), torch.topk(logits.float(), 2).indices)  # sigmoid is monotonic
    torch.testing.assert_close(sig_w, torch.sigmoid(logits.float()).gather(1, sig_ids.long()))
    with pytest.raises(ValueError, match="scoring"):
        route_topk(logits, 2, False, scoring="relu")


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m", "load"),
    [(1, 1, 4, 16, "even"), (1, 8, 128, 16, "even"), (13, 3, 8, 4, "even"), (40, 2, 8, 16, "ragged")],
)
def test_align_invariants(num_tokens: int, top_k: int, num_experts: int, block_m: int, load: str) -> None:
    _, ids = route_topk(make_logits(num_tokens, num_experts, load, seed=7), top_k, True)  # [T, k]
    flat = ids.flatten().long()  # [P]
    num_pairs = flat.numel()
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts, block_m)
    size = padded_size_bound(num_pairs, num_experts, block_m)
    # shapes are fixed by (T, k, E, BLOCK_M) alone, never by the routing (CUDA graphs)
    assert sorted_ids.shape == (size,) and expert_ids.shape == (size // block_m,) and num_post.shape == (1,)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    counts = torch.bincount(flat, minlength=num_experts)
    padded = int(sum(-(-c // block_m) * block_m for c in counts.tolist()))
    assert int(num_post) == padded and padded % block_m == 0 and padded <= size

    real = sorted_ids[:padded].long()
    valid = real[real < num_pairs]
    assert torch.equal(valid.sort().values, torch.arange(num_pairs))  # every (token, k) pair exactly once
    assert torch.all(sorted_ids[padded:] == num_pairs)  # padding: the out-of-range id T*k
    assert torch.all((real < num_pairs) | (real == num_pairs))
    blocks = real.view(-1, block_m)  # [padded / BLOCK_M, BLOCK_M]
    block_experts = expert_ids[: padded // block_m].long()
    assert torch.all(block_experts[1:] >= block_experts[:-1])  # experts in order, each run contiguous
    for b, row in enumerate(blocks):
        pairs = row[row < num_pairs]
        assert pairs.numel() > 0  # a block is never all padding: an idle expert gets no block
        assert torch.all(flat[pairs] == block_experts[b])  # one expert per block
        assert torch.all(pairs[1:] > pairs[:-1]) and torch.all(row[: pairs.numel()] == pairs)  # padding last
    assert torch.equal(torch.bincount(block_experts, minlength=num_experts), -(-counts // block_m))
    assert torch.all(expert_ids[padded // block_m :] == num_experts)  # never read: those programs exit


def per_token_loop(x, w13, w2, weights, ids) -> torch.Tensor:
    """The plainest definition: for each token, sum over its k experts of w * down(silu(gate x) * up x)."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]  # [I] each
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("case", ["one_token", "e8_top3_no_renorm", "ragged_empty_expert"])
def test_reference_equals_per_token_loop(case: str) -> None:
    num_tokens, num_experts, top_k, hidden, inter, renorm, load = CASES[case]
    w13, w2 = make_experts(num_experts, hidden, inter, torch.float64)
    x = torch.randn(num_tokens, hidden, generator=gen(8), dtype=torch.float64)
    weights, ids = route_topk(make_logits(num_tokens, num_experts, load), top_k, renorm)
    expected = per_token_loop(x, w13, w2, weights.double(), ids)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_no_norm", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_transformers(arch: str, dtype: torch.dtype) -> None:
    """The layout (gate_up_proj [E, 2I, H], gate first; down_proj [E, H, I]) loads as is, and the reference
    rounds like transformers 5's default (grouped_mm) experts in bf16; Qwen rounds its weights, Mixtral not."""
    transformers = pytest.importorskip("transformers")
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = transformers.MixtralConfig(hidden_size=64, intermediate_size=40, num_local_experts=6)
        renorm, top_k, round_weights = True, config.num_experts_per_tok, False
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        renorm = arch == "qwen3_moe"
        config = transformers.Qwen3MoeConfig(
            hidden_size=64,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=renorm,
        )
        top_k, round_weights = 3, True
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(9)
    block = Block(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    block = block.to(dtype)
    x = torch.randn(9, 64, generator=gen(10)).to(dtype)  # [T, H]
    with torch.no_grad():
        expected = block(x[None])[0]  # [T, H]
        weights, ids = route_topk(F.linear(x, block.gate.weight), top_k, renorm)
        weights = weights.to(dtype) if round_weights else weights
        got = fused_moe_ref(x, block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
    torch.testing.assert_close(got, expected, atol=TOL[dtype] / 10, rtol=TOL[dtype])


def test_get_moe_config_table_and_default(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3}
    table = {
        "1": entry,
        "64": {**entry, "BLOCK_M": 32},
        "4096": {**entry, "BLOCK_M": 128, "down": {"BLOCK_N": 64}},
    }
    name = config_file_name(128, 768, "NVIDIA H200", torch.bfloat16)
    assert name == "E=128,N=768,device_name=NVIDIA_H200,dtype=bfloat16.json"
    (tmp_path / name).write_text(json.dumps(table))
    args = (128, 768, 2048, 8, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU's defaults (the interpreter's tiles are all small)
    pick = {t: get_moe_config(*args, t, "NVIDIA_H200", tmp_path)["BLOCK_M"] for t in (1, 20, 40, 3000, 9000)}
    assert pick == {1: 16, 20: 16, 40: 32, 3000: 128, 9000: 128}  # nearest bucket
    assert get_moe_config(*args, 3000, "NVIDIA_H200", tmp_path)["down"] == {"BLOCK_N": 64}
    # a table tuned at decode sizes only: within 2x of its buckets it answers, a prefill chunk gets the default
    (tmp_path / name).write_text(json.dumps({str(t): entry for t in (1, 2, 4, 8, 16, 32, 64)}))
    load_table.cache_clear()
    assert get_moe_config(*args, 128, "NVIDIA_H200", tmp_path) == entry
    assert get_moe_config(*args, 8192, "NVIDIA_H200", tmp_path) == default_moe_config(*args, 8192)
    assert default_moe_config(*args, 8192)["BLOCK_M"] == 128
    # quantized experts look for a table of their own format, not the bf16 one
    assert config_file_name(128, 768, "NVIDIA H200", torch.bfloat16, "int4").endswith("dtype=int4.json")
    assert get_moe_config(*args, 8, "NVIDIA_H200", tmp_path, weights="int4") == default_moe_config(*args, 8)
    # no table for this GPU or shape: the default, small blocks for decode, large for a prefill chunk
    assert get_moe_config(*args, 1, "NVIDIA_B200", tmp_path) == default_moe_config(*args, 1)
    decode, prefill = default_moe_config(*args, 1), default_moe_config(*args, 8192)
    assert (
        decode["BLOCK_M"] == 16 and prefill["BLOCK_M"] >= 64 and prefill["num_warps"] >= decode["num_warps"]
    )
    assert default_moe_config(8, 14336, 4096, 2, torch.bfloat16, 64)["BLOCK_M"] == 16  # 16 rows per expert
    bad = tmp_path / config_file_name(8, 64, "X", torch.bfloat16)
    bad.write_text(json.dumps({"1": {"BLOCK_M": 16}}))
    with pytest.raises(ValueError, match="bad entry"):
        load_table(str(bad))


def test_a_gpu_without_tables_reads_its_architectures_reference_part(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """On an H100 the A3B bf16 experts (no H100 table shipped) take the H200's shipped decode tiles (an sm90
    part's, moe_config.ARCH_TABLE_DEVICES: the A3B FP8 cold 32K went 1.509 -> 1.266 s on an H100 with the H200's
    FP8 table against the defaults), while its FP8 experts read the H100's own table; a part of another
    architecture keeps the defaults."""
    from longserve.kernels import moe_config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(moe_config, "current_device_name", lambda index=None: "NVIDIA_H100_80GB_HBM3")
    monkeypatch.setattr(moe_config, "current_capability", lambda index=None: (9, 0))
    args = (128, 768, 2048, 8, torch.bfloat16, 64)

    def shipped(device, weights):
        name = config_file_name(128, 768, device, torch.bfloat16, weights)
        return json.loads((CONFIG_DIR / name).read_text())

    assert moe_config.table_devices() == ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200")
    moe_config._note_borrowed.cache_clear()
    with caplog.at_level(logging.INFO, logger="longserve.kernels.moe_config"):
        assert get_moe_config(*args) == shipped("NVIDIA_H200", None)["64"] != default_moe_config(*args)
    assert (
        "(NVIDIA_H100_80GB_HBM3): reading" in caplog.text
        and "device_name=NVIDIA_H200,dtype=bfloat16" in caplog.text
    )
    assert get_moe_config(*args, "NVIDIA_H100_80GB_HBM3") == default_moe_config(*args)  # named
    fp8 = (*args[:-1], 8192)
    own = shipped("NVIDIA_H100_80GB_HBM3", "fp8_e4m3")["8192"]
    assert get_moe_config(*fp8, weights="fp8_e4m3") == own != shipped("NVIDIA_H200", "fp8_e4m3")["8192"]
    monkeypatch.setattr(moe_config, "current_capability", lambda index=None: (12, 0))
    assert moe_config.table_devices() == ("NVIDIA_H100_80GB_HBM3",)
    assert get_moe_config(*args) == default_moe_config(*args)


def test_no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Routing, alignment and the kernels never read a tensor's value on the host (a sync on the GPU that
    CUDA graphs cannot capture): every such accessor raises while they run."""
    w13, w2 = make_experts(6, 32, 24, torch.float32)
    x = torch.randn(5, 32, generator=gen(11))  # [T, H]
    logits = make_logits(5, 6, "ragged", seed=12)  # [T, E]

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, host_read)
        weights, ids = route_topk(logits, 2, True)
        out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_shipped_tables_parse() -> None:
    """Every table in the package loads, names a known dtype, and gives the kernel every key it reads."""
    from longserve.kernels.moe_config import CONFIG_DIR, KEYS

    for path in sorted(CONFIG_DIR.glob("*.json")):
        assert path.name.startswith("E=") and ",N=" in path.name and ",device_name=" in path.name
        # the activations' dtype, or the quantized experts' format
        kinds = ("bfloat16", "float16", "float32", "int4", "int8", "fp8_e4m3")
        assert path.name.rsplit("dtype=", 1)[1].removesuffix(".json") in kinds
        table = load_table(str(path))
        assert table and all(set(KEYS) <= set(cfg) for cfg in table.values())
