"""The cuDNN / torch SDPA attention paths the Triton backend routes some prefill steps to.

`cold_sdpa`: prompts with no cached prefix, straight from the new q/k/v. `prefix_split_sdpa`: long chunks
over a cached prefix as (new x prefix, no mask) + (new x new, causal), two library calls merged by their
log-sum-exps. No Triton needed on the CPU (the merge's torch reference runs there).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from longserve.attention import gluon_calls
from longserve.attention import sdpa_shapes as shapes
from longserve.attention.metadata import AttentionMetadata
from longserve.progress import Progress

logger = logging.getLogger("longserve.attention")


# a prefix on consecutive pages is read in place (a view) rather than gathered: at 128K in chunks of 8K the
# gathers copy ~1M prefix tokens x 32 layers x 4 KB twice over (read + write), ~70 ms estimated at 3.6 TB/s;
# not yet measured (`with_constants.py longserve.attention.sdpa.PREFIX_PAGES_AS_VIEW=False` is the A/B)
PREFIX_PAGES_AS_VIEW = True


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D], a view."""
    return x.transpose(0, 1).unsqueeze(0)


# Buffers whose rows after a step's tokens a library call may read as its padding rows: finite values only (zeros
# or model outputs), like the piecewise graphs' static qkv buffer (runner/piecewise_graph.py). A padded call then
# reads its q/k/v in place instead of a zeroed copy: under the causal mask a real row never sees a later row, and
# a non-causal call's extra query rows are dropped. Finite matters: a masked key's P is 0, and 0 x inf is NaN.
# On an H200 the copies (a zero fill and three copies a layer) took ~1.1 ms of a 1,232-token prompt step's ~31 ms
# of kernels beside decodes; in place, the step's device time 30.95 -> 30.06 ms (RESULTS.md twentieth session;
# `with_constants.py longserve.attention.sdpa.PAD_IN_PLACE=False` is the A/B).
PAD_IN_PLACE = True
_PADDABLE: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def allow_padding_rows(buf: torch.Tensor) -> None:
    """Let library calls read `buf`'s rows after a view's as padding (see _PADDABLE): its values stay finite."""
    _PADDABLE[buf.untyped_storage().data_ptr()] = buf


def _padded_in_place(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """q, k, v (fused views of one buffer) extended to `rows` rows over the rows after them, when the buffer
    allows it (allow_padding_rows) and holds them; else None."""
    storage = qkv[0].untyped_storage()
    if (
        not PAD_IN_PLACE
        or storage.data_ptr() not in _PADDABLE
        or any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in qkv)
    ):
        return None
    last = qkv[2]
    if (
        last.storage_offset() + (rows - 1) * width + last.shape[1] * last.shape[2]
        > storage.nbytes() // last.element_size()
    ):
        return None
    q, k, v = (t.as_strided((rows, *t.shape[1:]), t.stride()) for t in qkv)
    return q, k, v


def fused_rows(
    q: torch.Tensor,  # [L, Hq, D]
    k: torch.Tensor,  # [L, Hkv, D]
    v: torch.Tensor,
    rows: int,
    front: tuple[torch.Tensor, torch.Tensor] | None = None,  # [F, Hkv, D] keys and values before the new ones
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the library calls take them: `rows` rows (F zero query rows with the `front` keys, then
    the new tokens, then zeros) of one [rows, (Hq + 2 Hkv) D] buffer, the layout of the models' fused qkv
    projection that q/k/v are views of. torch keys cuDNN plans on strides too: one layout, padded or not,
    is what lets the plans built at start-up (`warm_up_plans`) serve every call. Views that already have it
    and need no padding are returned as they are (no copy), and so are views whose buffer lends its next rows
    as the padding (allow_padding_rows)."""
    num_front = 0 if front is None else front[0].shape[0]
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    width = (hq + 2 * hkv) * d
    fused = all(t.stride() == (width, d, 1) for t in (q, k, v))
    if fused and num_front == 0:
        if q.shape[0] == rows:
            return q, k, v
        in_place = _padded_in_place((q, k, v), rows, width)
        if in_place is not None:
            return in_place
    buf = q.new_zeros(rows, width)
    qb, kb, vb = (t.view(rows, -1, d) for t in buf.split([hq * d, hkv * d, hkv * d], dim=1))
    if front is not None:
        kb[:num_front], vb[:num_front] = front
    new = slice(num_front, num_front + q.shape[0])
    qb[new], kb[new], vb[new] = q, k, v
    return qb, kb, vb


def cold_sdpa(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of prompts with no cached prefix straight from the new q/k/v, one library call per
    request, each padded to its built rows (`sdpa_shapes.pad_cold_rows`; exact: causal rows never see the
    padding)."""
    out = torch.empty_like(q)  # [T, Hq, D]
    start = 0
    for query_len in query_lens:
        if query_len == 0:
            continue
        end = start + query_len
        q_r, k_r, v_r = fused_rows(q[start:end], k[start:end], v[start:end], shapes.pad_cold_rows(query_len))
        o_r, _ = attention_with_lse(_heads(q_r), _heads(k_r), _heads(v_r), True, scale)
        out[start:end] = o_r[0, :, :query_len].transpose(0, 1)  # [L, Hq, D]
        start = end
    return out


def attention_with_lse(
    q: torch.Tensor,  # [1, Hq, L, D]
    k: torch.Tensor,  # [1, Hkv, S, D]
    v: torch.Tensor,  # [1, Hkv, S, D]
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the natural-log log-sum-exp of each query row: (o [1,Hq,L,D], lse [1,Hq,L]).
    Long prefix calls on an H200 run our Gluon kernel (`takes_gluon`), the rest the library's."""
    out = gluon_calls.attention_with_lse(q, k, v, causal, scale)  # None: not a call for it
    if out is not None:
        return out
    return library_attention_with_lse(q, k, v, causal, scale)


_CUDNN_GQA: bool | None = None  # whether cuDNN took K/V with fewer heads than Q (None: not tried yet)


def library_attention_with_lse(
    q: torch.Tensor,  # [1, Hq, L, D]
    k: torch.Tensor,  # [1, Hkv, S, D]
    v: torch.Tensor,  # [1, Hkv, S, D]
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` by the library: cuDNN on CUDA, torch's flash kernel on the CPU.
    GQA: cuDNN reads the kv heads as they are when it accepts them (no 4x copy); else they are expanded."""
    global _CUDNN_GQA
    group = q.shape[1] // k.shape[1]
    if q.is_cuda and group > 1 and _CUDNN_GQA is not False:
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            _CUDNN_GQA = True
            return out[0], out[1].reshape(q.shape[:3]).float()
        except RuntimeError as e:  # this torch/cuDNN wants equal head counts: expand from now on
            logger.info("cuDNN attention does not take GQA K/V directly (%s); expanding kv heads", e)
            _CUDNN_GQA = False
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [1, Hq, S, D]
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def prefix_split_sdpa(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] new tokens
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    dequantize: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    requests: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    query_rows: Mapping[int, tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """Per request (of `requests`, default all; their rows of `out` written, the others left as they are):
    (new x cached prefix, no mask) and (new x new, causal) as two SDPA calls, merged by
    their log-sum-exps in one pass (`merge_two`). Exact up to rounding; runs at the library kernel's rate
    on long chunks. The shapes are those of `sdpa_shapes.split_shape`: the prefix read up to a multiple of
    PREFIX_GRANULE keys, its tail in front of the new tokens in the causal part (behind zero query rows that
    are dropped), the new tokens padded. `dequantize`: an fp8 cache's gathered prefix -> q's dtype (cuDNN
    reads no e4m3 pages); k/v are then the new tokens as the pages hold them (KVCache.as_stored).
    `query_rows`: a request's prefix-part calls' rows when not one call of its own padded rows
    (PlanRegistry.split_rows: padded further, or in pieces, each merged into its rows of `out`)."""
    if q.is_cuda:
        from longserve.kernels.merge_attention import merge_two as merge  # imports triton
    else:
        from longserve.kernels.attention_reference import merge_two_ref as merge

    out = torch.empty_like(q) if out is None else out  # [T, Hq, D]
    page_size = meta.page_size
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    for r in range(meta.num_reqs) if requests is None else requests:
        prefix_len, query_len = meta.prefix_lens_cpu[r], meta.query_lens_cpu[r]
        start, end = starts[r], starts[r + 1]
        shape = shapes.split_shape(prefix_len, query_len, (query_rows or {}).get(r))
        k_pre = v_pre = None
        if prefix_len:
            num_pages = -(-prefix_len // page_size)
            first = meta.contiguous_pages(r, num_pages) if PREFIX_PAGES_AS_VIEW else None
            if first is not None:  # consecutive pages: a view, where a gather would copy the whole prefix
                k_pre = k_cache[first : first + num_pages].flatten(0, 1)[:prefix_len]  # [S, Hkv, D]
                v_pre = v_cache[first : first + num_pages].flatten(0, 1)[:prefix_len]
            else:
                pages = meta.page_table[r, :num_pages].long()  # [P]
                k_pre = k_cache[pages].flatten(0, 1)[:prefix_len]  # [S, Hkv, D]
                v_pre = v_cache[pages].flatten(0, 1)[:prefix_len]
            if dequantize is not None:
                k_pre, v_pre = dequantize(k_pre, v_pre)
        # causal part: [tail keys, new tokens, padding]; the tail's query rows are zeros, dropped
        tail = slice(shape.prefix_keys, prefix_len)
        front = (k_pre[tail], v_pre[tail]) if shape.tail else None
        q_c, k_c, v_c = fused_rows(q[start:end], k[start:end], v[start:end], shape.causal_rows, front)
        o_new, lse_new = attention_with_lse(_heads(q_c), _heads(k_c), _heads(v_c), True, scale)
        rows = slice(shape.tail, shape.tail + query_len)
        if not shape.prefix_keys:
            out[start:end] = o_new[0, :, rows].transpose(0, 1)  # [L, Hq, D]
        else:
            # the new tokens and their padding, in the fused layout: rows of q_c where they fit (no copy)
            if shape.tail + shape.query_rows <= shape.causal_rows:
                q_p = _heads(q_c[shape.tail : shape.tail + shape.query_rows])
            else:
                q_p = _heads(fused_rows(q[start:end], k[start:end], v[start:end], shape.query_rows)[0])
            keys = slice(0, shape.prefix_keys)
            k_p, v_p = _heads(k_pre[keys]), _heads(v_pre[keys])
            # each piece's rows over the whole prefix (no mask: rows are independent), merged into its own rows
            first = 0
            for piece in shape.pieces:
                o_pre, lse_pre = attention_with_lse(q_p[:, :, first : first + piece], k_p, v_p, False, scale)
                n = min(piece, query_len - first)
                new_rows = slice(shape.tail + first, shape.tail + first + n)
                merge(
                    o_pre[0, :, :n], lse_pre[0, :, :n], o_new[0, :, new_rows], lse_new[0, :, new_rows],
                    out[start + first : start + first + n],
                )  # fmt: skip
                first += piece
    return out


def packed_prefix_sdpa(
    q: torch.Tensor,  # [L, Hq, D] new tokens
    k_pre: torch.Tensor,  # [P, Hkv, D] the prefix's keys (a view of consecutive pages or a gather), P = S * keys
    v_pre: torch.Tensor,
    splits: int,
    scale: float,
    q_rows: torch.Tensor | None = None,  # [Hkv, PACKED_ROWS, D]: the rows' buffer, reused by the layers
) -> tuple[torch.Tensor, torch.Tensor]:
    """A short chunk over a long prefix in one library call at cuDNN's long-prompt rate (sdpa_shapes.PACKED_ROWS):
    the q heads of each kv head as rows (row t * G + g is q head kv_head * G + g of token t, padded with zero
    rows to PACKED_ROWS), against the prefix's keys split `splits` ways as the batch (strided views: no copy of
    the prefix). Returns (o [S, Hkv, PACKED_ROWS, D], lse [S, Hkv, PACKED_ROWS]) for
    `merge_attention.merge_packed`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pre.shape[1]
    group = num_q_heads // num_kv_heads
    if q_rows is None:
        q_rows = q.new_zeros(num_kv_heads, shapes.PACKED_ROWS, head_dim)
    by_token = q.reshape(num_tokens, num_kv_heads, group * head_dim).transpose(0, 1)  # [Hkv, L, G * D]
    if shapes.PACKED_ROWS % group == 0:  # one copy into the rows
        q_rows.view(num_kv_heads, shapes.PACKED_ROWS // group, group * head_dim)[:, :num_tokens] = by_token
    else:
        q_rows[:, : num_tokens * group] = by_token.reshape(num_kv_heads, num_tokens * group, head_dim)
    keys = k_pre.shape[0] // splits
    k_s = k_pre.view(splits, keys, num_kv_heads, head_dim).permute(0, 2, 1, 3)  # [S, Hkv, keys, D]
    v_s = v_pre.view(splits, keys, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    # [S, Hkv, R, D]: one copy of the rows for every split (a stride-0 batch, as warm_up_packed built it)
    q_s = q_rows.unsqueeze(0).expand(splits, -1, -1, -1)
    return attention_with_lse(q_s, k_s, v_s, False, scale)


def plan_calls(
    model: shapes.ModelShape, device: torch.device, todo: list[tuple[int, int, bool]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """(q, k, v, causal) of one library call per shape (query rows, key rows, causal), laid out as the calls
    of `prefix_split_sdpa` lay them out: new tokens in the fused qkv layout (`fused_rows`), a prefix as the
    pages hold it."""
    if not todo:
        return
    max_q = max(q for q, _, _ in todo)
    max_kv = max(kv for _, kv, _ in todo)
    hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
    new = (torch.zeros(1, h, d, dtype=model.dtype, device=device) for h in (hq, hkv, hkv))
    q, k, v = fused_rows(*new, max_q)  # a causal shape has as many keys as query rows
    pre = torch.zeros(max_kv, hkv, d, dtype=model.dtype, device=device)
    for q_rows, kv_rows, causal in todo:
        if causal:
            yield _heads(q[:q_rows]), _heads(k[:kv_rows]), _heads(v[:kv_rows]), True
        else:
            yield _heads(q[:q_rows]), _heads(pre[:kv_rows]), _heads(pre[:kv_rows]), False


def warm_up_plans(
    model: shapes.ModelShape,
    device: torch.device,
    chunk_size: int,
    max_seq_len: int,
    step_tokens: int | None = None,
) -> None:
    """Build (run once) every shape of `sdpa_shapes.warm_up_shapes` on this thread and mark it ready."""
    if device.type != "cuda" or model.dtype not in (torch.float16, torch.bfloat16):
        return
    todo = [
        s
        for s in shapes.warm_up_shapes(chunk_size, max_seq_len, step_tokens)
        if not shapes.PLANS.ready(model, *s, device)
    ]
    if not todo:
        return
    start = time.perf_counter()
    progress = Progress(logger, "building cuDNN attention plans", len(todo))
    for i, (shape, (q, k, v, causal)) in enumerate(zip(todo, plan_calls(model, device, todo))):
        attention_with_lse(q, k, v, causal, model.head_dim**-0.5)
        shapes.PLANS.mark(model, *shape)
        progress.step(i + 1)
    torch.cuda.synchronize(device)
    logger.info(
        "built %d cuDNN attention plans (new tokens up to %d, prefixes up to %d) in %.1fs",
        len(todo), max(q for q, _, _ in todo), max(kv for _, kv, _ in todo), time.perf_counter() - start,
    )  # fmt: skip


def warm_up_packed(model: shapes.ModelShape, device: torch.device, max_seq_len: int) -> None:
    """Build the packed prefix calls (`packed_prefix_sdpa`) of every split count a context reaches, and compile
    the merge of each of their counts, on this thread."""
    if device.type != "cuda" or model.dtype not in (torch.float16, torch.bfloat16):
        return
    from longserve.kernels.merge_attention import merge_packed

    todo = [
        s
        for s in shapes.warm_up_packed_splits(max_seq_len)
        if not shapes.PLANS.packed_ready(model, s, device)
    ]
    if not todo:
        return
    start = time.perf_counter()
    hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
    q = torch.zeros(1, hq, d, dtype=model.dtype, device=device)
    pre = torch.zeros(todo[-1] * shapes.PREFIX_GRANULE, hkv, d, dtype=model.dtype, device=device)
    # the causal part as the backend passes it: views of the extend kernel's one-split partials (their strides'
    # classes are what the merge compiles for)
    part, part_lse = torch.zeros(1, hq, 1, d, device=device), torch.zeros(1, hq, 1, device=device)
    o_c, lse_c = part[:, :, 0].transpose(0, 1), part_lse[:, :, 0].transpose(0, 1)
    for splits in todo:
        keys = slice(0, splits * shapes.PREFIX_GRANULE)
        o, lse = packed_prefix_sdpa(q, pre[keys], pre[keys], splits, d**-0.5)
        merge_packed(o, lse, o_c, lse_c, torch.empty_like(q), 0, causal_log2=True)
        shapes.PLANS.mark_packed(model, splits)
    torch.cuda.synchronize(device)
    logger.info(
        "built %d packed cuDNN attention plans (prefixes of %d-%d keys) in %.1fs", len(todo),
        todo[0] * shapes.PREFIX_GRANULE, todo[-1] * shapes.PREFIX_GRANULE, time.perf_counter() - start,
    )  # fmt: skip
