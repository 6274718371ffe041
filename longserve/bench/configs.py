"""Built-in model shapes for benchmarks with dummy weights (HF config.json dicts)."""

from __future__ import annotations

from typing import Any

_LLAMA31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}
_QWEN25_32B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],  # Qwen2 always has q/k/v bias
    "model_type": "qwen2",
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}
_TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.2,
    "torch_dtype": "float32",
}
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA31_8B,
    "qwen2.5-32b": _QWEN25_32B,
    "tiny": _TINY,
}
