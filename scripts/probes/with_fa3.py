"""GPU probe, an upper bound for planning: run a module with the engine's library attention calls
(`attention.sdpa.attention_with_lse`, cuDNN) answered by vLLM's FlashAttention-3 instead. `attention_vs_fa3.py`
found FA3's causal square 11-25% faster than cuDNN's at 8-32K rows and the calls over a prefix at the same rate:
this says what the cold prefills would take if our causal kernel matched FA3 (the causal parts and the cold
chunk's call as one FA3 call each, nothing else changed). Not a path to ship: vLLM's build is a measuring stick.

    PYTHONPATH=$PWD:/tmp/site python3 scripts/probes/with_fa3.py -- longserve.bench.latency --config llama-3.1-8b \
        --load-format dummy --dtype bfloat16 --warmup 1 --repeat 3 --prompt-lens 8192,32768

Every call keeps its shapes and layouts: q [1, Hq, L, D], k/v [1, Hkv, S, D] strided views (a causal call has as
many keys as rows, so FA3's bottom-right mask is cuDNN's top-left one); FA3 returns (o [L, Hq, D], lse [Hq, L]),
given back as cuDNN's (o [1, Hq, L, D], lse [1, Hq, L] fp32). Batched calls (the packed hit's splits) stay on cuDNN.

`--impl gluon` answers every one of them (the causal ones too, which the engine leaves to cuDNN) with our own kernel
(longserve/kernels/gluon_attention.py; PYTHONPATH=$PWD is enough).
"""

from __future__ import annotations

import runpy
import sys

import torch

from longserve.attention import sdpa

_cudnn_call = sdpa.library_attention_with_lse
calls = {"fa3": 0, "gluon": 0, "cudnn": 0}
_cu: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # made once a shape: no copy inside a step


def fa3_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    if not q.is_cuda or q.shape[0] != 1:
        calls["cudnn"] += 1
        return _cudnn_call(q, k, v, causal, scale)
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    rows, keys = q.shape[2], k.shape[2]
    q3, k3, v3 = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [L, H, D] views
    if (rows, keys) not in _cu:
        _cu[rows, keys] = tuple(
            torch.tensor([0, n], dtype=torch.int32, device=q.device) for n in (rows, keys)
        )
    cu_q, cu_k = _cu[rows, keys]
    o, lse = flash_attn_varlen_func(
        q3, k3, v3, rows, cu_q, keys, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
        return_softmax_lse=True, fa_version=3,
    )  # fmt: skip
    calls["fa3"] += 1
    return o.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0).float()


def gluon_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    if not q.is_cuda or q.shape[0] != 1:
        calls["cudnn"] += 1
        return _cudnn_call(q, k, v, causal, scale)
    from longserve.kernels.gluon_attention import attention

    o, lse = attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), causal, scale)
    calls["gluon"] += 1
    return o.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit(__doc__)
    target, *args = argv[argv.index("--") + 1 :]
    impl = argv[argv.index("--impl") + 1] if "--impl" in argv[: argv.index("--")] else "fa3"
    sdpa.attention_with_lse = {"fa3": fa3_attention_with_lse, "gluon": gluon_attention_with_lse}[impl]
    sys.argv = [target, *args]
    try:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    finally:
        print(f"[with_fa3] library calls: {calls}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
