"""What makes two recorded kernel launches compile to different code, and the fewest launches that cover it all.

Shared by the sm90 compile check (kernel_compile.load_records covers the interpreter's records) and its GPU-tile
variants (gpu_tiles.gpu_variants covers the attention and MoE kernels' launches at the GPU's tiles). Imports nothing of
ours: both of those modules import it, and kernel_compile's entry point imports gpu_tiles.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

Feature = tuple[str, str]


def features(rec: dict[str, Any], shape_constexprs: Callable[[str], bool]) -> set[Feature]:
    """A launch's constexpr switch values (those `shape_constexprs` names aside: tile sizes change shapes, rarely
    which code is generated), its pointers' element types, and its "tile" label where it has one."""
    feats = {(k, json.dumps(v)) for k, v in rec["constexprs"].items() if not shape_constexprs(k)}
    feats |= {("*" + k, v) for k, v in rec["signature"].items() if v.startswith("*")}
    return feats | ({("tile", rec["tile"])} if "tile" in rec else set())


def covering(
    recs: Iterable[dict[str, Any]], feats: Callable[[dict[str, Any]], set[Feature]]
) -> list[dict[str, Any]]:
    """Greedily, richest first (stable: ties keep the given order), the records needed to cover every feature."""
    out, covered = [], set()
    for rec in sorted(recs, key=lambda r: -len(feats(r))):
        if feats(rec) - covered:
            out.append(rec)
            covered |= feats(rec)
    return out
