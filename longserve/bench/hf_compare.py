"""`bench latency --compare-hf`: the cold cases through HF transformers (sdpa, random weights from the same
config.json, same dtype and device), timed like the engine's, into the same records (hf_wall_s, hf_ratio)."""

from __future__ import annotations

from typing import Any

from longserve.bench.latency_cases import Timer, free_memory, log, median
from longserve.config import EngineConfig


def run_hf(
    config: EngineConfig, warmup: int, repeat: int, meta: dict[str, Any], records: list[dict[str, Any]]
) -> None:
    """One prefill forward per cold record keeping only the last position's logits, like
    generate(max_new_tokens=1), on the engine's dtype (meta["dtype"]) and device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from longserve.platform import resolve_device

    device = resolve_device(config.device)
    dtype = getattr(torch, meta["dtype"])
    timer = Timer(device)
    log("building the HF transformers model (random weights, sdpa)")
    torch.manual_seed(config.seed)
    hf_config = AutoConfig.from_pretrained(config.model, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    gen = torch.Generator().manual_seed(config.seed + 1)
    vocab = hf_config.vocab_size

    def forward(ids: torch.Tensor) -> int:
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
            return int(logits[0, -1].argmax())

    try:
        for rec in (r for r in records if r["case"] == "cold"):
            log(f"{rec['name']}: running HF transformers")
            timer.reset_peak()
            walls = []
            for i in range(warmup + repeat):
                ids = torch.randint(0, vocab, (1, rec["prompt_len"]), generator=gen).to(device)
                _, wall = timer.time(lambda ids=ids: forward(ids))
                if i >= warmup:
                    walls.append(wall)
            rec.update(hf_wall_s=median(walls), hf_wall_s_runs=walls, hf_peak_mem_gib=timer.peak_gib())
            rec["hf_ratio"] = rec["hf_wall_s"] / rec["wall_s"]
    finally:
        model = None  # drop the weights before anything else runs
        free_memory()
