"""Reading a compiled kernel's binary without a GPU: its resource usage and its SASS loops.

The CUDA binary tools that ship with triton (cuobjdump, nvdisasm) run on any machine; kernel_compile's checks and
the scripts/dev/count_*_sass.py probes read registers, spills and the instructions of a kernel's main loop here.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess


def cubin_tool(cubin: bytes, tool: str, *args: str) -> str:
    """The output of one of the CUDA binary tools that ship with triton (cuobjdump, nvdisasm) on a cubin."""
    import tempfile

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([path, *args, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack, shared and local (spill) memory of a cubin (cuobjdump ships with triton)."""
    m = re.search(
        r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", cubin_tool(cubin, "cuobjdump", "-res-usage")
    )
    return dict(regs=int(m[1]), stack=int(m[2]), shared=int(m[3]), local=int(m[4])) if m else {}


SASS_ADDRESS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/")


def _sass_code(sass: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The listing's lines and its instructions as (address, line)."""
    lines = sass.splitlines()
    return lines, [(int(m.group(1), 16), line) for line in lines if (m := SASS_ADDRESS.match(line))]


def _backward_branches(lines: list[str], code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of each loop body: a branch to a label at or before it."""
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:$", line)}
    loops = []
    for pc, line in code:
        target = re.search(r"BRA\s.*?(\.L_x_\d+)", line)
        if target and target.group(1) in labels:
            first = next(
                int(m.group(1), 16)
                for x in lines[labels[target.group(1)] + 1 :]
                if (m := SASS_ADDRESS.match(x))
            )
            if first < pc:
                loops.append((first, pc))
    return loops


def _body(code: list[tuple[int, str]], span: tuple[int, int]) -> list[str]:
    return [line for pc, line in code if span[0] <= pc <= span[1]]


def loop_instructions(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body."""
    lines, code = _sass_code(sass)
    loops = _backward_branches(lines, code)
    return _body(code, max(loops, key=lambda s: s[1] - s[0])) if loops else []


def innermost_loop(sass: str, opcode: str) -> list[str]:
    """The instructions of the shortest loop body holding `opcode` (a kernel's main loop, where the retry branches
    of mbarrier waits, placed at the function's end, jump back across it)."""
    lines, code = _sass_code(sass)
    loops = [s for s in _backward_branches(lines, code) if any(opcode in line for line in _body(code, s))]
    return _body(code, min(loops, key=lambda s: s[1] - s[0])) if loops else []


def opcode_counts(lines: list[str]) -> dict[str, int]:
    """SASS lines' opcodes (predicates and modifiers dropped), most frequent first."""
    ops = collections.Counter(
        re.sub(r"^(@!?U?P\w+\s+)?", "", SASS_ADDRESS.sub("", line).strip()).split()[0].split(".")[0]
        for line in lines
    )
    return dict(ops.most_common())
