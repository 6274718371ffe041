"""Evaluation clients against a real server: lm-evaluation-harness's `local-completions` model on a local
multiple-choice task and a loglikelihood_rolling (perplexity) task, and SGLang's frontend language
(`sglang.lang`: gen, select) - each scored again with transformers on the same fp32 checkpoint.

lm-eval comes without its dependencies (pyproject's test extra lists the few its API path needs and .ci/run
installs it with --no-deps); its tasks read local JSONL files written here, with the hub off."""

from __future__ import annotations

import importlib
import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("fastapi")

TOL = 1e-3  # a sum of fp32 logprobs from two implementations
MC_DOCS = [
    {
        "question": "The quick brown fox jumps over the",
        "choices": ["lazy dog", "stone bridge", "market"],
        "label": 0,
    },
    {"question": "Children walked to school along the", "choices": ["cache", "water", "library"], "label": 1},
    {
        "question": "A good cache evicts the least recently",
        "choices": ["weather", "books", "used pages"],
        "label": 2,
    },
    {"question": "Questions end with a question", "choices": ["mark", "bridge", "scheduler"], "label": 0},
]
PPL_DOCS = [
    "In the morning the river was quiet and the boats waited by the old stone bridge.",
    "The library opened at nine. Readers borrowed books about history, science, cooking and travel.",
    "She wrote a letter to her brother, who lived far away in a small town near the mountains.",
]
MAX_LENGTH = 20  # lm-eval's window: a perplexity document spans several rolling windows


def client_library(name: str, install: str):
    """The client library; CI (which installs it) fails without it, a developer's run skips saying how."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"not installed: {install}")


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager")


def hf_continuation(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """transformers' loglikelihood of `continuation` after `context`, and whether it is the greedy one."""
    ids = context + continuation
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    rows = logprobs[len(context) - 1 : len(ids) - 1]  # row p - 1 predicts token p
    target = torch.tensor(continuation)
    ll = rows.gather(1, target[:, None]).sum().item()
    return ll, bool((rows.argmax(dim=-1) == target).all())


def write_tasks(root) -> str:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in PPL_DOCS))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "ls_mc.yaml").write_text(
        f"task: ls_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    (root / "ls_ppl.yaml").write_text(
        f"task: ls_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    return str(root)


def test_lm_eval_loglikelihood_tasks_equal_transformers(server, tiny_model, hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    lm_eval = client_library("lm_eval", "pip install --no-deps lm-eval==0.4.13 (as .ci/run does)")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    lm = LocalCompletionsAPI(
        model=tiny_model,  # the served name: this server answers 404 to any other
        base_url=server.url + "/v1/completions",
        tokenizer=tiny_model,
        tokenizer_backend="huggingface",
        max_length=MAX_LENGTH,
        num_concurrent=1,
        max_retries=1,
    )
    tasks = TaskManager(include_path=write_tasks(tmp_path), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["ls_mc", "ls_ppl"], task_manager=tasks, log_samples=True
    )

    # multiple choice: every choice's loglikelihood (and greediness), then the accuracy
    correct = []
    for sample in sorted(results["samples"]["ls_mc"], key=lambda s: s["doc_id"]):
        hf_lls = []
        for (context, continuation), [(ll, is_greedy)] in zip(sample["arguments"], sample["resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            want_ll, want_greedy = hf_continuation(hf_model, ctx, cont)
            assert ll == pytest.approx(want_ll, abs=TOL) and is_greedy == want_greedy
            hf_lls.append(want_ll)
        correct.append(max(range(len(hf_lls)), key=hf_lls.__getitem__) == sample["target"])
    assert results["results"]["ls_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    # perplexity: lm-eval's rolling windows of each document (its max_length keeps one token for the
    # generated one, as its loglikelihood_rolling does), scored by transformers
    total_ll, total_words, total_bytes = 0.0, 0, 0
    samples = sorted(results["samples"]["ls_ppl"], key=lambda s: s["doc_id"])
    assert len(samples) == len(PPL_DOCS)
    for sample, text in zip(samples, PPL_DOCS):
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(lm.tok_encode(text), lm.prefix_token_id, lm.max_length - 1, 1)
        ]
        assert len(windows) > 1, "one window per document: the rolling path would be untested"
        want = sum(hf_continuation(hf_model, ctx, cont)[0] for ctx, cont in windows)
        assert sample["resps"][0][0] == pytest.approx(want, abs=TOL)
        total_ll += want
        total_words += len(re.split(r"\s+", text))
        total_bytes += len(text.encode("utf-8"))
    ppl = results["results"]["ls_ppl"]
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_words), rel=1e-3)
    assert ppl["byte_perplexity,none"] == pytest.approx(math.exp(-total_ll / total_bytes), rel=1e-3)
    assert ppl["bits_per_byte,none"] == pytest.approx(-total_ll / total_bytes / math.log(2), rel=1e-3)


def test_sglang_frontend_gen_and_select(server, tiny_model, hf_model):
    sgl = client_library("sglang", "pip install -e '.[test]'")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    backend = sgl.RuntimeEndpoint(server.url)
    prefix = "The library opened at nine. Readers borrowed books about"
    choices = [" history and science", " the weather", " a good cache"]

    @sgl.function
    def program(s):
        s += prefix
        s += sgl.gen("more", max_tokens=8, temperature=0)

    @sgl.function
    def pick(s):
        s += prefix
        s += sgl.select("topic", choices=choices)

    # gen: the greedy continuation transformers generates
    state = program.run(backend=backend)
    ids = tok(prefix).input_ids
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert state["more"] == tok.decode(out[0, len(ids) :], skip_special_tokens=True)

    # select: SGLang scores each choice by its tokens' mean logprob from two tokens before the choice
    # (RuntimeEndpoint.select, token_length_normalized); the same numbers from transformers
    state = pick.run(backend=backend)
    start = max(len(ids) - 2, 0)
    normalized = []
    for choice in choices:
        full = tok(prefix + choice).input_ids
        assert not prefix.endswith(tok.decode([full[start]])), "token healing would change the scores"
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
        values = [logprobs[p - 1, full[p]].item() for p in range(start + 1, len(full))]
        normalized.append(sum(values) / len(values))
    meta = state.get_meta_info("topic")
    assert meta["normalized_prompt_logprobs"] == pytest.approx(normalized, abs=1e-4)
    assert state["topic"] == choices[max(range(len(choices)), key=normalized.__getitem__)]
