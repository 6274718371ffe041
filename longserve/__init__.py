"""longserve: an LLM serving engine for long prompts. `from longserve import LLM, SamplingParams`."""

from __future__ import annotations

from longserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "__version__"]


def __getattr__(name: str):
    # torch-heavy pieces load on first use, so `import longserve` stays cheap (CLI --help, server start-up)
    if name == "LLM":
        from longserve.llm import LLM

        return LLM
    if name == "EngineConfig":
        from longserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'longserve' has no attribute {name!r}")
