"""Torch references of the causal depthwise conv of the Gated DeltaNet layers (`kernels/causal_conv1d.py`), same
signatures, importable without Triton: the CPU path and the oracle of the Triton kernels.

Qwen3-Next / Qwen3.5 run a depthwise causal conv of width W (4) over the concatenated q, k, v projections
(D = 2*Hk*K + Hv*V channels) before the delta rule, then SiLU. A serving step holds several requests flattened
along the tokens (`query_start_loc`, no padding); each request's last W-1 conv inputs live in a slot of a
preallocated pool `conv_states [S, W-1, D]` (channels contiguous, as the tokens are, so a token's row is one
contiguous load). A request with `has_state` continues from its slot (a later chunk of its prompt, or a decode
step); without it the W-1 inputs before its first token are zeros and the slot's old contents are ignored. A
slot of -1 is a padding row: it reads and writes no state (zeros in front), its outputs are don't-care.

The math is HF's `causal_conv1d_fn` / `causal_conv1d_update` (transformers' modeling_qwen3_5_moe): output t is
sum_j weight[:, j] * in[t - (W-1) + j] (+ bias), then the activation. Here it is accumulated in float32 and
rounded once to x's dtype, where HF rounds the conv to the weight's dtype before the activation too (equal in
float32, within one rounding in bfloat16). HF's conv state keeps W inputs of which the first is never read
again; ours keeps the W-1 that are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_decode_ref", "causal_conv1d_prefill_ref", "conv_activation"]


def conv_activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The conv's activation on float32 y: None (identity), "silu" / "swish"."""
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (None, 'silu' or 'swish')")


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] (the step's new tokens, flattened), weight [D, W], conv_states [S, W-1, D] -> y [T, D] in x's
    dtype. Each request's tokens are convolved preceded by its slot's W-1 inputs (zeros without has_state), and
    the slot then holds the last W-1 inputs of (old state ++ new tokens): a request of fewer than W-1 new tokens
    keeps part of its old state."""
    num_tokens, dim = x.shape
    width = weight.shape[1]
    assert weight.shape == (dim, width) and conv_states.shape[1:] == (width - 1, dim), "shapes disagree"
    starts = query_start_loc.tolist()
    slot_list, state_list = slots.tolist(), has_state.tolist()
    w = weight.float().t()  # [W, D]
    y = torch.zeros(num_tokens, dim, dtype=x.dtype, device=x.device)
    for r, slot in enumerate(slot_list):
        s, e = starts[r], starts[r + 1]
        if slot >= 0 and state_list[r]:
            prev = conv_states[slot].float()  # [W-1, D]
        else:
            prev = torch.zeros(width - 1, dim, dtype=torch.float32, device=x.device)
        full = torch.cat([prev, x[s:e].float()])  # [W-1+L, D]
        # out[t] = sum_j w[j] * full[t + j]: the W taps of token t end at itself
        out = sum(w[j] * full[j : j + e - s] for j in range(width))  # [L, D]
        if bias is not None:
            out = out + bias.float()
        y[s:e] = conv_activation(out, activation).to(x.dtype)
        if slot >= 0:
            conv_states[slot] = full[full.shape[0] - (width - 1) :].to(conv_states.dtype)
    return y


def causal_conv1d_decode_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, D] (one new token a request) -> y [B, D]: the prefill of one token each, every request continuing
    from its slot, whose inputs shift by one in place."""
    batch = x.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=x.device)
    has_state = torch.ones(batch, dtype=torch.bool, device=x.device)
    return causal_conv1d_prefill_ref(
        x, weight, conv_states, query_start_loc, slots, has_state, activation, bias
    )
