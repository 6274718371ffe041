"""Checkpoint loading: HF config, dtype resolution, and building a model with safetensors or dummy weights.

The model is constructed directly on the target device and dtype (no CPU staging copy), then filled tensor
by tensor from the safetensors files, so peak memory is about one model plus one tensor.
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
from typing import Any

import torch
from torch import nn

from longserve.models.layers import RMSNorm
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
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


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
) -> nn.Module:
    """Build the model for `hf_config.architectures` on `device` in `dtype` and fill its weights.

    load_format 'auto'/'safetensors' reads the checkpoint in `model_dir`; 'dummy' draws random weights
    (normal, std=initializer_range; norms = 1) from a generator seeded with `seed`, reading no files.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format {load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}"
        )
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    device = torch.device(device)
    files = [] if load_format == "dummy" else safetensors_files(model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config)
    if load_format == "dummy":
        init_dummy_weights(model, std=getattr(hf_config, "initializer_range", 0.02), seed=seed)
    else:
        model.load_weights(iterate_safetensors(files, device))
    model.eval()
    model.requires_grad_(False)
    return model


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


def iterate_safetensors(files: list[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time; tensors are opened on `device` when it is a GPU."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    open_device = str(device) if device.type == "cuda" else "cpu"
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(list(f.keys()))
    start, num_bytes = time.perf_counter(), 0
    with tqdm(
        total=total, desc="Loading weights", unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty()
    ) as bar:
        for i, path in enumerate(files):
            if bar.disable:  # no terminal (a log file): one line per shard instead of the bar
                logger.info("Loading weights: shard %d/%d %s", i + 1, len(files), os.path.basename(path))
            with safe_open(path, framework="pt", device=open_device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = f.get_tensor(name)
                    num_bytes += tensor.numel() * tensor.element_size()
                    yield name, tensor
                    bar.update(1)
    logger.info(
        "Loaded %d tensors (%.2f GB) from %d file(s) in %.2f s",
        total,
        num_bytes / 1e9,
        len(files),
        time.perf_counter() - start,
    )


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    """Random weights, deterministic per seed and device: normal(0, std) everywhere, RMSNorm weights = 1."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    params = list(model.named_parameters())
    generator = torch.Generator(device=params[0][1].device if params else "cpu").manual_seed(seed)
    for _, param in params:
        if id(param) in norm_params:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
