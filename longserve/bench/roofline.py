"""What a `bench latency` case must move at least, from the model's config.json: the FLOPs of its GEMMs and
attention and the bytes of the weights it touches and the KV it reads, at the chip's measured ceilings
(`--peak-tflops`, `--peak-gbps`; by default the H200's ~770 TFLOP/s bf16 and ~4.2 TB/s, an H100's measured
bandwidth on an H100: card_peaks). Each step's floor
is max(FLOPs / peak, bytes / bandwidth); a case's floor is the sum over its steps (a long prompt is
prefilled in chunks of --chunked-prefill-size, each reading the weights again). Torch-free: plan and
report use it before and after the engine runs.

Mixtures of experts: a step of T tokens computes k experts per token but reads only the experts it touches,
E (1 - (1 - k/E)^T) per layer on average for uniform routing (models/moe_layout.expected_distinct_experts):
a decode step of one token reads k experts, an 8K-token chunk all of them. Under tensor (or expert)
parallelism the work is split over tp_size GPUs, each at the same ceilings (the collectives are not in the
floor: their cost shows as the ratio). The embedding lookup and norms are noise and left out; the LM head
counts for the rows that are sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from longserve.sched.chunk_size import aligned_chunk, bounded_lone_chunk

H200_PEAK_TFLOPS = 770.0  # measured bf16 dense GEMM ceiling (benchmarks/RESULTS.md)
H200_PEAK_GBPS = 4200.0  # measured HBM bandwidth
# An H100 (SXM, HBM3) has the H200's chip and clocks (the same GEMM ceiling) and less bandwidth: a device copy on one
# moved 2,843 GB/s read + write (twenty-ninth session, scripts/probes/tma_stream.py; RESULTS.md).
H100_PEAK_GBPS = 2843.0


def card_peaks(device: str) -> tuple[float, float]:
    """(TFLOP/s, GB/s) a floor takes on the card named (torch.cuda.get_device_name): the H100's bandwidth on an H100,
    else the H200's ceilings (other cards: pass --peak-tflops and --peak-gbps)."""
    return (H200_PEAK_TFLOPS, H100_PEAK_GBPS) if "H100" in device else (H200_PEAK_TFLOPS, H200_PEAK_GBPS)


@dataclass(frozen=True)
class ModelCosts:
    """Parameter counts and KV size of a decoder (whole model, every rank together)."""

    hidden: int
    num_layers: int  # the layers with K/V (a hybrid model's full-attention ones)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    itemsize: int
    dense_params: int  # used by every token: attention projections, dense MLPs, routers, shared experts
    expert_params: int  # one expert (gate, up, down)
    moe_layers: int
    num_experts: int
    top_k: int
    embed_params: int  # embedding + LM head (once when tied)
    windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)
    # bytes a decoder-layer weight and a K/V value take where they differ from itemsize (quantized weights with
    # their scales, an fp8 KV cache): with_measured_bytes; the embeddings and the LM head stay at itemsize
    layer_itemsize: float | None = None
    kv_itemsize: float | None = None

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim * (self.kv_itemsize or self.itemsize)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def weight_bytes(self) -> int:
        """Every weight of the model (all experts)."""
        experts = self.moe_layers * self.num_experts * self.expert_params
        return (self.embed_params + self.dense_params + experts) * self.itemsize

    @property
    def active_params_per_token(self) -> int:
        """The parameters one token multiplies by in the decoder layers (k experts per MoE layer)."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def _windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window, with transformers' semantics (as models/decoder.layer_sliding_window)."""
    window = _get(cfg, "sliding_window")
    if not window or _get(cfg, "use_sliding_window", True) is False:
        return (None,) * num_layers
    types = _get(cfg, "layer_types")
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * num_layers


def _gated_delta_params(cfg: dict[str, Any]) -> int:
    """One Gated DeltaNet layer's parameters (models/gated_delta_net.py): in_proj_qkv, z, b, a, out_proj, conv."""
    h, hk, hv = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key, value = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"]
    conv = (2 * key + value) * cfg["linear_conv_kernel_dim"]
    return h * (2 * key + value) + h * value + 2 * h * hv + value * h + conv + 2 * hv


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config.json dict with a vision-language checkpoint's (Qwen3.5) `text_config` keys over the top level's:
    the decoder the engine serves."""
    return {**cfg, **cfg.get("text_config", {})}


def model_costs(cfg: dict[str, Any], itemsize: int) -> ModelCosts:
    """The costs of a config.json dict (dense, MoE or hybrid) with weights and KV of `itemsize` bytes;
    `num_layers` counts the layers with K/V (a hybrid model's full-attention layers)."""
    from longserve.models.moe_layout import moe_spec  # pure Python, but its package imports torch

    cfg = text_model_config(cfg)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    n_q = cfg["num_attention_heads"]
    n_kv = _get(cfg, "num_key_value_heads", n_q)
    hd = _get(cfg, "head_dim", h // n_q)
    # a hybrid model (Qwen3.5): its linear-attention layers hold no K/V, and its q_proj also yields a gate
    types = list(_get(cfg, "layer_types", None) or [])[:layers]
    linear = sum(t == "linear_attention" for t in types)
    kv_layers = layers - linear
    q_rows = 2 * n_q if linear else n_q
    attention = h * hd * (q_rows + n_q + 2 * n_kv)  # q (and gate), o, k and v
    mixers = kv_layers * attention + (linear * _gated_delta_params(cfg) if linear else 0)
    spec = moe_spec(cfg)
    if spec is None:
        dense = mixers + layers * 3 * h * cfg["intermediate_size"]
        expert, moe_layers, num_experts, top_k = 0, 0, 0, 0
    else:
        sparse = len(spec.sparse_layers)
        per_sparse = spec.num_experts * h + 3 * h * spec.shared_intermediate_size  # router, shared expert
        per_sparse += h if spec.shared_intermediate_size else 0  # its gate
        dense = mixers + sparse * per_sparse
        dense += spec.num_dense_layers * 3 * h * spec.dense_intermediate_size
        expert, moe_layers = 3 * h * spec.intermediate_size, sparse
        num_experts, top_k = spec.num_experts, spec.top_k
    vocab = cfg["vocab_size"]
    return ModelCosts(
        hidden=h,
        num_layers=kv_layers,
        num_q_heads=n_q,
        num_kv_heads=n_kv,
        head_dim=hd,
        vocab=vocab,
        itemsize=itemsize,
        dense_params=dense,
        expert_params=expert,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        embed_params=vocab * h * (1 if cfg.get("tie_word_embeddings") else 2),
        windows=_windows(cfg, kv_layers),
    )


def with_measured_bytes(costs: ModelCosts, weight_bytes: float, kv_bytes_per_token: float) -> ModelCosts:
    """`costs` with the bytes a loaded engine holds (its memory plan, all ranks together): the decoder layers'
    weights per parameter (int4 with its scales ~0.52, FP8 ~1) and the K/V per value (an fp8 cache: 1), so that a
    quantized model's floor counts the bytes it reads."""
    layer_params = costs.dense_params + costs.moe_layers * costs.num_experts * costs.expert_params
    layer_bytes = weight_bytes - costs.embed_params * costs.itemsize
    kv_values = costs.num_layers * 2 * costs.num_kv_heads * costs.head_dim
    return dataclasses.replace(
        costs,
        layer_itemsize=layer_bytes / layer_params if layer_params and layer_bytes > 0 else None,
        kv_itemsize=kv_bytes_per_token / kv_values if kv_values else None,
    )


def _keys_attended(prefix: int, new: int, window: int | None) -> int:
    """Sum over the new tokens at positions [prefix, prefix + new) of the keys each attends to (causal,
    within `window`): sum of min(x, window) for x in [prefix + 1, prefix + new]."""
    lo, hi = prefix + 1, prefix + new
    if window is None or hi <= window:
        return (lo + hi) * new // 2
    full_hi = max(lo - 1, min(hi, window))  # keys grow up to the window, then stay there
    grown = (lo + full_hi) * (full_hi - lo + 1) // 2 if full_hi >= lo else 0
    return grown + (hi - max(lo - 1, window)) * window


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    def seconds(self, peak_tflops: float, peak_gbps: float, gpus: int = 1) -> float:
        return max(self.flops / (peak_tflops * 1e12), self.bytes / (peak_gbps * 1e9)) / gpus


def step_cost(costs: ModelCosts, requests: list[tuple[int, int]], sampled: int) -> StepCost:
    """One step over `requests` (prefix, new tokens) each, `sampled` rows of logits."""
    from longserve.models.moe_layout import expected_distinct_experts

    tokens = sum(new for _, new in requests)
    flops = 2.0 * costs.active_params_per_token * tokens + 2.0 * costs.vocab * costs.hidden * sampled
    weights = costs.dense_params + costs.vocab * costs.hidden * (1 if sampled else 0)
    touched = expected_distinct_experts(costs.num_experts, costs.top_k, tokens)
    weights += costs.moe_layers * touched * costs.expert_params
    kv = 0
    for window in costs.windows:
        for prefix, new in requests:
            flops += 4.0 * costs.num_q_heads * costs.head_dim * _keys_attended(prefix, new, window)
            read = prefix if window is None else min(prefix, window)
            kv += (read + new) * costs.kv_bytes_per_token_layer  # the prefix's K/V read, the new ones written
    head = costs.vocab * costs.hidden * (1 if sampled else 0)
    layer_bytes = (weights - head) * (costs.layer_itemsize or costs.itemsize)
    return StepCost(flops=flops, bytes=layer_bytes + head * costs.itemsize + kv)


def prefill_steps(
    prefix: int, new: int, chunk: int, lone: int | None = None, granule: int = 1
) -> list[tuple[int, int, bool]]:
    """(prefix, tokens, samples) of each chunk of a prompt's prefill, the prompt alone: chunks of `chunk`, or
    the scheduler's lone chunks when `lone` is set, each ending on a multiple of `granule` where the scheduler's
    would (sched/chunk_size.py); the last one samples."""
    steps, done = [], 0
    while done < new:
        take = aligned_chunk(
            min(max(chunk, lone or 0), new - done), prefix + done, new - done, chunk, granule
        )
        if take > chunk:
            take = bounded_lone_chunk(take, prefix + done, lone, chunk, granule)
        steps.append((prefix + done, take, done + take == new))
        done += take
    return steps


def case_floor(
    record: dict[str, Any],
    costs: ModelCosts,
    chunk: int,
    gpus: int = 1,
    peak_tflops: float = H200_PEAK_TFLOPS,
    peak_gbps: float = H200_PEAK_GBPS,
    lone: int | None = None,
    granule: int = 1,
) -> dict[str, Any] | None:
    """The floor of a latency record (cold, prefix_hit: its TTFT in seconds; decode: one step's seconds),
    with its FLOPs, bytes, which bound it and the measured/floor ratio; None for a skipped case."""
    if record.get("skipped"):
        return None
    case = record["case"]
    if case == "decode":
        b, c = record["batch_size"], record["context_len"]
        steps = [step_cost(costs, [(c, 1)] * b, b)]
        measured = record.get("itl_ms_median")
        measured = None if measured is None else measured / 1e3
    else:
        prefix = record.get("cached_tokens", 0) if case == "prefix_hit" else 0
        new = record["prompt_len"] - prefix
        steps = [
            step_cost(costs, [(p, n)], int(last))
            for p, n, last in prefill_steps(prefix, new, chunk, lone, granule)
        ]
        measured = record.get("ttft_s")
    flops, nbytes = sum(s.flops for s in steps), sum(s.bytes for s in steps)
    seconds = sum(s.seconds(peak_tflops, peak_gbps, gpus) for s in steps)
    compute_s = flops / (peak_tflops * 1e12) / gpus
    memory_s = nbytes / (peak_gbps * 1e9) / gpus
    return dict(
        seconds=seconds,
        flops=flops,
        bytes=nbytes,
        compute_s=compute_s,
        memory_s=memory_s,
        bound="compute" if compute_s >= memory_s else "memory",
        steps=len(steps),
        ratio=None if not measured or seconds <= 0 else measured / seconds,
        peak_tflops=peak_tflops,
        peak_gbps=peak_gbps,
        gpus=gpus,
    )


def attach_floors(
    records: list[dict[str, Any]],
    cfg: dict[str, Any],
    itemsize: int,
    chunk: int,
    gpus: int,
    peak_tflops: float,
    peak_gbps: float,
    measured_bytes: tuple[float, float] | None = None,
    lone: int | None = None,
    granule: int = 1,
) -> list[str]:
    """Set each record's "floor" (case_floor); one log line per case that ran. measured_bytes: (weight bytes,
    KV bytes per token) of the engine that ran, all ranks together (with_measured_bytes); chunk and lone: the
    engine's usual and lone steps (sched/chunk_size.py), granule: where its chunks end."""
    costs = model_costs(cfg, itemsize)
    if measured_bytes is not None:
        costs = with_measured_bytes(costs, *measured_bytes)
    lines = []
    for rec in records:
        floor = case_floor(rec, costs, chunk, gpus, peak_tflops, peak_gbps, lone, granule)
        rec["floor"] = floor
        if floor is None:
            continue
        unit, scale = ("ms/step", 1e3) if rec["case"] == "decode" else ("s", 1.0)
        ratio = "-" if floor["ratio"] is None else f"{floor['ratio']:.2f}x"
        lines.append(
            f"{rec['name']}: floor {floor['seconds'] * scale:.4g} {unit} ({floor['bound']}-bound: "
            f"{floor['flops'] / 1e12:.3g} TFLOP, {floor['bytes'] / 1e9:.3g} GB over {floor['steps']} step(s) "
            f"at {peak_tflops:g} TFLOP/s, {peak_gbps:g} GB/s x{gpus}); measured {ratio} the floor"
        )
    return lines
