"""The attention calls our Gluon kernels answer on an H200: the long prefix calls (no mask) in cuDNN's place
(kernels/gluon_attention.py; `sdpa.attention_with_lse` asks here first), and, switched on, the Triton extend
kernel's calls (kernels/gluon_extend.py; the Triton backend binds `extend_attention` here). No Triton imported
until a call on an sm90 device asks for a kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("longserve.attention")

# Our Hopper kernel (kernels/gluon_attention.py) answers the long prefix calls (no mask), where it was measured
# ahead of cuDNN: 8K new rows over 32K / 128K keys at 1.00-1.035x cuDNN's rate on an H200 (twenty-third session).
# Its causal squares run 0.91x (8K) to 0.99x (32K) of cuDNN's: those stay the library's. The A/B:
# `with_constants.py longserve.attention.gluon_calls.GLUON_PREFIX_CALLS=False`.
GLUON_PREFIX_CALLS = True
GLUON_MIN_ROWS, GLUON_MIN_KEYS = 8192, 32768  # shorter calls ran 0.61-0.95x cuDNN (--prefix-sweep)
# device index (a CUDA tensor's device has one) -> whether the kernel runs there (sm90, a Triton with its Gluon API);
# whether a call has run there (its first call builds it)
_GLUON: dict[int, bool] = {}
_GLUON_BUILT: dict[int, bool] = {}
_EXTEND_BUILT: dict[int, bool] = {}  # the extend kernel's first call on a device: True built, False failed


def _gluon_runs_on(device: torch.device) -> bool:
    index = device.index
    if index not in _GLUON:
        ok = torch.cuda.get_device_capability(index) == (9, 0)
        if ok:
            try:
                from longserve.kernels import gluon_attention  # noqa: F401 - the kernel imports with this Triton
                from longserve.kernels.gluon_compat import supported

                ok = supported()
            except ImportError as e:  # a Triton without Gluon
                logger.info("Gluon attention unavailable (%s): prefix calls stay cuDNN's", e)
                ok = False
        _GLUON[index] = ok
    return _GLUON[index]


def takes_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether `sdpa.attention_with_lse` hands this call ([1, H, L, D] views) to the Gluon kernel."""
    return (
        GLUON_PREFIX_CALLS
        and not causal
        and q.is_cuda
        and q.shape[0] == 1
        and q.shape[2] >= GLUON_MIN_ROWS
        and k.shape[2] >= GLUON_MIN_KEYS
        and _gluon_runs_on(q.device)
        and _fits(q, k, v)
    )


def _fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    from longserve.kernels import gluon_attention

    return gluon_attention.fits(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))


def attention_with_lse(
    q: torch.Tensor,  # [1, Hq, L, D]
    k: torch.Tensor,  # [1, Hkv, S, D]
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kernel's (o [1, Hq, L, D], lse [1, Hq, L]) when the call is one for it (`takes_gluon`), else None."""
    if not takes_gluon(q, k, v, causal):
        return None
    from longserve.kernels import gluon_attention

    q3, k3, v3 = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [L, H, D] views
    run = lambda: gluon_attention.attention(q3, k3, v3, causal, scale)  # noqa: E731
    out = _built_once(_GLUON_BUILT, q.device.index, run, "attention kernel", "prefix calls stay cuDNN's")
    if out is None:
        _GLUON[q.device.index] = False
        return None
    o, lse = out
    return o.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def _built_once(
    built: dict[int, bool], index: int, run: Callable[[], Any], kernel: str, fallback: str
) -> Any:
    """run(): a Gluon kernel's call. Its first call on a device builds the kernel: a failure there (a Triton that
    cannot build it) is warned once, marked False in `built` and answered None, so that the caller's path takes
    the calls; once built, True."""
    if built.get(index):
        return run()
    try:
        out = run()
    except Exception as e:  # noqa: BLE001 - a build error of any kind
        logger.warning("the Gluon %s did not build (%s): %s", kernel, e, fallback)
        built[index] = False
        return None
    built[index] = True
    return out


# The Gluon extend kernel (kernels/gluon_extend.py) in the Triton extend kernel's place (the prefix hit's 64 new
# tokens over 32K, in the lone chunk's CUDA graph): off until measured on the GPU. Read when a Triton backend is
# built: `with_constants.py longserve.attention.gluon_calls.GLUON_EXTEND_CALLS=True -- ...` is the A/B.
GLUON_EXTEND_CALLS = False


def extend_attention(q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size: int,
                     max_query_len: int, scale: float, sliding_window: int | None = None, out=None, config=None,
                     num_splits: int = 1, k_scale: float = 1.0, v_scale: float = 1.0, partials: bool = False):  # fmt: skip
    """`kernels.extend_attention.extend_attention`, by the Gluon kernel where it applies (bf16 q and cache, D = 128,
    pages of 16n slots, no sliding window, merged outputs; at the Triton kernel's split count), else by Triton."""
    from longserve.kernels import extend_attention as triton_extend

    def by_triton():
        return triton_extend.extend_attention(
            q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, max_query_len, scale,
            sliding_window, out, config, num_splits, k_scale, v_scale, partials,
        )  # fmt: skip

    index = q.device.index
    built_failed = _EXTEND_BUILT.get(index) is False
    if partials or sliding_window is not None or built_failed or not _extend_runs(q, k_cache, page_size):
        return by_triton()
    from longserve.kernels import gluon_extend

    def by_gluon():
        return gluon_extend.extend_attention(
            q, k_cache, v_cache, query_start_loc, prefix_lens, seq_lens, page_table, page_size, max_query_len, scale,
            num_splits, out,
        )  # fmt: skip

    o = _built_once(_EXTEND_BUILT, index, by_gluon, "extend kernel", "extend calls stay Triton's")
    return by_triton() if o is None else o


def _extend_runs(q: torch.Tensor, k_cache: torch.Tensor, page_size: int) -> bool:
    """Whether the Gluon extend kernel takes a call of these tensors: sm90 with Gluon, shapes it serves
    (`gluon_extend.fits`)."""
    if not q.is_cuda or not _gluon_runs_on(q.device):
        return False
    from longserve.kernels import gluon_extend

    return gluon_extend.fits(q, k_cache, page_size)
