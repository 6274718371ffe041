"""Instructions a weight in the one-row int4 GEMV's inner loop (kernels/int4_gemv.py), from its sm90 SASS, on
any machine (Triton ships ptxas and nvdisasm): the kernel is issue-bound at decode (an H200 streams a weight
in ~0.25 ns and its SMs issue ~33 T lane-instructions/s: at 4 instructions a weight the issue takes as long as
the bytes), so this count predicts its speed before a GPU does. The loop is the longest backward branch; a
weight is one of the BLOCK_N x BLOCK_K a program's tile holds, over its 32 x num_warps threads.

    python3 scripts/dev/count_gemv_sass.py                        # the default variants, one line each
    python3 scripts/dev/count_gemv_sass.py '{"bn": 128, "raw_hi": true}'   # one variant (compile_int4_gemv's keys)
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, before triton is imported
sys.path.insert(0, os.path.dirname(__file__))

from compile_quant_gemv import compile_int4_gemv  # noqa: E402

VARIANTS = [
    {"bn": 256},
    {"bn": 256, "raw_hi": True},
    {"bn": 128},
    {"bn": 128, "raw_hi": True},
    {"bn": 256, "routed": True, "zp": True},
    {"bn": 256, "routed": True, "zp": True, "raw_hi": True},
]
_ADDR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/")


def loop_instructions(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:$", line)}
    code = [(int(m.group(1), 16), line) for line in lines if (m := _ADDR.match(line))]
    best = (0, -1)
    for pc, line in code:
        target = re.search(r"BRA\s.*?(\.L_x_\d+)", line)
        if target and target.group(1) in labels:
            first = next(
                int(m.group(1), 16) for x in lines[labels[target.group(1)] + 1 :] if (m := _ADDR.match(x))
            )
            if first < pc and pc - first > best[1] - best[0]:
                best = (first, pc)
    return [line for pc, line in code if best[0] <= pc <= best[1]]


def count(variant: dict) -> dict:
    kw = {"bn": 256, **variant}
    compiled = compile_int4_gemv(**kw)
    nvdisasm = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    body = loop_instructions(sass)
    ops = collections.Counter(re.sub(r"^(@!?U?P\w+\s+)?", "", _ADDR.sub("", line).strip()).split()[0].split(".")[0]
                              for line in body)  # fmt: skip
    weights_per_thread = kw["bn"] * kw.get("bk", 128) / (32 * kw.get("num_warps", 4))
    return {"variant": variant, "loop": len(body), "per_weight": round(len(body) / weights_per_thread, 2),
            "top": dict(ops.most_common(8))}  # fmt: skip


if __name__ == "__main__":
    for v in [json.loads(a) for a in sys.argv[1:]] or VARIANTS:
        print(json.dumps(count(v)), flush=True)
