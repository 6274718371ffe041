"""GPU probe: every execution plan cuDNN offers for the attention calls of a cold prefill, timed. torch's
`_scaled_dot_product_cudnn_attention` runs the first plan of cuDNN's heuristics; `attention_vs_fa3.py` measured
its causal square at 496-546 TFLOP/s for 8K rows against FlashAttention-3's 604-666 on the same chip, and the
non-causal prefix part at FA3's rate (~600-630). This asks whether another of cuDNN's plans (heuristic modes A, B
and the fallback list, through cudnn-frontend's graph API) runs the causal square faster, and what one call with
the causal mask aligned bottom-right over [prefix, new] costs against the split (two calls and a merge).

Llama-3.1-8B shape (32 q heads, 8 kv heads, head dim 128, bf16), q/k/v laid out as the engine lays them (views of
the fused qkv output, a prefix as the cache's pages; [tokens, heads, D] viewed as [1, heads, tokens, D] by strides). Each plan's output is checked against torch's call.
Needs `nvidia-cudnn-frontend` (scripts/gpu/fetch_test_wheels.sh, in .whl/):
    PYTHONPATH=$PWD:/tmp/site python3 scripts/probes/cudnn_sdpa_plans.py     (PROBE_MAX_PLANS=24 by default)
One JSON line a plan; writes $OUT/cudnn_sdpa_plans.json.
"""

from __future__ import annotations

import json
import os

import torch

from longserve.attention import sdpa
from longserve.platform import cuda_time_ms

HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
MAX_PLANS = int(os.environ.get("PROBE_MAX_PLANS", "24"))


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], a view


def plans(
    cudnn, handle, q4, k4, v4, mask: str, stats: bool, modes
) -> tuple[object, dict, list[int], torch.Tensor]:
    """A cuDNN SDPA graph over these views: (graph, variant pack, indices of the plans that built, output)."""
    g = cudnn.pygraph(
        io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT, handle=handle,
    )  # fmt: skip
    tq, tk, tv = g.tensor_like(q4), g.tensor_like(k4), g.tensor_like(v4)
    kw = dict(name="sdpa", q=tq, k=tk, v=tv, attn_scale=SCALE)
    if mask == "causal":
        kw["use_causal_mask"] = True
    elif mask == "bottom_right":
        kw["use_causal_mask_bottom_right"] = True
    try:
        to, ts = g.sdpa(is_inference=not stats, **kw)
    except TypeError:  # frontends that name it generate_stats
        to, ts = g.sdpa(generate_stats=stats, **kw)
    o4 = torch.empty(q4.shape[0], q4.shape[2], q4.shape[1], q4.shape[3], dtype=q4.dtype, device=q4.device)
    o4 = o4.permute(0, 2, 1, 3)  # [1, HQ, L, D] over a [1, L, HQ, D] buffer: the engine's output layout
    to.set_output(True).set_dim(list(o4.shape)).set_stride(list(o4.stride()))
    pack = {tq: q4, tk: k4, tv: v4, to: o4}
    if stats:
        lse = torch.empty(1, HQ, q4.shape[2], 1, dtype=torch.float32, device=q4.device)
        ts.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_dim(list(lse.shape)).set_stride(
            list(lse.stride())
        )
        pack[ts] = lse
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans(modes)
    g.check_support()
    built = []
    for i in range(min(g.get_execution_plan_count(), MAX_PLANS)):
        try:
            g.build_plan_at_index(i)
            built.append(i)
        except Exception:  # noqa: BLE001 - a plan that does not build is skipped
            continue
    return g, pack, built, o4


def run_case(cudnn, handle, name: str, new: int, keys: int, mask: str, stats: bool) -> list[dict]:
    dev = "cuda"
    torch.manual_seed(0)
    # the engine's layouts: new q/k/v are views of the fused qkv projection's output; a prefix's K/V the cache's
    # pages, flattened ([keys, HKV, D], contiguous), the new tokens' stored there before the call
    qkv = torch.randn(new, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
    q, k, v = (t.view(new, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=1))
    if keys != new:
        k = torch.randn(keys, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(keys, HKV, D, device=dev, dtype=torch.bfloat16)
    if mask == "bottom_right":
        flop = 4 * new * (keys - new + (new + 1) / 2) * D * HQ
        pre = keys - new
        # the engine's split: prefix (no mask) + new (causal) + merge, for the time and the reference
        from longserve.kernels.merge_attention import merge_two

        out = torch.empty(new, HQ, D, device=dev, dtype=torch.bfloat16)

        def split():
            o_a, l_a = sdpa.attention_with_lse(heads(q), heads(k[:pre]), heads(v[:pre]), False, SCALE)
            o_b, l_b = sdpa.attention_with_lse(heads(q), heads(k[pre:]), heads(v[pre:]), True, SCALE)
            return merge_two(o_a[0], l_a[0], o_b[0], l_b[0], out)

        ref = split().float()
        t_torch = cuda_time_ms(split, 3, 5, 3)
    else:
        flop = 4 * new * ((new + 1) / 2 if mask == "causal" else keys) * D * HQ
        fn = lambda: sdpa.attention_with_lse(heads(q), heads(k), heads(v), mask == "causal", SCALE)  # noqa: E731
        ref = fn()[0][0].transpose(0, 1).float()  # [L, HQ, D]
        t_torch = cuda_time_ms(fn, 3, 5, 3)
    rows = [
        {
            "case": name,
            "plan": "torch (engine path)",
            "ms": round(t_torch, 3),
            "tflops": round(flop / t_torch / 1e9, 1),
        }
    ]
    print(json.dumps(rows[-1]), flush=True)
    modes = [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]
    try:
        g, pack, built, o4 = plans(cudnn, handle, heads(q), heads(k), heads(v), mask, stats, modes)
    except Exception as e:  # noqa: BLE001 - a probe reports whatever breaks
        rows.append({"case": name, "error": repr(e)[:300]})
        print(json.dumps(rows[-1]), flush=True)
        return rows
    workspace = torch.empty(max([g.get_workspace_size_plan_at_index(i) for i in built] + [1]), dtype=torch.uint8,
                            device=dev)  # fmt: skip
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    for i in built:
        run = lambda i=i: g.execute_plan_at_index(pack, workspace, i, handle=handle)  # noqa: E731
        try:
            run()
            torch.cuda.synchronize()
            err = ((o4[0].transpose(0, 1).float() - ref).norm() / ref.norm()).item()
            ms = cuda_time_ms(run, 3, 5, 3)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": name, "plan_index": i, "error": repr(e)[:200]})
            continue
        rows.append({
            "case": name, "plan_index": i, "plan": g.get_plan_name_at_index(i), "ms": round(ms, 3),
            "tflops": round(flop / ms / 1e9, 1), "rel_err_vs_torch": round(err, 5),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    import cudnn

    handle = cudnn.create_handle()
    print(
        json.dumps({"cudnn_backend": cudnn.backend_version(), "torch_cudnn": torch.backends.cudnn.version()})
    )
    rows = []
    for args in (
        ("causal 8K", 8192, 8192, "causal", True),
        ("causal 8K, no stats", 8192, 8192, "causal", False),
        ("causal 16K", 16384, 16384, "causal", True),
        ("prefix 8K over 24K", 8192, 24576, "none", True),
        ("one call: 8K over 24K + 8K, bottom-right", 8192, 32768, "bottom_right", False),
    ):
        rows += run_case(cudnn, handle, *args)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "cudnn_sdpa_plans.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
