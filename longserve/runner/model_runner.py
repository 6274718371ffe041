"""ModelRunner: owns the model weights, the KV pool tensors and the attention backend; runs one step.

Under tensor parallelism (config.tp_size > 1) there is one ModelRunner per rank, each with its shard of
the weights and of the KV heads. Rank 0's (built by the engine) first spawns the workers (runner/tp_workers.py);
its `forward` broadcasts the step's plain inputs, every rank runs `forward_step`, rank 0 samples (`sample`).
The context length it serves, once its KV pool is sized, is resolved in runner/context_length.py.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from longserve.attention import ForwardContext, GraphShape, KVCache, get_attention_backend
from longserve.attention.kv_quant import kv_storage_dtype, layer_kv_scales
from longserve.config import EngineConfig
from longserve.distributed import (
    RankFailure,
    broadcast_object,
    get_tp_group,
    min_over_ranks,
    set_ep_size,
    tp_broadcast,
)
from longserve.memory import bound_kernel_caches, start_heap_trimmer
from longserve.models import load_model, resolve_dtype
from longserve.models.decoder import validate_tp_size
from longserve.models.pooler import apply_hf_overrides, resolve_pooler
from longserve.models.quant.config import apply_quantization
from longserve.outputs import SchedulerOutput
from longserve.platform import host_to_device, resolve_device, static_budget
from longserve.runner import memory_plan, prompt_logprobs, state_plan, step_tokens
from longserve.runner.context_length import resolve_context_length
from longserve.runner.cuda_graph import build_graphs
from longserve.runner.inputs import StepInputs, build_step, split_step, to_model_inputs
from longserve.runner.pooling import pooled_output
from longserve.runner.sample_step import StepSampler
from longserve.runner.sampled import SampledStep, StepLogits
from longserve.runner.warm_up import WarmUp, freeze_heap, unfreeze_heap, warm_up

logger = logging.getLogger("longserve.runner")


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config) -> None:
        bound_kernel_caches()  # before this process's first bf16 matmul and before the workers start
        self.config = config
        self.hf_config = apply_hf_overrides(hf_config, config.hf_overrides)  # in place: the engine's too
        # --quantization against config.json's quantization_config, checked before any process or read
        apply_quantization(self.hf_config, config.quantization, config.load_format)
        self.workers = None  # rank 0 of a tp run: its worker processes (runner/tp_workers.py)
        self.heap_frozen = False  # warm_up froze the start-up heap (runner/warm_up.py): shutdown unfreezes it
        if config.tp_size > 1 and get_tp_group() is None:  # the engine's rank: start the other ranks
            validate_tp_size(hf_config, config.tp_size, config.ep_size)
            from longserve.runner.tp_workers import TPWorkers

            self.workers = TPWorkers.start(config)
            self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            self._init(config, hf_config)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig, hf_config) -> None:
        self.tp = get_tp_group()
        set_ep_size(config.ep_size if self.tp is not None else 1)  # before the model is built: its experts
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            start_heap_trimmer()  # the steps' freed host tensors given back, not kept by the heap
        if self.tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", self.tp.local_rank)
        self.dtype = resolve_dtype(config.dtype, hf_config)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # an embedding model or a reranker (models/pooler.py): it pools its prompts' last positions
        self.pooler = resolve_pooler(config.runner, config.convert, hf_config, config.model)
        self.model = load_model(
            config.model,
            hf_config,
            self.dtype,
            self.device,
            load_format=config.load_format,
            seed=config.seed,
            pooler=self.pooler,
        )
        # a lone prompt's step (the scheduler's; the largest step follows from it): the model may choose
        self.lone_prefill_chunk_size = step_tokens.resolve_lone_prefill_chunk(
            config, self.model, self.device.type
        )
        # what the KV pages hold: the model's dtype, or e4m3 for --kv-cache-dtype fp8 (half the bytes)
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        # a hybrid model's linear-attention states, before the KV pool is sized from the memory left
        self.states = state_plan.recurrent_states(self.model, config, self.dtype, self.device, self.tp)
        self.num_state_slots = self.states.num_slots if self.states is not None else 0
        self.num_state_checkpoints = self.states.num_checkpoints if self.states is not None else 0
        self.num_pages = self._num_pages()
        # refuse an impossible context length before the large allocation
        self.context_length = resolve_context_length(config, hf_config, self.num_pages * config.page_size)
        self.model.reserve_positions(self.context_length)
        self.kv_cache = KVCache(
            self.model.num_layers,
            self.num_pages + 1,  # page 0 is a padding target, never handed out
            config.page_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.kv_dtype,
            self.device,
        )
        self._set_kv_scales()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.graph_runner, self.extend_graphs, self.piecewise_graphs = build_graphs(
            self.model, self.kv_cache, self.backend, self._graph_shape(), config, self.states
        )
        self.last_prompt_logprobs: dict | None = None  # the last step's by request id (prompt_logprobs.py)
        self.step_sampler = StepSampler(self.device, config.max_running_requests, self.model.vocab_size)
        self.num_tokens_computed = 0  # every token fed through the model (tests count cache hits by it)
        self.num_forward_passes = 0
        self.num_overlapped_passes = 0  # tp steps run as two overlapped halves
        if self.tp is not None:  # every rank has its weights, pool and graphs: only now is the engine ready
            dist.barrier(group=self.tp.cpu_group)

    @property
    def page_size(self) -> int:
        """Tokens per KV page: the KV cache's (set once from config.page_size)."""
        return self.kv_cache.page_size

    def _graph_shape(self) -> GraphShape:
        return GraphShape(
            max_seq_len=self.context_length,
            num_q_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def warm_up(self, counts: list[int] | None = None) -> None:
        """This rank's warm-up (runner/warm_up.py), on the thread that runs the steps; on a GPU, or elsewhere
        when `counts` are given. Rank 0 of a tp run first sends it to the other ranks (their forward passes
        meet in the same collectives)."""
        if self.workers is not None and self.tp.rank == 0:  # (a node's first rank has workers, sends nothing)
            self.workers.check()
            broadcast_object(WarmUp(counts))
        if self.device.type == "cuda" or counts is not None:
            # the model's own lone step shrinks to what the device holds (runner/step_tokens.py)
            cfg, lone = self.config, self.lone_prefill_chunk_size
            optional = step_tokens.optional_past(cfg, lone, self.tp is not None)
            fits = warm_up(self.model, self.backend, self.kv_cache, self._graph_shape(),
                           self.max_step_prompt_tokens, counts, optional, cfg.chunked_prefill_size,
                           self.states)  # fmt: skip
            if fits < self.max_step_prompt_tokens:  # an optional pass ran out of memory
                self.lone_prefill_chunk_size = step_tokens.lone_step_that_fits(cfg, lone, fits)
            self.heap_frozen = freeze_heap() or self.heap_frozen

    @property
    def max_step_prompt_tokens(self) -> int:
        """The most prompt tokens one step holds: what warm-up compiles and plans for."""
        return step_tokens.max_step_prompt_tokens(self.config, self.lone_prefill_chunk_size)

    def _set_kv_scales(self) -> None:
        """An fp8 cache's per-layer scales: the checkpoint's calibrated ones, else 1.0 (attention/kv_quant.py)."""
        found = getattr(self.model, "kv_scales", {})
        if not self.kv_cache.is_fp8:
            if found:
                logger.info("the checkpoint's fp8 KV scales are unused: the KV cache is %s", self.kv_dtype)
            return
        self.kv_cache.set_scales(*layer_kv_scales(found, self.model.num_layers))
        logger.info(
            "fp8 (e4m3) KV cache with %s",
            "the checkpoint's per-layer scales"
            if found
            else "scales 1.0 (the checkpoint has no k_scale/v_scale)",
        )

    # ---- sizing ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return KVCache.bytes_per_token(
            self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype
        )

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _num_pages(self) -> int:
        if self.config.max_total_tokens is not None:
            return -(-self.config.max_total_tokens // self.config.page_size)
        per_page = self.kv_bytes_per_token() * self.config.page_size
        budget, total, free = static_budget(self.device, self.config.mem_fraction_static)
        num_pages = int(budget // per_page)
        if num_pages < 1:
            raise RuntimeError(
                f"no memory left for the KV pool: {total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free after "
                f"loading {self.weight_bytes() / 2**30:.2f} GiB of weights, mem_fraction_static="
                f"{self.config.mem_fraction_static}; raise mem_fraction_static or use a smaller model"
            )
        if self.device.type == "cpu":
            # host RAM is shared with everything else: at most 4 GiB, and no more than every running
            # request at full context could use
            context = (
                self.config.context_length or getattr(self.hf_config, "max_position_embeddings", 0) or 2048
            )
            useful = -(-self.config.max_running_requests * context // self.config.page_size)
            num_pages = min(num_pages, int(4 * 2**30 // per_page), useful)
        return min_over_ranks(num_pages, self.tp)  # page ids are global: the smallest rank's pool

    # ---- one step -------------------------------------------------------------------------------
    def forward(self, out: SchedulerOutput, prev: SampledStep | None = None) -> StepLogits:
        """Rank 0: queue the scheduled step's forward pass (on every rank under tp) without waiting for the
        device. `prev`: the step launched before this one, whose ids have not been read: this step's decodes
        of tokens still pending (Request.num_pending) take their input from prev.token_ids on the device."""
        return self.launch(self.prepare(out, prev), prev)

    def prepare(self, out: SchedulerOutput, prev: SampledStep | None = None) -> StepInputs:
        """Rank 0, host only: the scheduled step as plain data, read from its requests now. What happens to
        them before `launch` (the step before read, a request ended and its pages released) leaves it as is."""
        step = build_step(out)
        if step.pending_dst:
            assert prev is not None and prev.token_ids is not None, (
                "pending inputs need the previous step's ids"
            )
            step.num_prev_rows = prev.token_ids.shape[0]
        return step

    def launch(
        self, step: StepInputs, prev: SampledStep | None = None, early: Callable[[], None] | None = None
    ) -> StepLogits:
        """Rank 0: queue a prepared step's forward pass (every rank under tp), its pending inputs taken from
        prev.token_ids on the device. `early` (called once, host work such as reading the step before): as soon
        as the step's first layers are queued (forward_step), so the device has them to run meanwhile."""
        prev_tokens = prev.token_ids if prev is not None else None
        if self.workers is None:
            logits = self.forward_step(step, prev_tokens, early)  # [N, V] fp32 or None
        else:
            self.workers.check()
            try:
                broadcast_object(step)
                logits = self.forward_step(step, prev_tokens, early)
            except Exception as e:
                # a peer died mid-collective (gloo/NCCL report a closed connection), or this rank failed
                # while the others went on: the ranks are out of step for good, so the engine is done
                message = self.workers.dead_worker(wait=1.0) or (  # a local worker's death says it best
                    f"tensor-parallel step failed; a rank may have died: {type(e).__name__}: {e}"
                )
                self.workers.fail(message)
                raise RankFailure(message) from e
        prompt_lps, self.last_prompt_logprobs = self.last_prompt_logprobs, None
        return StepLogits(logits, prompt_lps)

    def sample(self, out: SchedulerOutput, fwd: StepLogits, eos_token_ids: frozenset[int]) -> SampledStep:
        """Rank 0: queue the sampling of a forwarded step, without waiting for the device. Under the
        overlapped schedule the engine calls it once the step before has been read: the grammars and
        penalties see every token up to this one."""
        if fwd.logits is None:  # a mid-prompt chunk samples nothing but may owe prompt logprobs
            return SampledStep(prompt_logprobs=fwd.prompt_logprobs)
        reqs = [s.request for s in out.scheduled if s.samples]
        if self.pooler is not None:  # the rows are pooled values (embeddings, scores), not logits
            done = pooled_output(self.pooler, fwd.logits, reqs)
            return SampledStep(done=done, prompt_logprobs=fwd.prompt_logprobs)
        sampled = self.step_sampler(fwd.logits, reqs, eos_token_ids)
        sampled.prompt_logprobs = fwd.prompt_logprobs
        return sampled

    def forward_step(
        self,
        step: StepInputs,
        prev_tokens: torch.Tensor | None = None,
        early: Callable[[], None] | None = None,
    ) -> torch.Tensor | None:
        """Every rank: the forward pass of one step; the sampling rows' logits [N, V] fp32 (None if N=0).
        prev_tokens: the previous step's sampled ids on the device, for the inputs still pending there. early:
        called once the first layers are queued (the piecewise graphs: PiecewiseGraphRunner.run), else before
        the pass is launched."""
        if step.pending_dst and self.tp is not None:  # rank 0 sampled them: every rank takes them as inputs
            if prev_tokens is None:
                prev_tokens = torch.empty(step.num_prev_rows, dtype=torch.int64, device=self.device)
            tp_broadcast(prev_tokens)
        if self.states is None:
            return self._forward_pass(step, prev_tokens, early)
        # a hybrid model's prefix hits start from their checkpoints; chunks ending on a mark leave one (a chunk
        # saving one inside itself, StepInputs.state_mid_saves, has its kernels write it)
        self.states.copy(step.state_copies)
        logits = self._forward_pass(step, prev_tokens, early)
        self.states.copy(step.state_saves)
        return logits

    def _forward_pass(
        self, step: StepInputs, prev_tokens: torch.Tensor | None, early: Callable[[], None] | None
    ) -> torch.Tensor | None:
        min_tokens = self.config.tp_overlap_min_tokens
        if (
            self.tp is not None
            and min_tokens
            and len(step.input_ids) >= max(min_tokens, 2)
            and not step.pending_dst
            and not step.state_mid_saves  # saved at a chunk of the whole step (split_step would move it)
        ):
            if early is not None:
                early()
            return self._forward_overlapped(step)
        inputs = to_model_inputs(step, self.kv_cache.page_size, self.device, prev_tokens)
        ctx = ForwardContext(
            meta=inputs.meta, kv_cache=self.kv_cache, backend=self.backend, states=self.states
        )
        meta = inputs.meta
        decode_graph = self.graph_runner is not None and self.graph_runner.can_run(meta)
        extend_graph = (
            not decode_graph and self.extend_graphs is not None and self.extend_graphs.can_run(meta)
        )
        pieces = (
            not (decode_graph or extend_graph)
            and self.piecewise_graphs is not None
            and self.piecewise_graphs.can_run(meta)
        )
        if early is not None and not pieces:
            early()
        with torch.inference_mode():
            if decode_graph:
                hidden = self.graph_runner.run(inputs.input_ids, inputs.positions, meta)  # [B, H]
            elif extend_graph:
                hidden = self.extend_graphs.run(inputs.input_ids, inputs.positions, meta)  # [T, H]
            elif pieces:
                hidden = self.piecewise_graphs.run(inputs.input_ids, inputs.positions, ctx, early)  # [T, H]
            else:
                hidden = self.model(inputs.input_ids, inputs.positions, ctx)  # [T, H]
            self.num_tokens_computed += inputs.num_tokens
            self.num_forward_passes += 1
            self.last_prompt_logprobs = prompt_logprobs.compute(self.model, hidden, step.prompt_logprobs)
            if inputs.logits_indices.numel() == 0:
                return None
            return self._head(hidden[inputs.logits_indices])  # [N, V] fp32 (pooling: [N, D])

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """The last positions' hidden states [N, H] -> logits [N, V], or a pooling model's values."""
        return self.model.pool(rows) if self.pooler is not None else self.model.compute_logits(rows)

    def _forward_overlapped(self, step: StepInputs) -> torch.Tensor | None:
        """A long step under tensor parallelism as two halves whose all-reduces hide behind each other's
        compute (DecoderModel.forward_overlapped); the same logits as one pass, up to rounding."""
        halves = [
            to_model_inputs(half, self.kv_cache.page_size, self.device)
            for half in split_step(step, len(step.input_ids) // 2)
        ]
        with torch.inference_mode():
            batches = [
                (
                    h.input_ids,
                    h.positions,
                    ForwardContext(
                        meta=h.meta, kv_cache=self.kv_cache, backend=self.backend, states=self.states
                    ),
                )
                for h in halves
            ]
            hidden = torch.cat(self.model.forward_overlapped(batches))  # [T, H]
            self.num_tokens_computed += hidden.shape[0]
            self.num_forward_passes += 1
            self.num_overlapped_passes += 1
            self.last_prompt_logprobs = prompt_logprobs.compute(self.model, hidden, step.prompt_logprobs)
            if not step.logits_indices:
                return None
            rows = host_to_device(step.logits_indices, dtype=torch.long, device=self.device)  # no stream sync
            return self._head(hidden[rows])  # [N, V] fp32 (pooling: [N, D])

    def shutdown(self) -> None:
        """Stop the tp workers (rank 0) and leave the process group, and unfreeze the heap the warm-up froze.
        Idempotent."""
        if self.heap_frozen:
            self.heap_frozen = False
            unfreeze_heap()
        if self.workers is not None:
            workers, self.workers = self.workers, None
            self._finalizer.detach()
            self.release_graphs()  # captured NCCL kernels must not outlive the communicator
            workers.shutdown()

    def release_graphs(self) -> None:
        """Drop the decode CUDA graphs (and their memory pool) before the process group goes."""
        if getattr(self, "graph_runner", None) is not None:
            self.graph_runner = self.extend_graphs = self.piecewise_graphs = None
            gc.collect()
            torch.cuda.synchronize(self.device)

    @functools.cached_property
    def memory_plan(self) -> dict[str, Any]:
        """This rank's weights, KV pool and states, and what they fit (runner/memory_plan.py); fixed once built."""
        return memory_plan.plan(self)

    def describe(self) -> str:
        return memory_plan.describe(self.memory_plan)
