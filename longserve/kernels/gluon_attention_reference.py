"""Torch references of the Gluon attention kernel (gluon_attention.py): `reference`, fp32 attention with its
log-sum-exp, and `emulate`, the kernel's loop tile by tile and block by block (its bounds, masks, base-2 online
softmax with the one-block-late P V, bf16 P, the log-sum-exp), which checks the algorithm on the CPU. Importable
without Triton."""

from __future__ import annotations

import torch

BLOCK_M = 128  # the kernel's tile rows
LOG2E = 1.4426950408889634


def reference(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, per head: q [L, Hq, D], k/v [S, Hkv, D] -> (o [L, Hq, D], lse [Hq, L], natural log); causal aligned
    bottom-right (query i sees keys up to i + S - L)."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
    s = torch.einsum("hld,hsd->hls", qf, kf) * scale
    if causal:
        rows, keys = q.shape[0], k.shape[0]
        mask = (
            torch.arange(keys, device=q.device)[None, :]
            > torch.arange(rows, device=q.device)[:, None] + keys - rows
        )
        s = s.masked_fill(mask, -float("inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hls,hsd->hld", torch.softmax(s, -1), vf).transpose(0, 1), lse


def emulate(q, k, v, causal: bool, scale: float, block_n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's loop in torch (`reference`'s signature; fp32 but for P, rounded to bf16 as the kernel feeds it
    to P V)."""
    num_rows, num_heads, head_dim = q.shape
    num_keys, group, shift = k.shape[0], num_heads // k.shape[1], k.shape[0] - q.shape[0]
    qk_scale = scale * LOG2E
    o = torch.zeros(num_rows, num_heads, head_dim)
    lse = torch.zeros(num_heads, num_rows)
    for head in range(num_heads):
        for q_start in range(0, num_rows, BLOCK_M):
            rows = torch.arange(q_start, q_start + BLOCK_M)
            qt = torch.zeros(BLOCK_M, head_dim)  # TMA fills rows past the end with zeros
            qt[: min(BLOCK_M, num_rows - q_start)] = q[q_start : q_start + BLOCK_M, head].float()
            kv_end = min(num_keys, q_start + BLOCK_M + shift) if causal else num_keys
            mask_from = min(num_keys, q_start + shift + 1) if causal else num_keys
            m_i, l_i = torch.full((BLOCK_M,), -float("inf")), torch.zeros(BLOCK_M)
            acc, p_prev, v_prev = torch.zeros(BLOCK_M, head_dim), None, None
            for j in range(-(-kv_end // block_n)):
                kt, vt = torch.zeros(block_n, head_dim), torch.zeros(block_n, head_dim)
                n = max(0, min(block_n, num_keys - j * block_n))
                kt[:n] = k[j * block_n : j * block_n + n, head // group].float()
                vt[:n] = v[j * block_n : j * block_n + n, head // group].float()
                s = (
                    qt @ kt.T
                )  # raw scores: the max scaled once a row, each score scaled and shifted by one FFMA
                if (j + 1) * block_n > mask_from:
                    cols = j * block_n + torch.arange(block_n)
                    last = rows + shift if causal else torch.full_like(rows, num_keys - 1)
                    keep = (cols[None, :] < num_keys) & (cols[None, :] <= last[:, None])
                    s = s.masked_fill(~keep, -float("inf"))
                m_new = torch.maximum(m_i, s.max(1).values * qk_scale)
                p = torch.exp2(torch.addcmul(-m_new[:, None], s, torch.tensor(qk_scale)))
                alpha = torch.exp2(m_i - m_new)
                l_i = l_i * alpha + p.sum(1)
                if p_prev is not None:
                    acc = acc + p_prev.bfloat16().float() @ v_prev  # P_{j-1} V_{j-1}, then the rescale
                acc = acc * alpha[:, None]
                m_i, p_prev, v_prev = m_new, p, vt
            acc = acc + p_prev.bfloat16().float() @ v_prev
            real = slice(0, min(BLOCK_M, num_rows - q_start))
            o[q_start : q_start + BLOCK_M, head] = (acc / l_i[:, None])[real]
            lse[head, q_start : q_start + BLOCK_M] = ((m_i + torch.log2(l_i)) * 0.6931471805599453)[real]
    return o, lse
