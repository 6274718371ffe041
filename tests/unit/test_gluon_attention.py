"""Our Gluon attention kernel on the CPU: its loop (kernels/gluon_attention_reference.emulate: bounds, masks, the
one-block-late P V, the log-sum-exp) against fp32 attention, the layouts it takes, the calls the engine hands it,
and its sm90 build with this machine's Triton (no GPU needed). Its runs on an H200:
tests/gpu/test_gluon_attention_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from longserve.attention import gluon_calls, sdpa
from longserve.kernels.gluon_attention_reference import emulate, reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "rows,keys,causal,block_n",
    [
        (300, 300, True, 128),  # causal square, a partial last tile
        (200, 700, True, 64),  # bottom-right: a chunk over a prefix, in one call
        (130, 500, False, 128),  # a prefix call, keys not a multiple of the key tile
        (129, 129, True, 64),
        (64, 1000, False, 64),
    ],
)
def test_the_kernels_loop_is_attention(rows: int, keys: int, causal: bool, block_n: int) -> None:
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 128
    q, k, v = (torch.randn(n, h, d).bfloat16() for n, h in ((rows, hq), (keys, hkv), (keys, hkv)))
    o, lse = emulate(q, k, v, causal, d**-0.5, block_n)
    o_ref, lse_ref = reference(q, k, v, causal, d**-0.5)
    assert (o - o_ref).abs().max().item() < 4e-3  # P in bf16, as the kernel feeds it to P V
    assert (lse - lse_ref).abs().max().item() < 1e-5
    if causal:  # the last query row sees every key; the first sees keys - rows + 1 of them
        only_first = reference(q[:1], k[: keys - rows + 1], v[: keys - rows + 1], False, d**-0.5)[0]
        assert (o[0] - only_first[0]).abs().max().item() < 4e-3


def _fused(rows: int, hq: int = 32, hkv: int = 8, d: int = 128, dtype: torch.dtype = torch.bfloat16):
    """q, k, v as the models' fused qkv projection lays them: views of one [rows, (hq + 2 hkv) d] buffer."""
    buf = torch.zeros(rows, (hq + 2 * hkv) * d, dtype=dtype)
    q, k, v = buf.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(rows, hq, d), k.view(rows, hkv, d), v.view(rows, hkv, d)


def test_the_layouts_it_reads() -> None:
    ga = pytest.importorskip("longserve.kernels.gluon_attention")
    q, k, v = _fused(64)
    assert ga.fits(q, k, v)  # the fused views, as they are
    pages = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)  # a prefix on consecutive cache pages
    assert ga.fits(q, pages.flatten(0, 1), pages.flatten(0, 1))
    assert not ga.fits(*_fused(64, dtype=torch.float16))  # the kernel writes bf16
    assert not ga.fits(*_fused(64, d=64))  # built for D = 128
    assert not ga.fits(*_fused(64, hq=6, hkv=4))  # q heads in whole groups of kv heads
    assert not ga.fits(
        q.transpose(0, 1).contiguous().transpose(0, 1), k, v
    )  # heads not side by side in a row
    odd = torch.zeros(64, 32 * 128 + 4, dtype=torch.bfloat16)[:, : 32 * 128].view(64, 32, 128)
    assert not ga.fits(odd, k, v)  # a row stride TMA cannot take (not 16-byte aligned)


def test_cpu_calls_stay_the_librarys() -> None:
    """On the CPU no call is the kernel's, and attention_with_lse is the library's flash kernel."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in _fused(4096))
    pre = torch.randn(1, 8, 8192, 128, dtype=torch.bfloat16)
    assert not gluon_calls.takes_gluon(q, pre, pre, False)
    assert gluon_calls.attention_with_lse(q, pre, pre, False, 0.1) is None
    o, lse = sdpa.attention_with_lse(q[:, :, :64], pre[:, :, :256], pre[:, :, :256], False, 0.1)
    o_ref, lse_ref = sdpa.library_attention_with_lse(
        q[:, :, :64], pre[:, :, :256], pre[:, :, :256], False, 0.1
    )
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_it_builds_for_sm90() -> None:
    """The engine's variant through this Triton's compiler down to a cubin: each consumer's wgmma issued
    asynchronously, within the launch's registers and an H200's shared memory, nothing spilled to local memory."""
    from longserve.testing.kernel_compile import sm90_compiler_missing

    pytest.importorskip("longserve.kernels.gluon_attention")
    from longserve.kernels.gluon_compat import supported

    if not supported() or sm90_compiler_missing():
        pytest.skip(f"this Triton does not build the kernel: {sm90_compiler_missing() or 'older than 3.6'}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("GLUON_")}
    env["PYTHONPATH"] = REPO
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts/probes/gluon_attention_check.py"), "--compile-only"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    builds = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [b["causal"] for b in builds] == [True, False], out.stderr[-3000:]
    for b in builds:
        assert b["wgmma_in_ptx"] > 0 and b["regs"] <= 168 and b["local"] == 0
        assert b["shared_meta"] <= 227 * 1024  # an H200 SM's shared memory
        assert b["loop_sass"] > 0 and b["loop_ops"]["HGMMA"] > 0  # the key-block loop found in the SASS


def _probe(*args: str) -> list[dict]:
    """The JSON lines of scripts/probes/gluon_extend_check.py run with `args`, the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts/probes/gluon_extend_check.py"), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows, out.stderr[-3000:]
    return rows


def test_the_extend_kernels_work_split_is_attention() -> None:
    """The Gluon extend kernel's programs in torch (tiles of packed rows, key splits with empty ones, per-token masks,
    the finite running max, the merge) against `extend_attention_ref`: one cold chunk, suffixes over scattered pages,
    a partial last tile, pages of 32, CUDA graphs' padded buckets (tokens past seq_len), a decode row, with every
    slot no request owns non-finite: the blocks read as the TMA boxes bring them, the request's last V block zeroed
    past its end as the first consumer does (without it 5 of the 8 come out non-finite). Each program holds the
    request's end in its split's last block at most (asserted: the loader lands that block on a barrier the first
    consumer waits on once)."""
    rows = _probe("--emulate")
    assert len(rows) == 8
    assert all(r["finite"] and r["max_err"] < 5e-3 for r in rows), (
        rows
    )  # P in bf16, as the kernel feeds it to P V


def test_the_extend_kernel_builds_for_sm90() -> None:
    """kernels/gluon_extend.py through this Triton's compiler: within the launch's registers and an H200's shared
    memory, nothing spilled to local memory, its key-block loop's wgmma asynchronous (16 HGMMA a block, few waits)."""
    from longserve.testing.kernel_compile import sm90_compiler_missing

    pytest.importorskip("longserve.kernels.gluon_attention")
    from longserve.kernels.gluon_compat import supported

    if not supported() or sm90_compiler_missing():
        pytest.skip(f"this Triton does not build the kernel: {sm90_compiler_missing() or 'older than 3.6'}")
    (build,) = _probe("--compile-only")
    assert build["regs"] <= 168 and build["local"] == 0 and build["shared_meta"] <= 227 * 1024
    assert build["loop_ops"]["HGMMA"] == 16 and build["wgmma_in_ptx"] > 0
    # S and P V each waited for where written (a serialized build waits after every one of the 16 HGMMA)
    assert build["loop_wgmma_waits"] <= 4, build
