"""Pooling models: decoder embedding models (Qwen3-Embedding, gte-Qwen2, e5-mistral) and causal rerankers
(Qwen3-Reranker), served on the same decoder as generation.

`resolve_pooler` decides from the engine settings (`runner`, `convert`: vLLM's flags) and the checkpoint
whether a model pools and how (a `PoolerSpec`, the same on every tensor-parallel rank):

  * embed: the final hidden state (after the last norm) of the prompt's last token; normalized by the
    caller. A sentence-transformers checkpoint (modules.json with a Pooling module) is an embedding model
    and says how it pools; only last-token pooling is served (mean/CLS pooling would need the hidden state
    of every prompt token, which a cached prefix does not have).
  * classify: one relevance logit at the last token. A converted reranker carries a `score.weight` head
    ([1, hidden], architecture *ForSequenceClassification); an original causal one (Qwen3-Reranker) is read
    the way vLLM serves it, with `classifier_from_token: ["no", "yes"]` (hf_overrides): the logit is
    logit(yes) - logit(no), whose sigmoid is softmax([no, yes])[yes], the model card's score.

`pooling_model_class` wraps the architecture's CausalLM: an embedding model needs no LM head (its checkpoint
often has none, and may store the decoder's tensors without the `model.` prefix), a score head is one more
parameter, and `pool(rows)` turns the last positions' hidden states into what the runner returns.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longserve.config import CONVERTS, RUNNERS
from longserve.distributed import get_tp_size
from longserve.models.registry import get_model_class

logger = logging.getLogger("longserve.models.pooler")

_CLASSIFY_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class PoolerSpec:
    task: str  # "embed" | "classify"
    base_architecture: str  # the CausalLM class that runs the decoder
    # classify: the logit comes from these vocabulary tokens' LM-head rows (1: that logit; 2: second - first)
    classifier_tokens: tuple[str, ...] = ()
    score_head: bool = False  # classify: a checkpoint `score.weight` [1, hidden]
    normalize: bool = True  # embed: L2-normalize by default (sentence-transformers' Normalize module)
    # embed: Matryoshka truncation; True: any size, a tuple: those sizes only, (): not allowed
    matryoshka: bool | tuple[int, ...] = False

    @property
    def uses_lm_head(self) -> bool:
        return self.task == "classify" and not self.score_head


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> Any:
    """Set vLLM-style `--hf-overrides` keys on the HF config (in place; returns it)."""
    for key, value in (overrides or {}).items():
        setattr(hf_config, key, value)
    return hf_config


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(model_dir: str) -> tuple[str, bool] | None:
    """(pooling mode, normalize) of a sentence-transformers checkpoint, None if it is not one."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    pooling_mode, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            cfg = _read_json(os.path.join(model_dir, str(module.get("path", "")), "config.json")) or {}
            if cfg.get("pooling_mode_lasttoken"):
                pooling_mode = "last"
            elif cfg.get("pooling_mode_cls_token"):
                pooling_mode = "cls"
            elif cfg.get("pooling_mode_mean_tokens"):
                pooling_mode = "mean"
            else:
                pooling_mode = str(cfg.get("pooling_mode", "unknown"))
        elif kind.endswith("Normalize"):
            normalize = True
    return (pooling_mode, normalize) if pooling_mode is not None else None


def _base_architecture(arch: str) -> str:
    """The generative class whose decoder a pooling architecture uses: Qwen3ForSequenceClassification,
    Qwen3Model -> Qwen3ForCausalLM."""
    if arch.endswith(_CLASSIFY_SUFFIX):
        return arch[: -len(_CLASSIFY_SUFFIX)] + "ForCausalLM"
    if arch.endswith("Model") and not arch.endswith("ForCausalLM"):
        return arch[: -len("Model")] + "ForCausalLM"
    return arch


def resolve_pooler(runner: str, convert: str, hf_config: Any, model_dir: str) -> PoolerSpec | None:
    """How the model pools, or None for a generative model (see the module docstring). ValueError for a
    combination that cannot be served, naming what to change."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}; got {convert!r}")
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else ""
    st = sentence_transformers_pooling(model_dir)
    classify_arch = arch.endswith(_CLASSIFY_SUFFIX) or bool(getattr(hf_config, "classifier_from_token", None))
    embed_arch = st is not None or (arch.endswith("Model") and not classify_arch)
    asked = convert in ("embed", "classify")  # --convert/--task embed or classify: a pooling model
    if runner == "generate":
        if asked:
            raise ValueError(f"convert={convert!r} needs runner='pooling' (it makes a pooling model)")
        return None
    if runner == "auto" and (convert == "none" or not (asked or classify_arch or embed_arch)):
        return None  # --task generate, or a checkpoint that does not say it pools
    if convert == "none":
        raise ValueError("runner='pooling' needs a pooling model: convert='embed' or 'classify' (or 'auto')")
    task = convert if convert in ("embed", "classify") else ("classify" if classify_arch else "embed")
    base = _base_architecture(arch)
    if task == "embed":
        mode, normalize = st if st is not None else ("last", True)
        if mode != "last":
            raise ValueError(
                f"the checkpoint pools with {mode!r} pooling (its sentence-transformers Pooling module); "
                "longserve serves last-token pooling only (a cached prefix has no hidden states to average)"
            )
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        matryoshka: bool | tuple[int, ...] = (
            tuple(int(d) for d in dims) if dims else bool(getattr(hf_config, "is_matryoshka", False))
        )
        return PoolerSpec("embed", base, normalize=normalize, matryoshka=matryoshka)
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens:
        tokens = (tokens,) if isinstance(tokens, str) else tuple(str(t) for t in tokens)
        if len(tokens) not in (1, 2):
            raise ValueError(f"classifier_from_token must name 1 or 2 tokens; got {list(tokens)}")
        return PoolerSpec("classify", base, classifier_tokens=tokens)
    num_labels = int(getattr(hf_config, "num_labels", 1) or 1)
    if arch.endswith(_CLASSIFY_SUFFIX) and num_labels == 1:
        return PoolerSpec("classify", base, score_head=True)
    raise ValueError(
        "a classify (rerank) model needs a one-label score head (architecture *ForSequenceClassification "
        'with score.weight) or the LM-head tokens to score with, e.g. --hf-overrides \'{"architectures": '
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}\' for Qwen3-Reranker'
    )


def classifier_token_ids(tokenizer: Any, tokens: tuple[str, ...]) -> list[int]:
    """Vocabulary ids of the classifier tokens (as vLLM: the token itself, else its one-token encoding)."""
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"classifier token {token!r} is not one token of the model's vocabulary")
            tid = encoded[0]
        ids.append(int(tid))
    return ids


def pooling_model_class(spec: PoolerSpec) -> type[nn.Module]:
    """The architecture's CausalLM as a pooling model (see the module docstring)."""
    base = get_model_class([spec.base_architecture])

    class PoolingModel(base):  # type: ignore[misc, valid-type]
        pooler_spec = spec

        def __init__(self, hf_config: Any) -> None:
            super().__init__(hf_config)
            # vocab ids of spec.classifier_tokens, set on rank 0 once the tokenizer is known
            self.classifier_ids: list[int] | None = None
            if not spec.uses_lm_head and hasattr(self, "lm_head"):
                del self.lm_head  # an embedding checkpoint often has none; nothing reads it
            if spec.score_head:
                self.score = nn.Linear(self.hidden_size, 1, bias=False)

        def load_weights(self, weights) -> None:
            super().load_weights(self._checkpoint_names(weights))

        def _checkpoint_names(self, weights):
            for name, tensor in weights:
                if name.startswith("lm_head.") and not hasattr(self, "lm_head"):
                    continue  # an embedding or score-head model: the LM head is not used
                if not name.startswith(("model.", "lm_head.", "score.")):
                    name = "model." + name  # saved from the bare decoder (Qwen3-Embedding's files)
                yield name, tensor

        def pool(self, rows: torch.Tensor) -> torch.Tensor:
            """The last positions' hidden states [N, H] -> [N, H] (embed) or [N, k] logits (classify) in
            float32. Every tensor-parallel rank calls it: the LM-head path all-gathers the vocabulary."""
            if spec.task == "embed":
                return rows.float()
            if spec.score_head:
                return F.linear(rows, self.score.weight).float()  # [N, 1]
            if self.classifier_ids is not None and get_tp_size() == 1:
                return F.linear(rows, self.lm_head_weight[self.classifier_ids]).float()  # [N, k]
            logits = self.compute_logits(rows)  # [N, V]: the rows may live on other ranks
            if self.classifier_ids is None:
                return logits  # a worker rank: rank 0 picks the columns
            return logits[:, self.classifier_ids]

    PoolingModel.__name__ = PoolingModel.__qualname__ = f"{base.__name__}For{spec.task.capitalize()}"
    return PoolingModel


def score_logit(values: torch.Tensor) -> torch.Tensor:
    """[N, k] classifier outputs -> [N] relevance logits: a one-label head or token as is, two tokens
    ["no", "yes"] as logit(yes) - logit(no) (vLLM's from_2_way_softmax)."""
    if values.shape[1] == 2:
        return values[:, 1] - values[:, 0]
    return values[:, 0]
