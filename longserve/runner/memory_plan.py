"""What a runner's memory holds and fits: this rank's weights (the experts' share apart), KV pool and a hybrid
model's linear-attention states; the start-up log line and /server_info's "memory"."""

from __future__ import annotations

from typing import Any

from longserve.models.moe import expert_weight_summary


def plan(runner: Any) -> dict[str, Any]:
    """The ModelRunner's plan (its `memory_plan`, fixed once the runner is built)."""
    tokens = runner.num_pages * runner.page_size
    return dict(
        weight_bytes=runner.weight_bytes(),
        **expert_weight_summary(runner.model),
        kv_pool_tokens=tokens,
        kv_pool_pages=runner.num_pages,
        kv_bytes_per_token=runner.kv_bytes_per_token(),
        kv_pool_bytes=tokens * runner.kv_bytes_per_token(),
        context_length=runner.context_length,
        requests_at_full_context=tokens / runner.context_length,
        page_size=runner.page_size,
        dtype=str(runner.dtype).removeprefix("torch."),
        kv_cache_dtype=str(runner.kv_dtype).removeprefix("torch."),
        device=str(runner.device),
        tp_size=runner.tp.world_size if runner.tp else 1,
        ep_size=runner.tp.ep_size if runner.tp else 1,
        # a hybrid model's linear-attention states (one slot a running request), else 0
        state_slots=runner.num_state_slots,
        state_checkpoints=runner.num_state_checkpoints,  # the prefix cache's (cache/state_radix_tree.py)
        state_bytes=runner.states.nbytes if runner.states is not None else 0,
    )


def describe(m: dict[str, Any]) -> str:
    """The plan as the start-up log line says it."""
    extra = ""
    if m["moe_layers"]:
        here = "" if m["local_experts"] == m["num_experts"] else f", {m['local_experts']} on this rank"
        extra = (
            f" (experts {m['expert_weight_bytes'] / 2**30:.2f} GiB: {m['moe_layers']} MoE layers of "
            f"{m['num_experts']} experts{here})"
        )
    if m["state_slots"]:
        extra += (
            f"; linear-attention states {m['state_bytes'] / 2**30:.2f} GiB ({m['state_slots']} slots: one a "
            f"running request, and {m['state_checkpoints']} prefix-cache checkpoints)"
        )
    parallel = f"; per rank of tp={m['tp_size']}" if m["tp_size"] > 1 else ""
    if m["tp_size"] > 1 and m["ep_size"] > 1:
        parallel += f", ep={m['ep_size']}"
    return (
        f"KV pool: {m['kv_pool_tokens']:,} tokens ({m['kv_pool_pages']:,} pages of {m['page_size']}), "
        f"longest context {m['context_length']:,}, {m['requests_at_full_context']:.1f} requests at full "
        f"context, {m['kv_pool_bytes'] / 2**30:.2f} GiB; weights {m['weight_bytes'] / 2**30:.2f} GiB"
        f"{extra} ({m['dtype']}, KV {m['kv_cache_dtype']}, {m['device']}){parallel}"
    )
