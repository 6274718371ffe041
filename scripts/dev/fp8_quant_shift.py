"""How far FP8 quantization itself moves the first step's logprobs on the GPU engine tests' FP8 checkpoints
(tests/gpu/test_quant_engine_gpu.py's writers and prompts), against their float originals, on the CPU (the torch
reference path): the scale against which a kernel's own deviation from that reference (the tests' 0.1 bound)
reads. Prints per checkpoint the first tokens that agree and the logprob differences of the tokens both list.

    python3 scripts/dev/fp8_quant_shift.py
"""

from __future__ import annotations

import tempfile

import torch

from longserve import LLM, SamplingParams
from longserve.testing import quant_checkpoints as qc


def prompts(n=4, seed=0):
    """test_quant_engine_gpu.prompts: a shared head, then 3, 20, 37, 54 tokens."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (40,), generator=g).tolist()
    return [head + torch.randint(10, 500, (3 + 17 * i,), generator=g).tolist() for i in range(n)]


def first(path):
    """Per prompt: the greedy first token and the first step's top-2 {token: logprob} (fp32, CPU)."""
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(path, device="cpu", dtype="float32", max_total_tokens=8192) as llm:
        outs = llm.generate(prompts(), sp, use_tqdm=False)
    return [(o.token_ids[0], dict(o.outputs[0].top_logprobs[0])) for o in outs]


def main() -> None:
    cases = {
        "fp8-block": (lambda p: qc.write_fp8_block(p, "qwen3", block=(64, 64), seed=7), 7, "qwen3"),
        "ct-fp8-dynamic": (lambda p: qc.write_compressed_tensors(p, "qwen3", "FP8_DYNAMIC", seed=5), 5, "qwen3"),
        "fp8-moe": (lambda p: qc.write_fp8_block(p, "qwen3_moe", block=(32, 32), seed=9), 9, "qwen3_moe"),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        for name, (write, seed, arch) in cases.items():
            quantized = first(write(f"{d}/{name}"))
            original = first(qc.write_float(f"{d}/{name}-original", arch, seed=seed))
            diffs = [
                abs(q[t] - o[t]) for (_, q), (_, o) in zip(quantized, original) for t in q.keys() & o.keys()
            ]
            same = sum(tq == to for (tq, _), (to, _) in zip(quantized, original))
            print(f"{name}: {same}/4 first tokens agree; logprob differences {[round(x, 3) for x in diffs]}")


if __name__ == "__main__":
    main()
