"""Tiny pooling checkpoints for tests, in the layouts real ones ship (testing/checkpoints.py's tiny Qwen3):

* `make_tiny_embedding_checkpoint`: Qwen3-Embedding's layout: config.json says Qwen3ForCausalLM, the
  weights are the bare decoder's (no `model.` prefix, no LM head), and sentence-transformers files
  (modules.json, a last-token Pooling module, Normalize) mark it an embedding model.
* `make_tiny_score_head_checkpoint`: a converted reranker (transformers' Qwen3ForSequenceClassification,
  one label: `score.weight`), as vLLM's convert_model_to_seq_cls writes Qwen3-Reranker.
* the original causal reranker is the plain tiny Qwen3 checkpoint served with `RERANKER_OVERRIDES`, vLLM's
  --hf-overrides for Qwen3-Reranker with the tiny vocabulary's "no"/"yes" tokens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from longserve.testing.checkpoints import make_tiny_checkpoint

# the tiny BPE vocabulary has " no"/" yes" (Ġno, Ġyes) as single tokens, not "no"/"yes"
RERANKER_OVERRIDES: dict[str, Any] = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["Ġno", "Ġyes"],
    "is_original_qwen3_reranker": True,
}


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def make_tiny_embedding_checkpoint(path: str | os.PathLike, matryoshka: bool = True, seed: int = 0) -> str:
    """A tiny Qwen3-Embedding-style checkpoint (see the module docstring); `matryoshka` marks it
    `is_matryoshka` in config.json (vLLM's flag for models trained to be truncated)."""
    import transformers

    path = make_tiny_checkpoint(path, "qwen3", seed=seed)
    causal = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(path, name))
    causal.model.save_pretrained(path)  # the bare decoder: embed_tokens.weight, layers.0..., norm.weight
    config = transformers.AutoConfig.from_pretrained(path)
    config.architectures = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    if matryoshka:
        config.is_matryoshka = True
    config.save_pretrained(path)
    _write_json(
        os.path.join(path, "modules.json"),
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    _write_json(
        os.path.join(path, "1_Pooling", "config.json"),
        {"word_embedding_dimension": config.hidden_size, "pooling_mode_lasttoken": True},
    )
    return str(path)


def make_tiny_score_head_checkpoint(path: str | os.PathLike, seed: int = 0) -> str:
    """A tiny converted reranker: transformers' Qwen3ForSequenceClassification with one label."""
    import transformers

    path = make_tiny_checkpoint(path, "qwen3", seed=seed)
    config = transformers.AutoConfig.from_pretrained(path)
    config.num_labels = 1
    config.pad_token_id = 1  # transformers' classifier finds each row's last token through the pad id
    torch.manual_seed(seed + 1)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    for name in os.listdir(path):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(path, name))
    model.save_pretrained(path)
    return str(path)
