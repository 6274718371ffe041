"""Which global loads the small decode kernels issue before their wait on the kernel before (launch.pdl_prologue's
griddepcontrol.wait, ACQBULK in sm90 SASS), built for sm90 with programmatic dependent launch on, on any machine.

Why: at batch 1 a decode step is a chain of small kernels, each waiting on the one before. A load of something no
kernel of the step writes (a norm's weight, RoPE's position, cos/sin and slot, the decode attention's lengths) may be
issued before the wait (launch.pdl_prologue's docstring), and then costs nothing on the chain; after it, it is a
round trip in series (the norm's weight load came after its reduction's two CTA barriers: two trips, sm90 SASS,
Triton 3.6). The launches are the interpreter's on tiny CPU tensors (their argument types and constexprs recorded,
as tests/unit/test_kernel_compile.py does), compiled with USE_PDL on and Triton's integer specialization (pointers
and multiples of 16 as on the GPU).

    python3 scripts/dev/pdl_early_loads.py          # one JSON line a kernel: the loads before the wait, the registers
    python3 scripts/dev/pdl_early_loads.py --late   # the same with PDL_EARLY_LOADS off (EARLY False)
    python3 scripts/dev/pdl_early_loads.py --both   # both, each line with its "early"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

KERNELS = ("_rms_norm_kernel", "_rope_kernel", "_decode_split_kernel")


def record(path: str) -> None:
    """The three kernels launched by the interpreter at tiny shapes; their records to `path` (one JSON list)."""
    import torch

    from longserve.testing import kernel_compile

    kernel_compile.record_launches()
    from longserve.attention.base import KVCache
    from longserve.attention.metadata import build_step_tensors
    from longserve.kernels.decode_attention import decode_attention
    from longserve.kernels.norm import fused_add_rms_norm
    from longserve.kernels.rope import rotary_embedding

    x = torch.randn(2, 256, dtype=torch.bfloat16)
    fused_add_rms_norm(x, torch.randn_like(x), torch.ones(256, dtype=torch.bfloat16), 1e-6)
    d, heads, kv_heads, tokens = 128, 4, 2, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=torch.bfloat16)
    q, k, v = (t.view(tokens, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    cache = KVCache(1, 8, 16, kv_heads, d, torch.bfloat16, "cpu")
    positions, cos_sin = torch.tensor([3, 17]), torch.randn(64, d, dtype=torch.float32)
    rotary_embedding(positions, q, k, cos_sin, store=(v, torch.tensor([3, 33]), *cache.slots(0)))
    meta, _ = build_step_tensors([3, 17], [1, 1], [[0], [2, 3]], 16, "cpu")
    decode_attention(q, cache.k[0], cache.v[0], meta.seq_lens, meta.page_table, 16, d**-0.5, None, 4)
    records = [r for r in kernel_compile._RECORDS.values() if r["name"] in KERNELS]
    with open(path, "w") as f:
        json.dump(records, f)


def loads_before_wait(sass: str) -> list[str]:
    """The LDG instructions of the SASS listing before its first ACQBULK (griddepcontrol.wait)."""
    before = sass.split("ACQBULK", 1)[0] if "ACQBULK" in sass else ""
    return [line.split("*/", 1)[-1].strip().rstrip(" ;") for line in before.splitlines() if "LDG" in line]


def report(rec: dict, early: bool = True) -> dict:
    """rec's kernel compiled for sm90 with USE_PDL on and EARLY as given (launch.PDL_EARLY_LOADS): its loads before
    the wait, how many waits it has (one), its registers."""
    from longserve.testing.kernel_compile import compile_sm90, recorded_kernel, specialized
    from longserve.testing.sass import cubin_tool, resource_usage

    fn = recorded_kernel(rec)
    signature, constexprs, attrs = specialized(fn, rec)  # as the JIT on the GPU specializes the launch
    constexprs["USE_PDL"], constexprs["EARLY"] = True, early
    compiled = compile_sm90(fn, signature, constexprs, attrs, **rec["options"])
    sass = cubin_tool(compiled.asm["cubin"], "nvdisasm", "-c")
    return {
        "kernel": rec["name"],
        "waits": sass.count("ACQBULK"),
        "loads_before_wait": loads_before_wait(sass),
        **resource_usage(compiled.asm["cubin"]),
    }


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.json")
        subprocess.run([sys.executable, __file__, "--record", path], env={**env, "TRITON_INTERPRET": "1"},
                       check=True, cwd=root)  # fmt: skip
        with open(path) as f:
            records = json.load(f)
    os.environ["TRITON_INTERPRET"] = "0"
    for early in [True, False] if "--both" in sys.argv else ["--late" not in sys.argv]:
        for rec in sorted(records, key=lambda r: KERNELS.index(r["name"])):
            print(json.dumps({**report(rec, early), "early": early}), flush=True)
    return 0 if {r["name"] for r in records} == set(KERNELS) else 1


if __name__ == "__main__":
    if "--record" in sys.argv:
        record(sys.argv[sys.argv.index("--record") + 1])
    else:
        raise SystemExit(main())
