"""Whether the kernels that round where torch rounds keep those roundings in sm90 PTX, on any machine: the shared
expert's gated add (activation.sigmoid_gated_add) and moe_sum's ADDEND epilogue, launched by their wrappers on
tiny bf16 CPU tensors with each kernel replaced by a stand-in that records the launch (its arguments, constexprs
and options), then compiled for sm90 with the options the wrapper passed.

Why: with Triton's default FP fusion, LLVM turns round(x + round(gate * shared)) into one `fma.rn.bf16` (the
product unrounded); on an H100 (fiftieth session) only 75-84% of the gated add's elements had torch's bits.
activation.ROUNDED_AS_TORCH turns the fusion off for these launches.

    python3 scripts/dev/rounding_ptx.py            # one JSON line a kernel: the bf16 arithmetic in its PTX
    python3 scripts/dev/rounding_ptx.py --fusion   # the same launches compiled with FP fusion forced on
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted: the kernels are JIT functions here

BF16_OPS = re.compile(r"\b((?:fma|mul|add)\.rn\.bf16(?:x2)?)\b")


def launches() -> list[tuple[object, tuple, dict]]:
    """(kernel, args, kwargs) of each wrapper's launch on CPU tensors (nothing runs)."""
    import torch

    from longserve.kernels import activation, moe_sum
    from longserve.testing.kernel_compile import CapturedLaunches

    out = []
    for module, name, call in (
        (activation, "_sigmoid_gated_add_kernel", lambda t, g, s: activation.sigmoid_gated_add(t, g, s)),
        (
            moe_sum,
            "_moe_sum_kernel",
            lambda t, g, s: moe_sum.moe_sum(torch.stack([t, t], 1), t, addend=(g, s)),
        ),
    ):
        real, stand_in = getattr(module, name), CapturedLaunches()
        setattr(module, name, stand_in)
        try:
            x = torch.ones(2, 64, dtype=torch.bfloat16)
            call(x, torch.ones(2, 1, dtype=torch.bfloat16), torch.ones(2, 64, dtype=torch.bfloat16))
        finally:
            setattr(module, name, real)
        ((_, args, kwargs),) = stand_in.calls
        out.append((real, args, kwargs))
    return out


def main() -> None:
    from longserve.testing.kernel_compile import compile_sm90, launch_record

    force_fusion = "--fusion" in sys.argv[1:]
    for kernel, args, kwargs in launches():
        fn = kernel
        while not hasattr(fn, "arg_names"):  # kernels/launch.py's FastKernel around the JITFunction
            fn = fn.fn
        rec = launch_record(fn.fn, args, kwargs)
        options = {**rec["options"], **({"enable_fp_fusion": True} if force_fusion else {})}
        compiled = compile_sm90(fn, rec["signature"], rec["constexprs"], **options)
        ops = sorted(set(BF16_OPS.findall(compiled.asm["ptx"])))
        print(json.dumps({"kernel": rec["name"], "options": options, "bf16_ops": ops}), flush=True)


if __name__ == "__main__":
    main()
