"""Tokenizer loading (HF tokenizer files in the checkpoint directory) and generation_config eos ids."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("longserve.tokenizer")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str, required: bool = True):
    """A transformers fast tokenizer from a local directory. With required=False a directory with no
    tokenizer files gives None (token-id prompts only)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        if not required:
            logger.warning("no tokenizer files in %s: only token-id prompts can be served", path)
            return None
        raise FileNotFoundError(
            f"no tokenizer in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)} "
            "(pass tokenizer=DIR to load it from elsewhere)"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_generation_eos_ids(model_dir: str) -> list[int]:
    """eos_token_id from generation_config.json (int or list), [] when absent."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _check_chat(tokenizer, messages: list[dict]) -> None:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template; this engine has no tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template: use generate() with a plain prompt instead")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each message needs a 'role' and 'content'; got {m!r}")


def render_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs
) -> str:
    """A conversation rendered with the tokenizer's chat template, as text: `apply_chat_template`'s ids are
    this text's tokens without added specials (transformers tokenizes it with add_special_tokens=False)."""
    _check_chat(tokenizer, messages)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    assert isinstance(text, str), type(text)
    return text


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template."""
    _check_chat(tokenizer, messages)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
