"""Torch references of the Gated DeltaNet kernels (`kernels/gated_delta.py`), same signatures, importable without
Triton: the CPU path and the oracle of the Triton kernels.

The gated delta rule (Qwen3-Next / Qwen3.5 linear-attention layers) keeps per value head a state S [K, V] and,
for each token t with l2-normalized q_t, k_t (q also times `scale`), decay g_t <= 0 (log space) and rate beta_t:

    S <- exp(g_t) * S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

(HF's `torch_recurrent_gated_delta_rule`). GQA: value head h reads q/k head h // (Hv // Hk).

The prefill reference computes the same thing by chunks of 64 tokens, as HF's `torch_chunk_gated_delta_rule` and
the Triton kernel do (the WY / UT form): inside a chunk, with gc the cumulative sum of g from the chunk's start,
L_ij = beta_i k_i.k_j exp(gc_i - gc_j) for i > j, T = (I + L)^-1, w = T (beta k exp(gc)), u = T (beta v); then
chunk after chunk, from the state S before it:

    v' = u - w S;   o = (q exp(gc)) S + [q_i.k_j exp(gc_i - gc_j)]_{i>=j} v';   S <- exp(gc_last) S + (k exp(gc_last - gc))^T v'

All of it in float32; o is cast to v's dtype, the state to the pool's. A serving step flattens its requests along
the tokens (`query_start_loc`); each request's state is `states[slot]` of a pool [S, Hv, K, V]: with `has_state`
it is read, without it the request starts from zeros; it is written at the end. A slot of -1 is a padding row
(zero state, nothing written, don't-care outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "CHUNK",
    "gated_delta_decode_gating_ref",
    "gated_delta_decode_ref",
    "gated_delta_prefill_ref",
    "gdn_gating_ref",
    "l2norm_ref",
]

CHUNK = 64  # tokens a chunk: the kernels' and HF's


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) along the last dim, in float32 (HF's / FLA's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, H], A_log, dt_bias [H] -> (g [T, H] float32, beta [T, H] in b's dtype), as the HF layer computes them:
    g = -exp(A_log) * softplus(a + dt_bias) in float32 (softplus with torch's threshold 20), beta = sigmoid(b) in
    b's dtype (HF's `b.sigmoid()`: rounded once from float32)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def _heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """[L, Hk, K] -> [Hv, L, K] float32, each q/k head repeated for the Hv // Hk value heads that read it."""
    return x.float().repeat_interleave(num_v_heads // x.shape[1], dim=1).transpose(0, 1)


def _qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float, use_qk_l2norm: bool):
    q, k = _heads(q, num_v_heads), _heads(k, num_v_heads)  # [Hv, L, K]
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    return q * scale, k


def _chunked(q, k, v, g, beta, state, save_chunk=-1):
    """One request: q, k [Hv, L, K] (normalized, q scaled), v [Hv, L, V], g, beta [Hv, L], state [Hv, K, V], all
    float32 -> (o [Hv, L, V], final state [Hv, K, V], the state before chunk `save_chunk` (None: -1))."""
    num_heads, length, _ = q.shape
    pad = -length % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # padded rows: k = v = 0, so they change nothing
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // CHUNK
    q, k, v = (x.reshape(num_heads, n, CHUNK, x.shape[-1]) for x in (q, k, v))  # [Hv, N, C, *]
    gc = g.reshape(num_heads, n, CHUNK).cumsum(-1)  # [Hv, N, C] cumulative decay from the chunk's start
    beta = beta.reshape(num_heads, n, CHUNK, 1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    diff = gc[..., :, None] - gc[..., None, :]  # [Hv, N, C, C]
    decay = torch.where(causal, diff, float("-inf")).exp()  # exp(gc_i - gc_j) for i >= j, else 0
    lower = (beta * k @ k.transpose(-1, -2) * decay).tril(-1)  # [Hv, N, C, C] L, strictly lower
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    t = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False)  # (I + L)^-1
    w = t @ (beta * k * gc.exp()[..., None])  # [Hv, N, C, K]
    u = t @ (beta * v)  # [Hv, N, C, V]
    attn = q @ k.transpose(-1, -2) * decay  # [Hv, N, C, C] causal, decayed
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]  # each key decayed to the chunk's end
    o = torch.empty_like(v)
    saved = None
    for c in range(n):
        if c == save_chunk:
            saved = state
        v_new = u[:, c] - w[:, c] @ state  # [Hv, C, V] what the state does not already predict
        o[:, c] = q_decayed[:, c] @ state + attn[:, c] @ v_new
        state = state * gc[:, c, -1, None, None].exp() + k_to_end[:, c].transpose(-1, -2) @ v_new
    return o.reshape(num_heads, n * CHUNK, o.shape[-1])[:, :length], state, saved


def gated_delta_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunks: object = None,
    saves: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q, k [T, Hk, K], v [T, Hv, V], g, beta [T, Hv], states [S, Hv, K, V] -> o [T, Hv, V] in v's dtype; each
    request's final state is written to states[slot] in the pool's dtype (chunks of 64, per request). `chunks`:
    the Triton kernel's precomputed chunk numbering, unused here (the same signature). `saves` (save_chunk [B],
    save_row [B]): request r's state after its first save_chunk[r] chunks also goes to states[save_row[r]]
    (-1: none), a prefix-cache checkpoint inside the step."""
    num_tokens, num_v_heads, _ = v.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(num_tokens, num_v_heads, v.shape[-1], dtype=v.dtype, device=v.device)
    starts = query_start_loc.tolist()
    save_chunks, save_rows = ([-1] * len(starts), None) if saves is None else (x.tolist() for x in saves)
    for r, (slot, cont) in enumerate(zip(slots.tolist(), has_state.tolist())):
        s, e = starts[r], starts[r + 1]
        qr, kr = _qk(q[s:e], k[s:e], num_v_heads, scale, use_qk_l2norm)
        state = torch.zeros(states.shape[1:], dtype=torch.float32, device=states.device)  # [Hv, K, V]
        if slot >= 0 and cont:
            state = states[slot].float()
        vr, gr, br = v[s:e].float().transpose(0, 1), g[s:e].float().t(), beta[s:e].float().t()
        out, state, saved = _chunked(qr, kr, vr, gr, br, state, save_chunks[r])
        o[s:e] = out.transpose(0, 1).to(v.dtype)
        if saved is not None:
            states[save_rows[r]] = saved.to(states.dtype)
        if slot >= 0:
            states[slot] = state.to(states.dtype)
    return o


def gated_delta_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """q, k [B, Hk, K], v [B, Hv, V], g, beta [B, Hv] -> o [B, Hv, V] in v's dtype: one token a request, the
    recurrent rule on states[slots[b]], updated in place (rows of slot -1: zero state, not written)."""
    batch, num_v_heads, _ = v.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh = _qk(q, k, num_v_heads, scale, use_qk_l2norm)  # [Hv, B, K]: the batch in the token dim
    valid = slots >= 0
    state = torch.zeros(batch, num_v_heads, *states.shape[2:], dtype=torch.float32, device=v.device)
    state[valid] = states[slots[valid].long()].float()  # [B, Hv, K, V]
    qb, kb = qh.transpose(0, 1), kh.transpose(0, 1)  # [B, Hv, K]
    state = state * g.float().exp()[..., None, None]
    kv = (state * kb[..., None]).sum(-2)  # [B, Hv, V] what the state predicts for k
    delta = (v.float() - kv) * beta.float()[..., None]
    state = state + kb[..., None] * delta[..., None, :]
    o = (state * qb[..., None]).sum(-2)  # [B, Hv, V]
    states[slots[valid].long()] = state[valid].to(states.dtype)
    return o.to(v.dtype)


def gated_delta_decode_gating_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`gdn_gating_ref` of the layer's a, b [B, Hv], then `gated_delta_decode_ref`."""
    g, beta = gdn_gating_ref(a, b, A_log, dt_bias)
    return gated_delta_decode_ref(q, k, v, g, beta, states, slots, scale, use_qk_l2norm)
