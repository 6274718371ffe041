"""Tiny random HF checkpoints (config, safetensors, tokenizer, generation config) for tests and dev scripts.

`make_tiny_checkpoint` writes a directory that both transformers and longserve load. Weights use a large
initializer_range so logits are peaky and greedy decoding is stable across implementations; the special
tokens' embedding/lm_head rows are shrunk so greedy decoding never picks them (no accidental EOS).
With `tokenizer=` it writes that tokenizer instead (e.g. one carrying a real model's chat template, with its
tool-call markup as added tokens) and sizes the model's vocab to it, padded as real lm_heads are.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch

VOCAB_SIZE = 512
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0, 1, 2, 3
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
ARCHS = ("llama", "llama31", "mistral", "qwen2", "qwen3")
# mixtures of experts, with shapes unlike the real ones: expert intermediate sizes that are not multiples of
# 64, 8 experts top-3 with a dense layer between sparse ones (Qwen3-MoE), a shared expert and sparse every
# other layer (Qwen2-MoE), 6 experts top-2 with a sliding window (Mixtral)
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
# hybrid linear/full attention (Qwen3.5): the MoE one as the released checkpoints are, a vision-language wrapper
# (`model.language_model.*`, a tiny vision tower beside it), the dense one as its text model alone (`model.*`);
# linear and full attention layers alternate, so that the second full layer is KV layer 1
HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe")
# Qwen3-Next: the same layers, its linear layers' projections fused per key head in the checkpoint (models/qwen3_next.py)
QWEN3_NEXT = "qwen3_next"
EXPERT_LAYOUTS = ("per_expert", "stacked")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = """
The quick brown fox jumps over the lazy dog. A serving engine reads a long prompt, splits it into pages,
and keeps the keys and values of every token in a cache so that the next request with the same prefix
does not compute them again. Time to first token is what a user feels when a chat answer begins to appear.
In the morning the river was quiet and the boats waited by the old stone bridge. Children walked to school
along the water, counting ducks and talking about the weather, the market, and the music from the square.
Numbers such as 1, 2, 3, 42, 100 and 2024 appear in tables; dates like March 7 and names like Alice, Bob,
Carol and Dave appear in stories. Questions end with a question mark? Answers often start with yes or no.
The library opened at nine. Readers borrowed books about history, science, cooking, gardening and travel.
A good cache evicts the least recently used pages first, and a scheduler mixes short decodes with long
prefill chunks under a token budget, so one huge document never blocks everyone else from streaming.
Weather reports said rain would arrive by evening, with strong wind from the west and cold air at night.
She wrote a letter to her brother, who lived far away in a small town near the mountains and the sea.
"""


@functools.cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, IM_START_ID, IM_END_ID]
    # like Llama 3: encode() prepends <|begin_of_text|>
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok.to_str()


def _make_config(arch: str, tie: bool, num_layers: int) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=16)
    if arch == "llama31":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**common, head_dim=16, rope_parameters=rope)
    if arch == "mistral":
        return transformers.MistralConfig(**common, head_dim=16, sliding_window=8)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **{**common, "intermediate_size": 96}, head_dim=32, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1],
        )  # fmt: skip
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **{**common, "intermediate_size": 96}, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=36, shared_expert_intermediate_size=80, decoder_sparse_step=2,
        )  # fmt: skip
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": 40}, head_dim=16, num_local_experts=6, num_experts_per_tok=2,
            sliding_window=8,
        )  # fmt: skip
    if arch in HYBRID_ARCHS or arch == QWEN3_NEXT:
        return _hybrid_config(arch, common, num_layers)
    raise ValueError(
        f"unknown tiny arch {arch!r}; choose one of {', '.join(ARCHS + MOE_ARCHS + HYBRID_ARCHS)}"
    )


def _hybrid_config(arch: str, common: dict[str, Any], num_layers: int) -> Any:
    import transformers

    text = dict(
        common,
        head_dim=32,
        layer_types=["linear_attention", "full_attention"] * (num_layers // 2) + ["linear_attention"] * (num_layers % 2),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        # a quarter of each head rotates, as in the released models; text positions make mrope plain rope
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1]},
    )  # fmt: skip
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**text)
    text.update(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=48
    )
    if arch == QWEN3_NEXT:  # its rope has no mrope section; a dense layer among the sparse ones
        text["rope_parameters"].pop("mrope_section")
        return transformers.Qwen3NextConfig(**text, mlp_only_layers=[2], norm_topk_prob=True)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=common["hidden_size"],
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
    tie = text.pop("tie_word_embeddings")
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)


# layers of the MoE archs by default: a dense layer between two sparse ones (Qwen3-MoE), two sparse layers
# at decoder_sparse_step 2 (Qwen2-MoE)
_MOE_LAYERS = {"qwen3_moe": 3, "qwen2_moe": 4, "mixtral": 2, "qwen3_5": 4, "qwen3_5_moe": 4, "qwen3_next": 4}


def _save_stacked(model: Any, path: str | os.PathLike) -> None:
    """The weights as transformers 5 holds them in memory (experts as stacked 3D tensors `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I]), where save_pretrained writes one 2D tensor per expert."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # save_pretrained would set it
    model.config.save_pretrained(path)


def make_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    seed: int = 0,
    num_layers: int | None = None,
    expert_layout: str = "per_expert",
    tokenizer: Any = None,
    eos_tokens: list[str] | None = None,
    max_position_embeddings: int | None = None,
) -> str:
    """Write a tiny random checkpoint of `arch` (ARCHS or MOE_ARCHS) into `path` and return str(path).

    expert_layout (MoE archs): "per_expert", what transformers 5's save_pretrained writes (one 2D tensor per
    expert and projection, Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`), or "stacked", the 3D tensors
    transformers 5 holds in memory (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).

    tokenizer: a transformers tokenizer to write instead of the built-in one (its chat template too); the
    model's vocab is its length rounded up to a multiple of 64, and the rows of its added tokens and of the
    padding are shrunk as the special tokens' are. eos_tokens: generation_config's eos tokens (the first
    is config.json's eos_token_id); default the tokenizer's eos token. max_position_embeddings: the context the
    config declares (default 512)."""
    import transformers
    from tokenizers import Tokenizer

    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout {expert_layout!r}: choose one of {', '.join(EXPERT_LAYOUTS)}")
    if num_layers is None:
        num_layers = _MOE_LAYERS.get(arch, 2)
    config = _make_config(arch, tie_word_embeddings, num_layers)
    shrunk: Any = slice(0, len(SPECIAL_TOKENS))
    eos: int | list[int] = [EOS_ID, IM_END_ID] if arch == "llama31" else EOS_ID
    text_config = getattr(config, "text_config", config)  # a vision-language config's text model
    if tokenizer is not None:
        shrunk, eos = _fit_config_to_tokenizer(text_config, tokenizer, eos_tokens)
    if max_position_embeddings is not None:
        text_config.max_position_embeddings = max_position_embeddings
    torch.manual_seed(seed)
    if getattr(config, "vision_config", None) is not None:  # the whole vision-language model, as released
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # special tokens get tiny logits, so a greedy random model never emits EOS (or BOS, ...) by chance
        for emb in {id(e): e for e in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            emb.weight[shrunk] *= 0.05
    os.makedirs(path, exist_ok=True)
    if expert_layout == "stacked":
        _save_stacked(model, path)
    else:
        model.save_pretrained(path, max_shard_size="100KB" if sharded else "50GB")

    if tokenizer is None:
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token=BOS, eos_token=EOS
        )
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(
            {"bos_token_id": text_config.bos_token_id, "eos_token_id": eos, "do_sample": False}, f, indent=2
        )
    return str(path)


def _fit_config_to_tokenizer(
    config: Any, tokenizer: Any, eos_tokens: list[str] | None
) -> tuple[list[int], Any]:
    """Set `config`'s vocab size and bos/eos ids from a tokenizer of one's own; returns the rows to shrink
    (added tokens and padding) and generation_config's eos_token_id."""
    vocab = -(-len(tokenizer) // 64) * 64
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens or [tokenizer.eos_token]]
    if any(i is None or i == tokenizer.unk_token_id for i in eos_ids):
        raise ValueError(f"eos_tokens {eos_tokens!r} are not all tokens of the tokenizer")
    config.vocab_size = vocab
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, eos_ids[0]
    config.max_position_embeddings = 4096  # a real template's system prompt and tool list run past 512
    shrunk = sorted(tokenizer.added_tokens_decoder) + list(range(len(tokenizer), vocab))
    return shrunk, eos_ids if len(eos_ids) > 1 else eos_ids[0]
