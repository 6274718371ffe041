"""Files that ship inside the longserve package.

`default_model/` is a tiny Llama in HF format (config.json, model.safetensors, tokenizer with a ChatML
chat template, generation_config.json) that `longserve serve` serves when no model is given. It is built
by `scripts/dev/train_default_model.py` from the docstrings of Python's standard library.
"""

from __future__ import annotations

import os

__all__ = ["default_model_path"]


def default_model_path() -> str:
    """The directory of the embedded default model (a plain directory inside the installed package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"the default model is missing from {path}; rebuild it with scripts/dev/train_default_model.py "
            "or pass a model directory"
        )
    return path
