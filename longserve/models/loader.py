"""Checkpoint loading: HF config, dtype resolution, and building a model with safetensors or dummy weights.

The model is constructed directly on the target device and dtype (no CPU staging copy), then filled tensor
by tensor from the safetensors files, so peak memory is about one model plus one tensor. Checkpoint tensors
are handed to the weight loaders lazily (`CheckpointSlice`): a tensor-parallel rank narrows each to its own
rows/columns and reads only those bytes from the file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longserve.models.dummy_weights import init_dummy_weights
from longserve.models.linear_method import LINEAR_METHODS, stack_inputs
from longserve.models.pooler import PoolerSpec, pooling_model_class
from longserve.models.quant.bind import bind_quant_methods
from longserve.models.quant.config import parse_quant_format
from longserve.models.quantization import process_weights_after_loading, quantization_method
from longserve.models.registry import get_model_class

logger = logging.getLogger("longserve.models.loader")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(model_dir: str) -> Any:
    """Parse `model_dir/config.json` with transformers' AutoConfig (local files only)."""
    from transformers import AutoConfig

    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{config_path} not found; a checkpoint directory must contain config.json and the weights "
            "as *.safetensors (plus model.safetensors.index.json when sharded)"
        )
    return text_part(AutoConfig.from_pretrained(model_dir, local_files_only=True))


# vision-language checkpoints whose text model longserve serves (text in, text out): their `text_config` stands
# for the whole, with the top level's architectures, quantization and dtype
_TEXT_OF_VL = ("qwen3_5", "qwen3_5_moe")


def text_part(config: Any) -> Any:
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "model_type", None) not in _TEXT_OF_VL:
        return config
    text.architectures = list(getattr(config, "architectures", None) or [])
    for key in ("quantization_config", "tie_word_embeddings"):
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    return text


def resolve_dtype(dtype: str, hf_config: Any) -> torch.dtype:
    """'auto' -> the config's dtype (float32 when absent); else one of float32, float16, bfloat16."""
    if dtype == "auto":
        value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if value is None:
            return torch.float32
        if isinstance(value, torch.dtype):
            return value
        dtype = str(value).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    stats: LoadStats | None = None,
    pooler: PoolerSpec | None = None,
) -> nn.Module:
    """Build the model for `hf_config.architectures` on `device` in `dtype` and fill its weights; with
    `pooler`, as that pooling model (models/pooler.py: an embedding model or a reranker).

    load_format 'auto'/'safetensors' reads the checkpoint in `model_dir`; 'dummy' draws random weights
    (normal, std=initializer_range; norms = 1) from a generator seeded with `seed`, reading no files.
    Under tensor parallelism each rank reads only its own slices of the checkpoint tensors; `stats`
    (optional) receives how many bytes were read.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}"
        )
    if pooler is not None:
        model_cls = pooling_model_class(pooler)
    else:
        model_cls = get_model_class(getattr(hf_config, "architectures", None))
    device = torch.device(device)
    # the weight format, checked in full before anything is read (models/quant/config.py)
    quant = None if quantization_method(hf_config) in LINEAR_METHODS else parse_quant_format(hf_config)
    files = [] if load_format == "dummy" else safetensors_files(model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config)
        # each quantized layer's method, by its checkpoint name (and the companions the files hold)
        methods = bind_quant_methods(model, quant, tensors=tensor_names(files) if quant and files else None)
    if methods:
        logger.info(
            "quantized (%s) layers: %s",
            quant.name,
            ", ".join(f"{n} x{c}" for n, c in sorted(methods.items())),
        )
    if load_format == "dummy":
        init_dummy_weights(model, std=getattr(hf_config, "initializer_range", 0.02), seed=seed)
    else:
        weights = iterate_safetensors(files, device, stats)
        model.load_weights(_without_absent_biases(model, weights) if quant is not None else weights)
    process_weights_after_loading(model)
    stack_inputs(model)
    if quant is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # the checkpoint layouts' tensors, repacked: free for the KV pool's sizing
    model.eval()
    model.requires_grad_(False)
    return model


def _without_absent_biases(model: nn.Module, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Quantized checkpoints (AutoGPTQ's among them) may save a zero bias for every projection, also for
    layers that have none: such a bias is skipped (as vLLM does); a nonzero one is an error."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name.endswith(".bias") and model.map_weight_name(name)[0] not in params:
            if bool(tensor.materialize().any()):
                raise ValueError(f"checkpoint tensor {name!r} is a nonzero bias of a layer that has none")
            continue
        yield name, tensor


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a checkpoint: those named by the shard index if present, else all *.safetensors."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"shard {missing[0]} named by {index_path} does not exist"
                + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
            )
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors found in {model_dir}; a checkpoint directory must contain config.json and "
            "safetensors weights (use load_format='dummy' for random weights)"
        )
    return files


_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        name: getattr(torch, attr)
        for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
        if hasattr(torch, attr)
    },
}


def tensor_names(files: list[str]) -> set[str]:
    """Every tensor name of the checkpoint files (their headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


@dataclass
class LoadStats:
    """What a load read: `bytes_read` counts only the regions materialized (a tp rank's slices), while
    `bytes_total` is the size of every tensor in the checkpoint files."""

    num_tensors: int = 0
    num_files: int = 0
    bytes_read: int = 0
    bytes_total: int = 0
    seconds: float = 0.0


class CheckpointSlice:
    """A checkpoint tensor not read yet: `.shape`/`.dtype` come from the file header, `.narrow()` returns
    another lazy view (composable over dims, like torch's), and `materialize()` reads only the selected
    region from the file onto `device`, adding its bytes to `stats.bytes_read`.

    Valid only while its safetensors file is open, i.e. while `iterate_safetensors` has not moved on to
    the next item: consume (materialize) it before advancing the iterator.
    """

    def __init__(
        self,
        safe_slice: Any,
        device: torch.device,
        stats: LoadStats,
        region: tuple[tuple[int, int], ...] | None = None,
        name: str | None = None,
    ) -> None:
        self.name = name  # the checkpoint's tensor name, for loaders' messages
        self._slice = safe_slice
        self._full_shape = tuple(int(n) for n in safe_slice.get_shape())
        self._region = region if region is not None else tuple((0, n) for n in self._full_shape)
        self.shape = torch.Size(length for _, length in self._region)
        self.dtype: torch.dtype | None = _ST_DTYPES.get(safe_slice.get_dtype())
        self.device = device
        self.stats = stats

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        """The lazy view of rows [start, start + length) along `dim` (of this view); nothing is read."""
        ndim = len(self.shape)
        if not -ndim <= dim < ndim:
            raise IndexError(
                f"narrow: dim {dim} out of range for a {ndim}-d tensor of shape {tuple(self.shape)}"
            )
        dim %= ndim
        size = self.shape[dim]
        if start < 0:
            start += size
        if start < 0 or length < 0 or start + length > size:
            raise IndexError(f"narrow: start ({start}) + length ({length}) exceeds dimension size ({size})")
        region = list(self._region)
        base = region[dim][0]
        region[dim] = (base + start, length)
        return CheckpointSlice(self._slice, self.device, self.stats, tuple(region), self.name)

    def materialize(self) -> torch.Tensor:
        """Read the selected region (and only it) from the file, as a tensor on `self.device`."""
        if not self._region:
            tensor = self._slice[...]  # a 0-d tensor
        else:
            tensor = self._slice[tuple(slice(start, start + length) for start, length in self._region)]
        if tensor.shape != self.shape:  # never expected: a guard against a slicing misread
            raise RuntimeError(
                f"read {tuple(tensor.shape)} from the checkpoint, expected {tuple(self.shape)}"
            )
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(self.device)

    to_tensor = materialize

    def __repr__(self) -> str:
        return (
            f"CheckpointSlice(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"region={self._region}, full_shape={self._full_shape})"
        )


def iterate_safetensors(
    files: list[str], device: torch.device, stats: LoadStats | None = None
) -> Iterator[tuple[str, CheckpointSlice]]:
    """Yield (name, lazy tensor) one at a time; the consumer narrows each to what it needs and materializes
    only that (a tp rank reads its slices, not whole tensors). `stats` (optional) receives the byte counts."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    stats = stats if stats is not None else LoadStats()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = f.get_slice(name)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                itemsize = dtype.itemsize if dtype is not None else 0
                stats.bytes_total += torch.Size(sl.get_shape()).numel() * itemsize
                stats.num_tensors += 1
    stats.num_files = len(files)
    start = time.perf_counter()
    with tqdm(
        total=stats.num_tensors,
        desc="Loading weights",
        unit="tensor",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
    ) as bar:
        for i, path in enumerate(files):
            if bar.disable:  # no terminal (a log file): one line per shard instead of the bar
                logger.info("Loading weights: shard %d/%d %s", i + 1, len(files), os.path.basename(path))
            # read on the CPU (only the selected bytes), then moved to `device` by materialize()
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, CheckpointSlice(f.get_slice(name), device, stats, name=name)
                    bar.update(1)
    stats.seconds = time.perf_counter() - start
    logger.info(
        "Loaded %d tensors (%.2f GB read of %.2f GB) from %d file(s) in %.2f s",
        stats.num_tensors,
        stats.bytes_read / 1e9,
        stats.bytes_total / 1e9,
        len(files),
        stats.seconds,
    )
