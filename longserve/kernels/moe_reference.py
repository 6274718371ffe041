"""Mixture-of-experts in pure torch (no triton): top-k routing, the block alignment of the routed pairs that
the grouped GEMMs read (`moe_align_block_size`, `moe_align_ref`: the reference of the Triton alignment in
kernels/moe_align.py), and the reference expert computation whose signature and rounding the Triton
`fused_moe` shares; also the quantization descriptor of that signature (int4/int8 group-wise and fp8 block
experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longserve.kernels.quant_reference import (
    dequantize_fp8_block,
    dequantize_wna16,
    per_token_group_quant_fp8_ref,
)

__all__ = [
    "MoEQuant",
    "check_moe_args",
    "fused_moe_ref",
    "moe_align_block_size",
    "moe_align_ref",
    "padded_size_bound",
    "route_topk",
]


@dataclass(frozen=True)
class MoEQuant:
    """The experts' weight quantization (`w13`, `w2` then hold the quantized values):

    "int4" / "int8": w13 uint8 [E, 2I, H * bits / 8], w2 [E, H, I * bits / 8], packed along K as
    kernels/quant_reference.py lays dense weights out; scales [E, N, G] (G = K / group_size; group_size 0:
    one group of all K), zero points uint8 [E, N, G] or None (2^(bits-1)), act-order g_idx [E, K] or None.
    Activations stay in the hidden dtype (W4A16 / W8A16).

    "fp8_e4m3": w13 e4m3 [E, 2I, H], w2 [E, H, I]; float32 scales [E, ceil(N / block_n), ceil(K / group)]
    (DeepSeek/Qwen3's 128x128 blocks; block_n 1 and group_size 0: per output channel). Activations are
    quantized to e4m3 at run time per token-group of group_size (0: per token), as the dense FP8 layers do.
    With blocks, block_n must divide I (the gate/up boundary of w13) and this rank's I."""

    weight_dtype: str
    group_size: int
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    w13_zero: torch.Tensor | None = None
    w2_zero: torch.Tensor | None = None
    w13_g_idx: torch.Tensor | None = None
    w2_g_idx: torch.Tensor | None = None
    block_n: int = 1

    @property
    def bits(self) -> int:
        return {"int4": 4, "int8": 8, "fp8_e4m3": 8}[self.weight_dtype]

    @property
    def is_int(self) -> bool:
        return self.weight_dtype in ("int4", "int8")

    def group(self, k: int) -> int:
        """K elements per scale group (activation group for fp8) of a projection over K."""
        return self.group_size if self.group_size > 0 else k


def route_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token on the logits' device, no host sync: (weights fp32 [T, k], ids int32 [T, k]).

    Scores in float32 (softmax, or sigmoid), top-k, then with `renormalize` the k weights divided by their
    sum: Mixtral always does, Qwen3-MoE when `norm_topk_prob` (its default), Qwen2-MoE only when set.
    HF's Qwen2/Qwen3-MoE routers then round the weights to the logits' dtype (`.to(router_logits.dtype)`)
    while Mixtral keeps them float32: the caller passes `weights.to(dtype)` for the former, since the
    experts multiply in the promoted dtype of (hidden, weights), as HF does (see `fused_moe_ref`)."""
    assert router_logits.dim() == 2 and 1 <= top_k <= router_logits.shape[1], (
        f"logits {tuple(router_logits.shape)}, top_k {top_k}"
    )
    if scoring == "softmax":
        scores = torch.softmax(router_logits.float(), dim=-1)  # [T, E] fp32
    elif scoring == "sigmoid":
        scores = torch.sigmoid(router_logits.float())  # [T, E] fp32
    else:
        raise ValueError(f"unknown MoE scoring {scoring!r} (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)  # [T, k] fp32, [T, k] int64
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [T, k]
    return weights, ids.to(torch.int32)


def padded_size_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most sorted rows alignment can produce: each non-empty expert (at most min(E, pairs) of them) pads
    its rows up to a multiple of BLOCK_M, adding at most BLOCK_M - 1; rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k (token, k) pairs by expert in blocks of `block_m` rows, on the device, no host sync.

    Returns sorted_token_ids [S] int32 (flat pair index token*k + j, pairs of one expert in token order,
    each expert's run padded to a multiple of block_m with the out-of-range id T*k; S =
    `padded_size_bound`), expert_ids [S / block_m] int32 (one expert per block; blocks past the real
    padded length get E and are never read) and num_tokens_post_padded [1] int32 (the real padded length).
    About 15 small launches (the Triton `moe_align` of kernels/moe_align.py does it in one)."""
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    num_pairs, dev = flat.numel(), flat.device
    size = padded_size_bound(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)  # [E]
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # integer adds: exact and deterministic
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    sorted_experts, order = torch.sort(flat, stable=True)  # [P] each: token order kept within an expert
    rank = torch.arange(num_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_experts]  # [P]
    dest = (padded_end - padded)[sorted_experts] + rank  # [P] row of each pair in the padded layout
    sorted_token_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=dev)  # [S]
    sorted_token_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, device=dev)  # [S / block_m]
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)  # [S / block_m]
    return sorted_token_ids, expert_ids, padded_end[-1:].to(torch.int32)


def moe_align_ref(
    topk_ids: torch.Tensor,  # [T, k] int expert ids (global ones with expert_map)
    num_experts: int,  # experts this rank holds (rows of w13/w2)
    block_m: int,
    expert_map: torch.Tensor | None = None,  # [E_global] int32: global id -> local row, or -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the grouped GEMMs read: (sorted_token_ids [S], expert_ids [S / block_m], num_tokens_post_padded
    [1]), all int32, as `moe_align_block_size` lays them out. With `expert_map` (expert parallelism) the
    pairs routed to another rank's expert (-1) are aligned as one extra expert E after the real ones (S is
    then the bound for E + 1 experts, blocks past the end get E + 1), and the real padded length stops
    before their blocks, so the GEMMs never compute them (no host sync: the length is a device value)."""
    if expert_map is None:
        return moe_align_block_size(topk_ids, num_experts, block_m)
    local = expert_map[topk_ids.long()]  # [T, k] rows of w13/w2, -1 for other ranks' experts
    remote = local < 0
    # the remote pairs become expert E: sorted last, their padded run is cut off the real length
    ids = torch.where(remote, num_experts, local)  # [T, k]
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, num_experts + 1, block_m)
    remote_padded = (remote.sum(dtype=torch.int32) + block_m - 1) // block_m * block_m  # [] device
    return sorted_ids, expert_ids, num_post - remote_padded  # [1] int32


def check_moe_args(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    quant: MoEQuant | None,
) -> None:
    """Shape checks shared by the reference and the kernel (shapes only: no host sync)."""
    assert hidden.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (
        "hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]"
    )
    num_experts, two_inter, hidden_size = w13.shape
    if quant is not None and quant.weight_dtype not in ("int4", "int8", "fp8_e4m3"):
        raise ValueError(f"quantized experts {quant.weight_dtype!r}: supported int4, int8, fp8_e4m3")
    if quant is not None and quant.is_int:  # K packed: bits / 8 bytes per element
        assert w13.dtype == w2.dtype == torch.uint8, f"packed experts are uint8, got {w13.dtype}, {w2.dtype}"
        hidden_size = hidden_size * 8 // quant.bits
        inter = w2.shape[2] * 8 // quant.bits
        assert w2.shape[:2] == (num_experts, hidden.shape[1]) and two_inter == 2 * inter, (
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} ({quant.weight_dtype})"
        )
        assert quant.w13_scale.shape[:2] == w13.shape[:2] and quant.w2_scale.shape[:2] == w2.shape[:2]
    else:
        assert w2.shape == (num_experts, hidden_size, two_inter // 2), (
            f"w2 {tuple(w2.shape)}, w13 {tuple(w13.shape)}"
        )
        if quant is None:
            assert w13.dtype == w2.dtype == hidden.dtype, f"dtypes {hidden.dtype}, {w13.dtype}, {w2.dtype}"
        else:
            assert w13.dtype == w2.dtype == torch.float8_e4m3fn, f"fp8 experts, got {w13.dtype}"
    assert hidden.shape[1] == hidden_size and two_inter % 2 == 0, (
        f"w13 {tuple(w13.shape)} vs {tuple(hidden.shape)}"
    )
    assert topk_ids.shape == topk_weights.shape and topk_ids.dim() == 2, "topk_ids and topk_weights [T, k]"
    assert topk_ids.shape[0] == hidden.shape[0], f"{topk_ids.shape[0]} routed tokens for {hidden.shape[0]}"
    assert topk_weights.is_floating_point() and not topk_ids.is_floating_point()


def _expert_weights(quant: MoEQuant | None, w13, w2, expert: int, dtype: torch.dtype):
    """Expert `expert`'s (w13 [2I, H], w2 [H, I]): the weights themselves, or dequantized (int: rounded to
    the hidden dtype as the dense W4A16 layers do; fp8: float32, for the float32 product with the quantized
    activations)."""
    if quant is None:
        return w13[expert], w2[expert]
    if quant.is_int:

        def deq(w, s, z, g):
            k = w.shape[-1] * 8 // quant.bits
            return dequantize_wna16(
                w[expert], s[expert], None if z is None else z[expert], None if g is None else g[expert],
                quant.bits, quant.group(k),
            ).to(dtype)  # fmt: skip

        return deq(w13, quant.w13_scale, quant.w13_zero, quant.w13_g_idx), deq(
            w2, quant.w2_scale, quant.w2_zero, quant.w2_g_idx
        )

    def deq8(w, s):
        return dequantize_fp8_block(w[expert], s[expert], (quant.block_n, quant.group(w.shape[-1])))

    return deq8(w13, quant.w13_scale), deq8(w2, quant.w2_scale)


def _project(x: torch.Tensor, w: torch.Tensor, quant: MoEQuant | None) -> torch.Tensor:
    """x [n, K] @ w^T in x's dtype; fp8 experts: x quantized per token-group first, the product in fp32."""
    if quant is None or quant.is_int:
        return F.linear(x, w)
    k = x.shape[1]
    group = quant.group(k)
    xq, xs = per_token_group_quant_fp8_ref(x, group)
    xd = xq.float() * xs.repeat_interleave(group, dim=1)[:, :k]
    return (xd @ w.T).to(x.dtype)


def fused_moe_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows [0, I), then up rows [I, 2I)
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32, or the hidden dtype (Qwen-MoE)
    topk_ids: torch.Tensor,  # [T, k] int32 expert ids in [0, E)
    out: torch.Tensor | None = None,
    quant: MoEQuant | None = None,
    config: dict | None = None,
    expert_map: torch.Tensor | None = None,  # [E_global] int32: global expert id -> row of w13/w2, or -1
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,  # (gate [T, 1], shared [T, H])
) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) per token: [T, H] in the hidden dtype; with `addend` (a
    Qwen-MoE block's shared expert and its gate logit) plus sigmoid(gate) * shared, rounded as torch's ops.

    Weights as transformers 5 stores them (`experts.gate_up_proj` [E, 2I, H] with the gate half first,
    `experts.down_proj` [E, H, I]): loaded without a transpose. Rounds like transformers 5's default
    `grouped_mm` experts: both projections and silu(gate) * up round to the dtype, the routing weight
    multiplies in the promoted dtype of (hidden, topk_weights) (bf16 for Qwen-MoE, which rounds its weights;
    fp32 for Mixtral), and the k products are summed in fp32 and rounded once. Loops over the experts hit,
    with host syncs: a reference, not for CUDA graphs. `config` is the kernel's and ignored here. `quant`:
    quantized experts (MoEQuant), dequantized per expert hit.

    Expert parallelism: with `expert_map`, w13/w2 hold only this rank's experts and `topk_ids` are global
    ids; pairs routed to an expert mapped to -1 (another rank's) add nothing, so summing every rank's
    result gives the whole (what one all-reduce does)."""
    del config
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, quant)
    num_tokens, top_k = topk_ids.shape
    prod_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    weighted = torch.zeros(
        num_tokens, top_k, hidden.shape[1], dtype=prod_dtype, device=hidden.device
    )  # [T, k, H]
    ids = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]  # [T, k]
    for expert in torch.unique(ids).tolist():  # ascending; the only experts with work
        if expert < 0:  # another rank's expert
            continue
        tok, pos = torch.where(ids == expert)  # [n] each: the (token, k) pairs routed here
        e13, e2 = _expert_weights(quant, w13, w2, expert, hidden.dtype)
        gate, up = _project(hidden[tok], e13, quant).chunk(2, dim=-1)  # [n, I] each
        down = _project(F.silu(gate) * up, e2, quant)  # [n, H]
        weighted[tok, pos] = down * topk_weights[tok, pos, None].to(prod_dtype)  # [n, H]
    acc_dtype = torch.promote_types(prod_dtype, torch.float32)  # 16-bit products sum in fp32, as HF's .sum
    result = weighted.sum(dim=1, dtype=acc_dtype).to(hidden.dtype)  # [T, H]
    if addend is not None:
        result = result + torch.sigmoid(addend[0]) * addend[1]
    if out is None:
        return result
    return out.copy_(result)
