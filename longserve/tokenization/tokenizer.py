"""Tokenizer loading (HF tokenizer files in the checkpoint directory) and generation_config eos ids."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from typing import Any

from longserve.config import ConfigPathError

logger = logging.getLogger("longserve.tokenization")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str, required: bool = True, chat_template: str | None = None):
    """A transformers fast tokenizer from a local directory. With required=False a directory with no
    tokenizer files gives None (token-id prompts only); else ConfigPathError names the `tokenizer` setting.
    `chat_template` (the text of --chat-template) replaces the tokenizer's own for every chat it renders."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        if not required:
            logger.warning("no tokenizer files in %s: only token-id prompts can be served", path)
            return None
        raise ConfigPathError(
            f"no tokenizer in {path!r}: expected one of {', '.join(_TOKENIZER_FILES)} "
            "(pass tokenizer=DIR to load it from elsewhere)",
            "tokenizer",
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


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


@functools.cache
def _template_parameters() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
    return frozenset(named | {"chat_template", "tokenize", "return_dict", "tools", "documents"})


def check_template_variables(variables: dict[str, Any]) -> None:
    """Raise ValueError unless `variables` (a request's chat_template_kwargs) are plain data for the
    template's own variables (e.g. enable_thinking). Arguments of apply_chat_template itself are refused:
    `chat_template` would let a client run a template of its own (transformers renders templates in a
    sandbox, but a client-made loop can still keep the tokenizer threads busy), `tokenize`/`return_dict`
    change the result's type, and `add_generation_prompt` has its own request field."""
    if not isinstance(variables, dict):
        raise ValueError("chat_template_kwargs must be an object of template variables")
    refused = sorted(k for k in variables if k in _template_parameters())
    if refused:
        raise ValueError(
            f"chat_template_kwargs may only set the chat template's own variables; {', '.join(map(repr, refused))} "
            "is an argument of the template call, not a variable"
            + (
                " (use the request's add_generation_prompt field)"
                if "add_generation_prompt" in refused
                else ""
            )
        )
    bad = sorted(
        k for k in variables if not (isinstance(k, str) and k.isidentifier() and not k.startswith("_"))
    )
    if bad:
        raise ValueError(f"chat_template_kwargs keys must be plain variable names; got {bad[:5]}")

    def plain(value: Any, depth: int = 0) -> bool:
        if depth > 16:
            return False
        if value is None or isinstance(value, (str, int, float, bool)):
            return True
        if isinstance(value, list):
            return all(plain(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v, depth + 1) for k, v in value.items())
        return False

    not_plain = sorted(k for k, v in variables.items() if not plain(v))
    if not_plain:
        raise ValueError(f"chat_template_kwargs values must be plain JSON data; not so for {not_plain[:5]}")


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
