"""Tiny random HF checkpoints (config, safetensors, tokenizer, generation config) for tests and dev scripts.

`make_tiny_checkpoint` writes a directory that both transformers and longserve load. Weights use a large
initializer_range so logits are peaky and greedy decoding is stable across implementations; the special
tokens' embedding/lm_head rows are shrunk so greedy decoding never picks them (no accidental EOS).
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
    raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(ARCHS)}")


def make_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    sharded: bool = False,
    seed: int = 0,
    num_layers: int = 2,
) -> str:
    """Write a tiny random checkpoint of `arch` into `path` and return str(path)."""
    import transformers
    from tokenizers import Tokenizer

    config = _make_config(arch, tie_word_embeddings, num_layers)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # special tokens get tiny logits, so a greedy random model never emits EOS (or BOS, ...) by chance
        for emb in {id(e): e for e in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            emb.weight[: len(SPECIAL_TOKENS)] *= 0.05
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "50GB")

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token=BOS, eos_token=EOS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    eos: int | list[int] = [EOS_ID, IM_END_ID] if arch == "llama31" else EOS_ID
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": eos, "do_sample": False}, f, indent=2)
    return str(path)
