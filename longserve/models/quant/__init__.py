"""Quantized weight formats: read from config.json's `quantization_config` (or `--quantization`),
each a LinearMethod and an MoEMethod.

    layout.py   where a parameter's checkpoint tensor keeps its output and input features (TP slicing)
    config.py   the formats' configs: parsed and checked before any weight is read; per-module decisions
    wna16.py    integer weights, float activations (GPTQ, AWQ, compressed-tensors pack-quantized)
    fp8.py      FP8 weights: block (the `fp8` format), per-channel/tensor (compressed-tensors), online
    int8.py     INT8 W8A8 (compressed-tensors int-quantized)
    bind.py     gives each layer of a built model its method, by the layer's checkpoint name
    dummy.py    random weights in a format (`--load-format dummy`)

Kept free of imports so that layers.py can use layout.py without loading the formats.
"""
