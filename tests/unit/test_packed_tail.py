"""kernels/packed_tail.py under the Triton interpreter: the packed prefix hit's causal part (the prefix's last
partial page and the new tokens, over scattered pages) merged with the prefix splits' rows equals its torch
reference, and what the extend kernel's partials merged by merge_packed give (the path it replaces), for GQA groups
of 4, 7 and 1 and a bucket with padding rows past the chunk."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from longserve.kernels.attention_reference import merge_packed_ref, packed_tail_ref  # noqa: E402
from longserve.kernels.extend_attention import extend_attention  # noqa: E402
from longserve.kernels.packed_tail import packed_tail  # noqa: E402


@pytest.mark.parametrize(
    "heads,kv_heads,bucket,new,tail,page_size,dtype",
    [
        (8, 2, 20, 17, 3, 4, torch.float32),  # the 8B's group of 4, padding rows 17..19
        # a prefix on whole pages: no tail (fp16: the interpreter's bf16 dots are wrong; the GPU test runs bf16)
        (8, 2, 16, 16, 0, 16, torch.float16),
        (7, 1, 12, 9, 15, 16, torch.float32),  # a group of 7 (rows a program: 9 tokens of 7 heads)
        (2, 2, 40, 40, 5, 8, torch.float16),  # no GQA; more keys than a loop step
    ],
)
def test_equals_reference_and_the_extend_plus_merge_path(
    heads, kv_heads, bucket, new, tail, page_size, dtype
):
    torch.manual_seed(heads * 100 + bucket)
    head_dim, splits = 32, 3
    group = heads // kv_heads
    rows = bucket * group + 5  # the cuDNN call's rows: more than the bucket's
    num_pages = 40
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim).to(dtype)
    causal_pages = -(-(page_size - 1 + bucket) // page_size) + 1
    pages = (torch.randperm(num_pages - 2)[:causal_pages] + 2).to(torch.int32)  # scattered, never 0 or 1
    q = torch.randn(bucket, heads, head_dim).to(dtype)
    part = torch.randn(splits, kv_heads, rows, head_dim).to(dtype)
    part_lse = torch.randn(splits, kv_heads, rows) * 3
    tail_t = torch.tensor([tail], dtype=torch.int32)
    seq_t = torch.tensor([tail + new], dtype=torch.int32)
    scale = head_dim**-0.5

    got = packed_tail(q, k_cache, v_cache, pages, tail_t, seq_t, part, part_lse, scale)
    want = packed_tail_ref(q, k_cache, v_cache, pages, tail_t, seq_t, part, part_lse, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

    # what PackedPrefixBackend ran before: the extend kernel's partials (log2), merged by merge_packed
    qsl = torch.tensor([0, bucket], dtype=torch.int32)
    o_c, lse_c = extend_attention(
        q, k_cache, v_cache, qsl, tail_t, seq_t, pages.view(1, -1), page_size, bucket, scale, num_splits=1,
        partials=True,
    )  # fmt: skip
    before = merge_packed_ref(
        part, part_lse, o_c[:, :, 0].transpose(0, 1), lse_c[:, :, 0].transpose(0, 1), torch.empty_like(q), 0,
        causal_log2=True,
    )  # fmt: skip
    torch.testing.assert_close(got[:new].float(), before[:new].float(), atol=tol, rtol=tol)


def test_rows_a_program_change_the_grid_not_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROWS (rows a program: 32 by default, gpu_check.sh hit-tail also tries 16 and 64) changes the grid, not the
    result."""
    from longserve.kernels import packed_tail as pt

    torch.manual_seed(3)
    k_cache, v_cache = torch.randn(20, 4, 2, 32), torch.randn(20, 4, 2, 32)
    pages = (torch.randperm(18)[:8] + 2).to(torch.int32)
    q, part, part_lse = torch.randn(20, 8, 32), torch.randn(2, 2, 80, 32), torch.randn(2, 2, 80)
    tail, seq = torch.tensor([3], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    monkeypatch.setattr(pt, "ROWS", 32)
    narrow = pt.packed_tail(q, k_cache, v_cache, pages, tail, seq, part, part_lse, 0.2)
    monkeypatch.setattr(pt, "ROWS", 64)
    wide = pt.packed_tail(q, k_cache, v_cache, pages, tail, seq, part, part_lse, 0.2)
    # the narrowest tl.dot takes: 4 tokens of 4 heads, or 2 of a group of 8
    monkeypatch.setattr(pt, "ROWS", 16)
    narrowest = pt.packed_tail(q, k_cache, v_cache, pages, tail, seq, part, part_lse, 0.2)
    torch.testing.assert_close(narrow, wide, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(narrowest, wide, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide, packed_tail_ref(q, k_cache, v_cache, pages, tail, seq, part, part_lse, 0.2),
                               atol=2e-5, rtol=2e-5)  # fmt: skip
