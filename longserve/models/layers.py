"""Building blocks shared by the decoder models: RMSNorm, fused (stacked) linears, SiLU-and-mul, and
the tensor-parallel linears/embeddings.

Fused linears hold several HF projections stacked along the output dim (q|k|v, gate|up). The one table
`STACKED_PARAMS` says which HF tensor goes into which shard; under tensor parallelism each rank holds a
row range of every shard (column parallel) and `MergedLinear.weight_loader` slices it from the full
checkpoint tensor. `RowParallelLinear` splits the input dim and all-reduces; the vocab-parallel
embedding/LM head split the vocab. Weight loaders take a torch.Tensor or a lazy checkpoint tensor
(`LazyTensor`): they narrow it to the rank's part and read (`as_tensor`) only that part right before the
copy, so a rank reads only what it needs. At tp=1 every layer computes exactly what the plain torch op does.
A linear layer's weight format and product are its `quant_method`'s (linear_method.py), chosen from the
checkpoint's quantization_config; plain weights multiply with F.linear.
Norm and activation run the Triton kernels (longserve/kernels) on CUDA tensors when triton imports
(`use_triton`), else their torch references (kernels/*_reference.py, same signatures).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from longserve.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from longserve.kernels.activation_reference import silu_and_mul_ref
from longserve.kernels.norm_reference import fused_add_rms_norm_ref, rms_norm_ref
from longserve.models.linear_method import LinearMethod, UnquantizedLinearMethod
from longserve.models.quant.layout import check_dtype, entries, layout_of, packed_region, tensor_name
from longserve.platform import use_triton

# (fused param module name, HF module name, shard id) -- the single source of the fused-weight mapping.
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (loader.CheckpointSlice): `.shape` and `.narrow()` select a region
    without reading; `materialize()` reads only that region. Weight loaders accept it or a torch.Tensor."""

    shape: torch.Size

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor: ...

    def materialize(self) -> torch.Tensor: ...


TensorLike = torch.Tensor | LazyTensor


def as_tensor(x: TensorLike) -> torch.Tensor:
    """`x` itself when it is a torch.Tensor, else its (narrowed) region read from the checkpoint."""
    return x if isinstance(x, torch.Tensor) else x.materialize()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, exactly like HF's LlamaRMSNorm; with `zero_centered` like
    Qwen3.5's / Qwen3-Next's / Gemma's: the weight is stored as an offset from 1 (as the checkpoint holds it) and
    the scale (1 + w) is applied in float32 before the one cast.

    `norm(x)` -> y; `norm(x, residual)` -> (y, new_residual) with new_residual = x + residual, y its norm
    (vLLM style: the residual add of the previous sub-layer is fused into this norm).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        # the identity: weight 1, or offset 0 (HF's initialization of either)
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from longserve.kernels.norm import fused_add_rms_norm, rms_norm  # imports triton

            if residual is None:
                return rms_norm(x, self.weight, self.eps, self.zero_centered)  # [..., H]
            return fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)  # [..., H] each
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps, self.zero_centered)  # [..., H]
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps, self.zero_centered)  # [..., H] each


class MergedLinear(nn.Module):
    """A linear layer whose output is several named shards stacked in order (e.g. q|k|v); its weight's format
    and product are its `quant_method`'s (models/linear_method.py; plain weights by default).

    `shard_sizes` are this rank's rows of each shard; `shard_starts` (default 0) the first of those rows
    in the full checkpoint tensor of the shard, whose full size is `full_shard_sizes` (default: local).
    `weight_loader(param, loaded, shard_id)` copies this rank's rows of one HF tensor into its slice of
    the fused parameter; `shard_id=None` loads a whole fused tensor (a checkpoint already saved fused).

        full q (checkpoint)   [ r0 rows | r1 rows ]     rank 1 holds q[start:start+size] | k[..] | v[..]
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        shard_starts: dict[str, int] | None = None,
        full_shard_sizes: dict[str, int] | None = None,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.in_features = in_features
        self.shard_sizes = dict(shard_sizes)
        self.shard_starts = dict(shard_starts or dict.fromkeys(shard_sizes, 0))
        self.full_shard_sizes = dict(full_shard_sizes or shard_sizes)
        self.shard_offsets: dict[str, int] = {}
        offset = 0
        for name, size in self.shard_sizes.items():
            self.shard_offsets[name] = offset
            offset += size
        self.out_features = offset
        self.quant_method.create_weights(self, in_features, self.out_features, self.weight_loader)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None) -> None:
        """Copy one checkpoint tensor (a shard's, or with shard_id None a whole fused one) into `param`,
        along the dims its `layout` names (models/quant/layout.py: plain [out, in] by default)."""
        check_dtype(param, loaded)
        layout = layout_of(param)
        if shard_id is None:
            self._load_fused(param, loaded)
            return
        if layout.per_shard:  # one entry per shard (a per-tensor scale, compressed-tensors' weight_shape)
            target = param.data[list(self.shard_sizes).index(shard_id)]
            if loaded.numel() != target.numel():
                raise ValueError(
                    f"{tensor_name(loaded)}: expected {target.numel()} value(s) for shard {shard_id!r}; got "
                    f"shape {tuple(loaded.shape)}"
                )
            target.copy_(as_tensor(loaded).reshape(target.shape))
            return
        d = layout.out_dim
        if d is None or d >= param.dim():  # no output dim (act-order g_idx): every shard holds the same
            self._load_shared(param, loaded, shard_id)
            return
        pack, full, size = layout.out_pack, self.full_shard_sizes[shard_id], self.shard_sizes[shard_id]
        what = f"{tensor_name(loaded)} (shard {shard_id!r})"
        first, count = packed_region(self.shard_offsets[shard_id], size, pack, self.out_features, what)
        if full != size and loaded.shape[d] == entries(full, pack):  # the whole shard: this rank's rows
            start, length = packed_region(self.shard_starts[shard_id], size, pack, full, what)
            loaded = loaded.narrow(d, start, length)
        target = param.data.narrow(d, first, count)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: checkpoint {tuple(loaded.shape)}, "
                f"model expects {tuple(target.shape)}"
            )
        target.copy_(as_tensor(loaded))

    def _load_fused(self, param: nn.Parameter, loaded: TensorLike) -> None:
        """A checkpoint tensor already holding every shard (saved fused): under tp, each shard's rows."""
        d = layout_of(param).out_dim or 0
        if self.full_shard_sizes != self.shard_sizes and loaded.shape[d] == sum(
            self.full_shard_sizes.values()
        ):
            full_offset = 0
            for name in self.shard_sizes:
                self.weight_loader(param, loaded.narrow(d, full_offset, self.full_shard_sizes[name]), name)
                full_offset += self.full_shard_sizes[name]
            return
        if param.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for shard None: checkpoint {tuple(loaded.shape)}, "
                f"model expects {tuple(param.shape)}"
            )
        param.data.copy_(as_tensor(loaded))

    def _load_shared(self, param: nn.Parameter, loaded: TensorLike, shard_id: str) -> None:
        """A tensor every shard supplies alike (the shards share their input, hence GPTQ's act order):
        the first is kept, the others must equal it."""
        tensor = as_tensor(loaded)
        seen: set[str] = param.__dict__.setdefault("shards_loaded", set())
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint {tuple(tensor.shape)}, "
                             f"model expects {tuple(param.shape)}")  # fmt: skip
        if seen and not torch.equal(param.data, tensor.to(param.dtype)):
            raise ValueError(
                f"{tensor_name(loaded)} differs between the fused shards {', '.join(self.shard_sizes)}: they "
                "read the same input, so longserve needs them equal (as vLLM assumes)"
            )
        param.data.copy_(tensor)
        seen.add(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # [T, out_features]

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gate|up layer's silu(gate) * up [T, I] in its product's own kernel where its method has one, else
        None (LinearMethod.apply_swiglu)."""
        return self.quant_method.apply_swiglu(self, x, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a fused output [T, out_features] back into its shards, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input dim split over the tp ranks: each rank multiplies its slice of x
    [T, in/tp] by its columns of W, the partial sums are all-reduced, and the bias is added once after.
    Same parameter names and (at tp=1) shapes and numerics as nn.Linear."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, quant_method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if in_features % self.tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={self.tp_size}")
        self.in_features = in_features // self.tp_size  # this rank's share
        self.out_features = out_features
        self.quant_method.create_weights(self, self.in_features, out_features, self.weight_loader)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        """This rank's input columns of a checkpoint tensor, along the dim its `layout` names (plain: 1); a
        tensor without an input dim (a per-channel scale, act-order scales) is whole on every rank."""
        check_dtype(param, loaded)
        layout = layout_of(param)
        d, full = layout.in_dim, self.in_features * self.tp_size
        if (
            self.tp_size > 1
            and d is not None
            and d < loaded.dim()
            and loaded.shape[d] == entries(full, layout.in_pack)
        ):
            start, length = packed_region(
                self.tp_rank * self.in_features, self.in_features, layout.in_pack, full, tensor_name(loaded)
            )
            loaded = loaded.narrow(d, start, length)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """x [T, in] -> [T, out]; gated: x is gate|up [T, 2 * in] and the input silu(gate) * up (the MLP's down
        projection, which a quantized method may make in its own pass: LinearMethod.apply_gated)."""
        if self.tp_size == 1:
            return self._apply(x, self.bias, gated)  # [T, out]
        return self.finish(tp_all_reduce(self.partial(x, gated)))  # [T, out] partial sums -> full

    def partial(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """This rank's partial sum [T, out] (at tp=1 the whole product), before the all-reduce and bias."""
        return self._apply(x, None, gated)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
        if not gated:
            return self.quant_method.apply(self, x, bias)
        y = self.quant_method.apply_gated(self, x, bias)
        return y if y is not None else self.quant_method.apply(self, silu_and_mul(x), bias)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The all-reduced partial sums plus the bias (added once, after the reduction)."""
        return y if self.bias is None else y + self.bias

    def then_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm(self(x, gated), residual)`: the product added into the residual stream and RMS-normed ([T, out]
        each), by the product's own kernel where its method can (LinearMethod.apply_then_norm: one row; tensor
        parallelism off, whose all-reduce comes between), else by the norm's launch after it. A zero-centered norm
        always takes its own launch: the products' epilogues (gluon_gemv.norm_row) scale as Llama's does."""
        if self.tp_size == 1 and not norm.zero_centered:
            got = self.quant_method.apply_then_norm(
                self, x, self.bias, residual, norm.weight, norm.eps, gated
            )
            if got is not None:
                return got
        return norm(self(x, gated), residual)  # type: ignore[return-value]


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab split over the tp ranks: rank r holds rows [r*Vp, (r+1)*Vp), Vp =
    ceil(V / tp) (rows past V are zero padding). A token outside the rank's range looks up zero, and the
    all-reduce sums the one real row. The same weight serves a tied LM head (`ParallelLMHead` layout)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        check_dtype(param, loaded)
        if self.tp_size == 1:
            default_weight_loader(param, loaded)
            return
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded.shape)}, model expects "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        rows = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        param.data.zero_()
        if rows:  # a last rank may hold only padding (start past the vocab: nothing to read)
            param.data[:rows].copy_(as_tensor(loaded.narrow(0, self.vocab_start, rows)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [T, H]
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.rows_per_rank)  # [T]
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        return tp_all_reduce(hidden)  # [T, H]


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight [V, H], vocab-split like `VocabParallelEmbedding`; see `parallel_logits`."""


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """hidden [N, H] @ this rank's vocab rows [Vp, H]^T, all-gathered -> [N, V] float32 on every rank."""
    logits = F.linear(hidden, weight).float()  # [N, Vp]
    if get_tp_size() == 1:
        return logits  # [N, V]
    return tp_all_gather(logits, dim=-1)[:, :vocab_size]  # [N, V]


def tp_shard_range(total: int, tp_size: int, tp_rank: int, what: str) -> tuple[int, int]:
    """(start, size) of this rank's equal share of `total` items; raise when tp_size does not divide it."""
    if total % tp_size:
        raise ValueError(f"{what}={total} is not divisible by tp_size={tp_size}")
    size = total // tp_size
    return tp_rank * size, size


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] -> silu(gate) * up [T, I]; the Triton kernel on CUDA, else the reference."""
    if use_triton(x):
        from longserve.kernels.activation import silu_and_mul as silu_and_mul_triton  # imports triton

        return silu_and_mul_triton(x)  # [T, I]
    return silu_and_mul_ref(x)  # [T, I]


def default_weight_loader(param: nn.Parameter, loaded: TensorLike) -> None:
    """Copy a whole tensor (a one-value tensor into a one-value parameter whatever their shapes: per-tensor
    scales are saved as [] or [1]); refuses a dtype that does not fit (layout.check_dtype)."""
    check_dtype(param, loaded)
    reshape = param.numel() == loaded.numel() and (param.numel() == 1 or layout_of(param).per_shard)
    if param.shape != loaded.shape and not reshape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)}, model {tuple(param.shape)}")
    param.data.copy_(as_tensor(loaded).reshape(param.shape))
