"""Piecewise CUDA graphs: a step of any mix of requests (prefill chunks beside decodes) replays the dense
parts of every layer as CUDA graphs and runs only the attention proper eagerly between them (vLLM's
piecewise graphs; SGLang's --piecewise-cuda-graph-max-tokens).

Why: an eager step's launch takes the host ~1 ms a layer for the Llama-3.1-8B shape (about 30 torch ops and
Triton launches each): 31 ms for a 1.2K-token step whose device time is 31 ms, and as long for a step of a
few hundred tokens whose device time is a few ms (scripts/probes/step_timeline.py on an H200, 2026-12-02).
Short prompts, a conversation's next turn beside decodes, and RAG questions over a cached document are
such steps. Replayed, a layer costs the host one graph launch and the attention call.

A step of n tokens replays the graphs of the smallest bucket T >= n. The pieces are the code between two
attention calls (`CausalLM.pieces`): piece 0 embeds and projects layer 0's q/k/v, piece i finishes layer
i - 1 (o_proj, norm, MLP) and projects layer i's, the last one finishes the last layer and the final norm.
Each piece leaves q/k/v in one static fused buffer (the models' qkv layout, which the cuDNN plans are built
for) and the next reads the attention's output from one static buffer: one layer's attention runs between
two replays in stream order, so one buffer serves all layers. Rows n..T are padding: token 0 at position 0,
its K/V stored (when the rotary kernel stores) into page 0 (reserved); attention runs over the n real rows
only. A hybrid model's linear-attention layer stops its piece after the input projections: its conv and delta
rule (models/gated_delta_net.py `LinearAttentionCall`) run between the replays over the n real rows, from and
into the requests' state slots (a padding row run through them would be folded into a state), and the next piece
starts at its out_proj. `eager = True` runs the same static-buffer pieces without graphs (tests on the CPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator

import torch

from longserve.attention.base import AttentionBackend, ForwardContext, GraphShape, KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.attention.sdpa import allow_padding_rows
from longserve.models.decoder import AttentionCall
from longserve.models.gated_delta_net import LinearAttentionCall
from longserve.progress import Progress
from longserve.runner.static_tokens import StaticTokens

logger = logging.getLogger("longserve.runner.piecewise_graph")

# what a piece leaves for the eager part between two graphs: an attention layer's q/k/v, or a hybrid model's
# linear-attention layer's projections (its conv and delta rule run over the step's real rows only)
MixerCall = AttentionCall | LinearAttentionCall


class _BetweenPieces(AttentionBackend):
    """The backend a piece is captured with: the pieces stop at each layer's attention call (`CausalLM.pieces`),
    which the step's own backend runs between the replays, so nothing here attends."""

    name = "between-pieces"

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise RuntimeError("a piecewise graph's attention runs between its pieces, not inside one")


BETWEEN_PIECES = _BetweenPieces()

# A step of n tokens runs as the next bucket: its GEMMs pay for the padding. Buckets an eighth of a power of
# two apart (64 at least) pad by at most 12.5%: with buckets a half apart (1024, 1536, ...), a mixed step of
# 1,236 tokens ran as 1,536 and took the device 40 ms, 24% more than it needed (the 8B shape on an H200,
# scripts/probes/step_timeline.py, 2026-12-02); lone prompts at the bucket sizes themselves ran 1-4% slower
# than eager steps (the static buffers' copies).
PIECEWISE_MIN_BUCKET = 64
PIECEWISE_BUCKET_STEPS = 8  # buckets per doubling

# A step with prompt tokens is launched before the engine reads the step in flight (Engine.step, with on_outputs):
# its first layers are queued behind that step, so the device runs them while the host reads and hands out its
# tokens. Read before the launch instead, the device sat idle from that step's end to the next step's first kernel
# (through HTTP on an H200 a prompt step cost ~5 ms over its tokens' share, ~2.2 ms more right behind another
# prompt step, whose first token the hand-out carries: scripts/probes/prompt_step_fit.py, RESULTS.md nineteenth
# session; how much of it this gap is, not yet measured). Two layers of a 1-2K-token step are ~2 ms
# of device time (an estimate, from ~31 ms of kernels for 32 layers), more than the hand-out's host time.
EARLY_AFTER_LAYERS = 2


def _early_after(layers: int, early: Callable[[], None] | None) -> Callable[[], None] | None:
    """Call `early` once `layers` layers are queued (EARLY_AFTER_LAYERS); what is still owed (None once called)."""
    if early is not None and layers >= EARLY_AFTER_LAYERS:
        early()
        return None
    return early


def piecewise_buckets(max_tokens: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The step sizes captured: `sizes` (--piecewise-cuda-graph-tokens, ascending) up to max_tokens; by default
    64, 128, ..., 512 (steps of 64), 576, ..., 1024 (64), 1152, ..., 2048 (128), ... up to max_tokens, and
    max_tokens itself."""
    if sizes is not None:
        return [n for n in sizes if n <= max_tokens]
    sizes, size = [], PIECEWISE_MIN_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size += max(PIECEWISE_MIN_BUCKET, (1 << (size.bit_length() - 1)) // PIECEWISE_BUCKET_STEPS)
    if max_tokens > 1:
        sizes.append(max_tokens)
    return sizes


class PiecewiseGraphRunner:
    """Graphs of every piece at each bucket up to `max_tokens` (see the module's docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        shape: GraphShape,
        max_tokens: int,
        sizes: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = piecewise_buckets(max_tokens, sizes)
        self.max_tokens = n = self.buckets[-1] if self.buckets else 0
        device, d = shape.device, shape.head_dim
        self.tokens = StaticTokens(n, device)
        hq, hkv = shape.num_q_heads, shape.num_kv_heads
        # q, k, v as views of one [n, (Hq + 2 Hkv) D] buffer: the fused layout of the models' projection
        self.qkv = torch.zeros(n, (hq + 2 * hkv) * d, dtype=shape.dtype, device=device)
        # zeros, then model outputs only: a padded cuDNN call may read its rows past a step's in place
        allow_padding_rows(self.qkv)
        q, k, v = self.qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        self.q, self.k, self.v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        self.attn_out = torch.zeros(n, hq * d, dtype=shape.dtype, device=device)  # [n, Hq*D]
        # a hybrid model's linear-attention layers: their projections' and their mixer's output buffers, made at
        # their first call (_keep)
        self.mixer_in: list[torch.Tensor] | None = None
        self.mixer_out: torch.Tensor | None = None
        # per bucket: each piece's graph, and each layer's attention call over the static views
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.layers: dict[int, list[MixerCall]] = {}
        # the last piece's output (the final norm's, [n, hidden]): one buffer for every bucket, so that no
        # bucket's output holds memory of the pool (32 buckets up to 4096 tokens: 0.4 GiB at hidden 4096)
        self.hidden: torch.Tensor | None = None  # [n, hidden], made at capture from the first eager pass
        self.pool = None
        self.eager = False  # True: run() executes the static-buffer pieces instead of replaying
        self.num_runs = 0

    def _context(self, t: int) -> ForwardContext:
        """What the pieces read of a step: the slots the rotary kernel stores the new K/V into."""
        i32 = dict(dtype=torch.int32, device=self.tokens.slot_mapping.device)
        meta = AttentionMetadata(
            page_size=self.kv_cache.page_size,
            query_start_loc=torch.zeros(2, **i32),
            seq_lens=torch.ones(1, **i32),
            prefix_lens=torch.zeros(1, **i32),
            page_table=torch.zeros(1, 1, **i32),
            slot_mapping=self.tokens.slot_mapping[:t],
            query_lens_cpu=[t],
            seq_lens_cpu=[t],
            prefix_lens_cpu=[0],
        )
        return ForwardContext(meta=meta, kv_cache=self.kv_cache, backend=BETWEEN_PIECES)

    def _keep(self, call: MixerCall, t: int) -> MixerCall:
        """Copy a piece's q/k/v (a linear-attention layer's projections) into the static buffers; the call over
        them (its first t rows)."""
        if isinstance(call, AttentionCall):
            self.q[:t].copy_(call.q)
            self.k[:t].copy_(call.k)
            self.v[:t].copy_(call.v)
            return call._replace(q=self.q[:t], k=self.k[:t], v=self.v[:t])
        if self.mixer_in is None:
            # a hybrid model's first linear-attention call, in the first eager pass (the largest bucket's, before
            # any capture): the buffers all its linear-attention layers share, as the attention layers do theirs
            self.mixer_in = [x.new_zeros(self.max_tokens, x.shape[1]) for x in call.inputs]
            self.mixer_out = call.inputs[0].new_zeros(self.max_tokens, call.out_width)
        for buf, x in zip(self.mixer_in, call.inputs, strict=True):
            buf[:t].copy_(x)
        return call._replace(inputs=tuple(buf[:t] for buf in self.mixer_in))

    def _out(self, call: MixerCall) -> torch.Tensor:
        """The static buffer a layer's mixer writes and the next piece reads."""
        return self.attn_out if isinstance(call, AttentionCall) else self.mixer_out

    def _run_rows(self, call: MixerCall, ctx: ForwardContext, n: int) -> torch.Tensor:
        """A kept call's mixer over ctx's n real rows of the static buffers."""
        if isinstance(call, AttentionCall):
            return AttentionCall(call.attn, self.q[:n], self.k[:n], self.v[:n], call.stored).run(ctx)
        return call.rows(n).run(ctx)

    def _pieces(self, t: int) -> Generator[MixerCall, torch.Tensor, torch.Tensor]:
        return self.model.pieces(self.tokens.input_ids[:t], self.tokens.positions[:t], self._context(t))

    @torch.inference_mode()
    def capture(self, pool: object = None) -> None:
        """Every bucket's pieces, largest first, in one pool: two eager passes first (kernels compile and
        allocations settle outside the graphs), then one graph per piece; the attention between them is not
        captured (its output buffer is the next piece's input, whatever it holds)."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        progress = Progress(logger, "capturing piecewise CUDA graphs (step sizes)", len(self.buckets))
        with torch.cuda.stream(stream):
            for i, t in enumerate(sorted(self.buckets, reverse=True)):
                for _ in range(2):
                    out = self._drive(t, None)
                if self.hidden is None:  # the largest bucket comes first
                    self.hidden = out.new_zeros(self.max_tokens, out.shape[1])
                graphs, calls, pieces, done = [], [], self._pieces(t), False
                while not done:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        try:
                            call = pieces.send(self._out(calls[-1])[:t]) if calls else next(pieces)
                            calls.append(self._keep(call, t))
                        except StopIteration as stop:
                            self.hidden[:t].copy_(stop.value)  # [t, hidden]
                            done = True
                    graphs.append(graph)
                self.graphs[t], self.layers[t] = graphs, calls
                progress.step(i + 1)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # the pool is outside the KV pool's budget (--mem-fraction-static leaves the room): say what it took
        logger.info(
            "captured piecewise CUDA graphs for steps of up to %d tokens (%s; %d pieces each) in %.1fs, "
            "%.2f GiB more reserved",
            self.max_tokens, ",".join(map(str, self.buckets)), len(self.graphs[self.max_tokens]),
            time.perf_counter() - start, (torch.cuda.memory_reserved() - reserved) / 2**30,
        )  # fmt: skip

    def _drive(
        self, t: int, ctx: ForwardContext | None, early: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """The pieces of bucket t eagerly over the static buffers; each attention over ctx's real rows (None:
        none, the buffer's contents go on, as in capture). `early`: as in run."""
        pieces = self._pieces(t)
        call = next(pieces)
        layers = 0
        while True:
            call = self._keep(call, t)
            out = self._out(call)
            if ctx is not None:
                n = ctx.meta.num_tokens
                out[:n].copy_(self._run_rows(call, ctx, n))
            try:
                call = pieces.send(out[:t])
            except StopIteration as stop:
                _early_after(EARLY_AFTER_LAYERS, early)  # fewer layers
                return stop.value
            layers += 1
            early = _early_after(layers, early)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return bool(self.graphs or self.eager) and 1 < meta.num_tokens <= self.max_tokens

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        early: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The step of ctx (its inputs on the device) through the bucket's pieces; hidden [n, H]. `early` is
        called once EARLY_AFTER_LAYERS layers are queued (Engine.step reads the step in flight there)."""
        n = ctx.meta.num_tokens
        t = next(b for b in self.buckets if b >= n)
        self.num_runs += 1
        self.tokens.load(input_ids, positions, ctx.meta.slot_mapping, t)  # padding: token 0 at position 0
        if self.eager:
            with torch.inference_mode():
                return self._drive(t, ctx, early)[:n]
        graphs = self.graphs[t]
        # the real rows' views, once a step (every layer's, in turn): the host's time between replays is the cost
        q, k, v, attn_out = self.q[:n], self.k[:n], self.v[:n], self.attn_out[:n]
        if self.mixer_out is not None:
            mixer_in, mixer_out = [buf[:n] for buf in self.mixer_in], self.mixer_out[:n]
        graphs[0].replay()
        for i, (call, graph) in enumerate(zip(self.layers[t], graphs[1:]), start=1):
            if isinstance(call, AttentionCall):
                attn_out.copy_(AttentionCall(call.attn, q, k, v, call.stored).run(ctx))
            else:
                mixer_out.copy_(call.mixer.mix(*mixer_in, ctx))
            graph.replay()
            early = _early_after(i, early)
        _early_after(EARLY_AFTER_LAYERS, early)  # fewer layers
        return self.hidden[:n]
