"""Integer experts dequantized a layer ahead, on a second stream, while the main stream runs attention.

At prefill sizes a layer of integer experts is served by dequantizing all of them and running the 16-bit
fused MoE kernel (kernels/moe_wna16.py, path "dequant"). That write of the experts in the activations' dtype is
memory-bound (the Qwen3-30B-A3B shape: 0.3 GB read and 1.2 GB written a layer, ~0.7 ms on an H100) and sits on
the critical path, where the attention before it is compute-bound: the A3B int4 cold 8K spent 33.6 ms of its
173 ms busy in the dequantization beside 41 ms of attention (`gpu_check.sh int4-fused-prefill`'s profile, RESULTS.md
thirty-eighth session), and is 1.19x bf16's TTFT for it. Here, right after a layer's MoE is issued, the next
chained layer's experts are dequantized on a side stream into one buffer (the side stream first waits for
everything issued so far, so the MoE that reads the buffer is done before it is overwritten); that layer's MoE
waits for the event. Layer 0 of a step dequantizes on the main stream as before.

One buffer pair per model (per shape and dtype), allocated at the first prefill step (warm-up: the memory plan
sees it, as it saw the transient dequantized experts before). `held` says which layer's experts the buffer holds
or is being written with, and the event that marks them written: any use waits for that event first, and a step
that stops between two layers leaves a buffer whose contents are still right for the layer it names (weights do
not change). CUDA-graph capture takes the plain path (no cross-stream events inside a graph). Off until measured
(DEQUANT_AHEAD): `gpu_check.sh dequant-ahead` times the A3B int4 cold 8K / 32K both ways.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from longserve.kernels.moe_reference import MoEQuant

DEQUANT_AHEAD = False


def _dequantize(layer: nn.Module, bufs: tuple[torch.Tensor, ...]) -> None:
    from longserve.kernels.moe_wna16 import dequantize_experts  # imports triton

    quant = layer.quant_method.quant(layer)
    dequantize_experts(quant, layer.w13_int_qweight, "w13", bufs[0].dtype, out=bufs[0])
    dequantize_experts(quant, layer.w2_int_qweight, "w2", bufs[1].dtype, out=bufs[1])


class ExpertsAhead:
    """The chain of one model's integer-expert layers, in forward order, and the buffers they share."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.next: dict[int, nn.Module | None] = {
            id(a): b for a, b in zip(layers, [*layers[1:], None], strict=True)
        }
        self.buffers: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.stream: torch.cuda.Stream | None = None
        # what the buffers hold or are being written with: (layer, buffer key, the side stream's mark or None)
        self.held: tuple[nn.Module, tuple[Any, ...], torch.cuda.Event | None] | None = None
        self.from_ahead = 0  # layers whose experts were dequantized ahead (tests)

    def _buffer(
        self, layer: nn.Module, dtype: torch.dtype
    ) -> tuple[tuple[Any, ...], tuple[torch.Tensor, ...]]:
        w13, w2 = layer.w13_int_qweight, layer.w2_int_qweight
        bits = layer.quant_method.scheme.bits
        shapes = tuple((*w.shape[:-1], w.shape[-1] * 8 // bits) for w in (w13, w2))
        key = (dtype, w13.device, *shapes)
        if key not in self.buffers:
            self.buffers[key] = tuple(torch.empty(s, dtype=dtype, device=w13.device) for s in shapes)
        return key, self.buffers[key]

    def experts(self, layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """`layer`'s experts in `dtype` [E, 2I, H], [E, H, I]: from the buffer if written ahead, else now (on
        the current stream, after the buffer's last write)."""
        key, bufs = self._buffer(layer, dtype)
        if self.held is not None and self.held[2] is not None:
            torch.cuda.current_stream().wait_event(self.held[2])
        if self.held is not None and self.held[0] is layer and self.held[1] == key:
            self.from_ahead += 1
        else:
            _dequantize(layer, bufs)
        self.held = (layer, key, None)
        return bufs

    def launch_next(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """After `layer`'s MoE is issued: the next chained layer's experts, on the side stream."""
        nxt = self.next.get(id(layer))
        if nxt is None:
            return
        key, bufs = self._buffer(nxt, dtype)
        scope: Any = contextlib.nullcontext()  # the CPU (tests): the same order, in one stream
        if bufs[0].is_cuda:
            self.stream = self.stream or torch.cuda.Stream(device=bufs[0].device)
            self.stream.wait_stream(torch.cuda.current_stream())  # the MoE reading the buffers ends first
            scope = torch.cuda.stream(self.stream)
        event = None
        with scope:
            _dequantize(nxt, bufs)
            if bufs[0].is_cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
        self.held = (nxt, key, event)


def moe_ahead(
    layer: nn.Module,
    quant: MoEQuant,
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor | None:
    """The layer's experts through the buffers dequantized ahead, and the next layer's launched; None where
    that does not apply (off, not chained, not the "dequant" path, CUDA-graph capture): the caller's path."""
    ahead = getattr(layer, "experts_ahead", None)
    if not DEQUANT_AHEAD or ahead is None or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    from longserve.kernels.fused_moe import fused_moe  # imports triton
    from longserve.kernels.moe_wna16 import moe_wna16_path

    emap = layer.expert_map
    inter = layer.w13_int_qweight.shape[1] // 2
    path = moe_wna16_path(quant, hidden.shape[0], hidden.shape[1], inter, emap is not None, hidden.dtype)
    if path != "dequant":
        return None
    w13, w2 = ahead.experts(layer, hidden.dtype)
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids)  # [T, H]
    ahead.launch_next(layer, hidden.dtype)
    return out


def link_experts_ahead(model: nn.Module) -> ExpertsAhead | None:
    """Chain the model's layers of integer experts in module order (the forward's, for our decoder stacks):
    each gets `experts_ahead`, the one shared ExpertsAhead. None when it has none."""
    layers = [
        m for m in model.modules() if getattr(getattr(m, "quant_method", None), "dequantizes_experts", False)
    ]
    if not layers:
        return None
    ahead = ExpertsAhead(layers)
    for layer in layers:
        layer.experts_ahead = ahead
    return ahead
