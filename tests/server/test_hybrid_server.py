"""A hybrid model (Qwen3.5-MoE's vision-language checkpoint layout, tiny and random) served as a vLLM user would
start it, through the openai client: greedy completions equal transformers' `generate`, streamed and not, eight
at once over two state slots (the rest wait for a slot), and a chat reply through the checkpoint's template; a
repeated long prompt resumes from its state checkpoint and says so in its usage (prefix caching on)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from longserve.cache.manager import MIN_CHECKPOINT_TOKENS
from longserve.testing.checkpoints import make_tiny_checkpoint
from longserve.testing.server_process import ServerProcess
from tests.e2e.test_engine import prompts

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe", seed=11, max_position_embeddings=2048
    )
    args = ["--model", path, "--device", "cpu", "--dtype", "float32", "--enable-prefix-caching"]
    args += ["--max-num-seqs", "2", "--max-num-batched-tokens", "48", "--max-total-tokens", "4096"]
    proc = ServerProcess(args, str(tmp_path_factory.mktemp("logs") / "server.log"))
    try:
        yield path, proc.wait_ready()
    finally:
        proc.stop()


def test_completions_equal_transformers(hybrid):
    path, server = hybrid
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ps = prompts(8, shared=30)
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # 12 tokens, no eos (ignore_eos below)
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p) :]
                    for p in ps]  # fmt: skip

    def complete(i: int) -> list[int]:
        kw = dict(
            model=path,
            prompt=ps[i],
            max_tokens=12,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        if i % 2:  # streamed: the tokens arrive in pieces
            chunks = client.completions.create(stream=True, **kw)
            return [t for c in chunks for t in c.choices[0].logprobs.tokens if c.choices]
        return client.completions.create(**kw).choices[0].logprobs.tokens

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(complete, range(8)))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert got == [[tok.decode([t]) for t in e.tolist()] for e in expected]  # logprobs' tokens are their text

    chat = client.chat.completions.create(
        model=path, messages=[{"role": "user", "content": "The quick brown fox"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1


def test_a_repeated_long_prompt_hits_its_state_checkpoint(hybrid):
    """--enable-prefix-caching on a hybrid model: the second request of a long prompt (past the checkpoint floor)
    reports its cached tokens in usage, as vLLM's server does, and answers as the first did."""
    path, server = hybrid
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = prompts(1, shared=MIN_CHECKPOINT_TOKENS + 40)[0]
    kw = dict(
        model=path, prompt=prompt, max_tokens=8, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    first, again = (client.completions.create(**kw) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert again.choices[0].logprobs.tokens == first.choices[0].logprobs.tokens
    lp = zip(again.choices[0].logprobs.token_logprobs, first.choices[0].logprobs.token_logprobs)
    assert all(abs(a - b) < 1e-3 for a, b in lp)
