"""`longserve bench accuracy` offline on tiny checkpoints: a perturbed copy disagrees (agreement < 1, KL > 0),
the same checkpoint twice agrees exactly (agreement 1, KL 0), the fp8 KV cache against auto on one checkpoint
runs through --kv-cache-dtype, a different tokenizer is refused, and the report files parse. The two-server
path: tests/server/test_bench_accuracy_servers.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longserve.bench.accuracy import kl_topk, load_prompts
from longserve.cli import main
from longserve.testing.checkpoints import make_tiny_checkpoint

COMMON = ["--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4096", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(original, a copy whose 2-D weights carry noise of 0.3 of their std)."""
    ref = make_tiny_checkpoint(tmp_path_factory.mktemp("ref"), "llama")
    other = str(tmp_path_factory.mktemp("perturbed") / "ckpt")
    shutil.copytree(ref, other)
    (name,) = [f for f in os.listdir(other) if f.endswith(".safetensors")]
    g = torch.Generator().manual_seed(1)
    tensors = {
        k: v + 0.3 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v
        for k, v in load_file(os.path.join(other, name)).items()
    }
    save_file(tensors, os.path.join(other, name), metadata={"format": "pt"})
    return ref, other


def run(tmp_path, *args):
    out = tmp_path / "report"
    assert main(["bench", "accuracy", *args, *COMMON, "--output-dir", str(out)]) == 0
    report = json.loads((out / "accuracy.json").read_text())
    md = (out / "accuracy.md").read_text()
    assert md.startswith("# bench accuracy") and "| top-1 next-token agreement |" in md
    assert md.count("\n| ") >= report["num_prompts"] + 8  # metrics table + one row per prompt side by side
    return report


def test_perturbed_copy_disagrees(pair, tmp_path, capsys):
    ref, other = pair
    r = run(tmp_path, "--model", other, "--reference", ref)
    assert r["num_prompts"] == len(load_prompts(None)) and r["positions"] > 0
    assert r["top1_agreement"] < 1 and r["mean_kl"] > 0.01
    assert r["perplexity"]["model"] != r["perplexity"]["reference"]
    assert all(p["reference_answer"] is not None and p["model_answer"] is not None for p in r["prompts"])
    assert "teacher-forced scoring 12/12" in capsys.readouterr().err  # progress shown


def test_same_checkpoint_twice_agrees(pair, tmp_path):
    ref, _ = pair
    prompts = tmp_path / "q.jsonl"
    prompts.write_text('{"prompt": "What is a balance sheet?"}\n\n{"question": "Define churn."}\n')
    text = tmp_path / "text.txt"
    text.write_text("The invoice is due in thirty days. Late payments carry a fee.")
    r = run(tmp_path, "--model", ref, "--reference", ref, "--prompts", str(prompts), "--text", str(text))
    assert r["num_prompts"] == 2 and r["top1_agreement"] == 1.0
    assert r["mean_kl"] < 1e-6 and r["same_answers"] == 2
    assert r["perplexity"]["model"] == pytest.approx(r["perplexity"]["reference"], rel=1e-6)


def test_fp8_kv_cache_against_auto(pair, tmp_path):
    ref, _ = pair
    r = run(tmp_path, "--model", ref, "--reference", ref, "--kv-cache-dtype", "fp8")
    assert "kv_cache_dtype=fp8" in r["model"] and "kv_cache_dtype" not in r["reference"]
    assert r["mean_kl"] > 0 and r["top1_agreement"] > 0.5  # close, not identical (e4m3 rounding)


def test_different_tokenizer_is_refused(pair, tmp_path, capsys):
    ref, _ = pair
    other = tmp_path / "other-tok"
    shutil.copytree(ref, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "!", next(t for t in vocab if t not in ("!",) and vocab[t] > 10)
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert main(["bench", "accuracy", "--model", str(other), "--reference", ref, *COMMON,
                 "--output-dir", str(tmp_path / "r")]) == 2  # fmt: skip
    assert "different tokenizers" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_whole_vocabulary_kl_offline(pair, tmp_path, capsys):
    """--top-k -1 with both sides offline: every token's logprob (their engines at max_logprobs -1), so the KL
    is the exact one over the vocabulary, which the top-20 approximation misses on these near-flat tiny models;
    the same top-1 agreement either way. With a server side it is refused before anything loads."""
    ref, other = pair
    exact = run(tmp_path / "exact", "--model", other, "--reference", ref, "--top-k", "-1")
    approx = run(tmp_path / "approx", "--model", other, "--reference", ref)
    assert exact["top_k"] == -1 and "every token of the vocabulary" in exact["kl_note"]
    assert exact["mean_kl"] > 0.01 and exact["mean_kl"] != pytest.approx(approx["mean_kl"], rel=1e-2)
    assert exact["top1_agreement"] == approx["top1_agreement"]
    assert main(["bench", "accuracy", "--model", other, "--reference-base-url", "http://127.0.0.1:9",
                 "--top-k", "-1", *COMMON, "--output-dir", str(tmp_path / "r")]) == 2  # fmt: skip
    assert "needs both sides offline" in capsys.readouterr().err


def test_kl_topk_over_the_whole_vocabulary_is_the_kl():
    g = torch.Generator().manual_seed(3)
    p, q = (torch.log_softmax(torch.randn(64, generator=g) * 2, dim=0) for _ in range(2))
    as_map = lambda lp: dict(enumerate(lp.tolist()))  # noqa: E731
    want = float((p.exp() * (p - q)).sum())
    assert kl_topk(as_map(p), as_map(q)) == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_kl_topk_approximation():
    p = {1: -0.1, 2: -2.5}
    assert kl_topk(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    assert kl_topk(p, {1: -2.5, 2: -0.1}) > 0.5
    assert kl_topk(p, {3: -0.05, 1: -4.0}) > kl_topk(p, {1: -0.2, 2: -2.0})  # a missing token costs


def test_bad_prompts_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 1}\n')
    with pytest.raises(ValueError, match='bad.jsonl:1: expected an object with a "prompt"'):
        load_prompts(str(bad))
