"""How many recurrent-state slots a hybrid model's runner holds (attention/recurrent_state.py), before its KV pool
is sized from the memory left.

One slot a running request (`--max-num-seqs`), unless the states would take more than STATE_SHARE (or SGLang's
`--mamba-full-memory-ratio` r: r / (1 + r)) of the memory the weights leave (the same budget the KV pool is sized
from: mem_fraction_static of the device): then fewer slots, with a warning, and at most that many requests run at
once (a request waits for a slot as it waits for pages). A
float32 slot of the Qwen3.5-35B-A3B shape is 60 MiB (30 linear layers of 32 x 128 x 128 values): 256 slots are
15 GiB. With prefix caching, the prefix cache's state checkpoints (cache/state_radix_tree.py) take as many rows
again from the same share, so memory short of that halves the running slots. Under tensor parallelism slot ids
are global (one allocator, on rank 0): every rank takes the smallest rank's count.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from longserve.attention.recurrent_state import RecurrentStates
from longserve.distributed import min_over_ranks
from longserve.platform import static_budget

logger = logging.getLogger("longserve.runner")

# at most this share of the budget for states, the rest for the KV pool, unless --mamba-full-memory-ratio r says
# r / (1 + r) (SGLang's default r of 0.9 gives the states ~47% of the pair)
STATE_SHARE = 0.5


def state_share(ratio: float | None) -> float:
    """The share of the memory the weights leave that state rows may take (config.mamba_full_memory_ratio)."""
    return STATE_SHARE if ratio is None else ratio / (1 + ratio)


def state_dtypes(config: Any, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(the convs' inputs, the delta rule's states) for a model of `dtype`: config.mamba_cache_dtype, and
    config.mamba_ssm_cache_dtype (auto: the model's dtype, or mamba_cache_dtype where that is given, as vLLM reads
    them)."""
    conv = dtype if config.mamba_cache_dtype == "auto" else getattr(torch, config.mamba_cache_dtype)
    given = config.mamba_ssm_cache_dtype
    return conv, conv if given == "auto" else getattr(torch, given)


def keeps_checkpoints(config: Any) -> bool:
    return bool(config.enable_prefix_caching) and config.mamba_cache_mode == "align"


def state_rows(fits: int, want: int, keep: bool) -> tuple[int, int]:
    """(running slots, prefix-cache checkpoints) of `fits` state rows for `want` running requests: with prefix
    caching (`keep`) as many checkpoints as slots, at most half of what fits each (one a running request's prompt,
    or a document and its questions' junction)."""
    slots = min(want, max(1, fits // 2)) if keep else min(want, fits)
    return slots, (min(want, fits - slots) if keep else 0)


def recurrent_states(
    model: Any, config: Any, dtype: torch.dtype, device: torch.device, tp: Any = None
) -> RecurrentStates | None:
    """The model's state slots, or None for a model without linear-attention layers, in `state_dtypes`."""
    found = model.recurrent_states()
    if found is None:
        return None
    num_layers, spec = found
    conv_dtype, ssm_dtype = state_dtypes(config, dtype)
    per_slot = num_layers * spec.bytes_per_slot(conv_dtype, ssm_dtype)
    budget = static_budget(device, config.mem_fraction_static)[
        0
    ]  # what the weights leave, as for the KV pool
    share = state_share(config.mamba_full_memory_ratio)
    fits = min_over_ranks(int(max(budget, 0) * share // per_slot), tp)
    cap = config.max_mamba_cache_size  # SGLang's: every state row, slots and checkpoints together
    fits = min(fits, cap) if cap is not None else fits
    want = config.max_running_requests
    if fits < 1:
        raise RuntimeError(
            f"no memory for one recurrent-state slot ({per_slot / 2**20:.1f} MiB: {num_layers} linear-attention "
            f"layers, states {ssm_dtype}) beside the weights; raise mem_fraction_static or use "
            "--mamba-ssm-cache-dtype bfloat16"
        )
    keep = keeps_checkpoints(config)
    slots, checkpoints = state_rows(fits, want, keep)
    if slots < want:
        logger.warning(
            "%d recurrent-state slots (%.2f GiB) fit in %s, of %d asked for (--max-num-seqs)%s: at most %d "
            "requests run at once; --mamba-ssm-cache-dtype bfloat16 halves a slot",
            slots, slots * per_slot / 2**30,
            "--max-mamba-cache-size" if cap is not None and fits == cap
            else f"{share:.0%} of the memory the weights leave",
            want, " beside as many prefix-cache checkpoints" if checkpoints else "", slots,
        )  # fmt: skip
    if keep and not checkpoints:
        logger.warning(
            "prefix caching is off: no memory for a linear-attention state checkpoint beside one slot"
        )
    return RecurrentStates(
        num_layers, spec, slots, conv_dtype, ssm_dtype, device, num_checkpoints=checkpoints
    )
