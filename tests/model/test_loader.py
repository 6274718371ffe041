"""Checkpoint loader: sharded vs single file, missing files, unsupported architectures, dummy weights, dtypes."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from longserve.models import get_model_class, load_hf_config, load_model, resolve_dtype
from longserve.testing.checkpoints import make_tiny_checkpoint

CPU = torch.device("cpu")
SUPPORTED = (
    "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
    "Qwen3ForCausalLM, Qwen3MoeForCausalLM"
)


def _load(path: str, **kwargs: object) -> torch.nn.Module:
    return load_model(path, load_hf_config(path), torch.float32, CPU, **kwargs)


def test_sharded_equals_single_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    single = make_tiny_checkpoint(tmp_path / "single", "qwen2", seed=3)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", seed=3, sharded=True)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    with caplog.at_level(logging.INFO, logger="longserve.models.loader"):
        a, b = _load(single), _load(sharded)
    assert any("Loaded" in r.message and " GB" in r.message for r in caplog.records)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert not a.training and not any(p.requires_grad for p in a.parameters())


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "llama", sharded=True)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        _load(path)


def test_no_safetensors_and_no_config(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "llama")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors found in .*load_format='dummy'"):
        _load(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(str(tmp_path / "empty"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "llama")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    Path(cfg_path).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel' is not supported; supported: {SUPPORTED}"):
        _load(path)
    with pytest.raises(ValueError, match="supported: "):
        get_model_class(["BertModel"])


def test_missing_and_unknown_weights(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "llama")
    model = _load(path, load_format="dummy")
    with pytest.raises(ValueError, match=r"missing weights .*model\.norm\.weight"):
        model.load_weights((n, p) for n, p in model.state_dict().items() if n != "model.norm.weight")
    with pytest.raises(ValueError, match="model.layers.0.self_attn.qkv_proj.weight"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match="bogus"):
        model.load_weights([("model.bogus.weight", torch.zeros(1))])


def test_dummy_is_deterministic_and_needs_only_config(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "c", "qwen3")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(src, "config.json"), bare / "config.json")
    a, b, c = (_load(str(bare), load_format="dummy", seed=s) for s in (1, 1, 2))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones_like(sa["model.norm.weight"]))
    assert torch.equal(sa["model.layers.0.self_attn.q_norm.weight"], torch.ones(32))
    std = float(sa["model.layers.0.mlp.down_proj.weight"].std())
    assert std == pytest.approx(0.2, rel=0.1)  # the checkpoint's initializer_range


def test_resolve_dtype(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "llama")
    cfg = load_hf_config(path)
    assert resolve_dtype("auto", cfg) == torch.float32
    cfg.dtype = "bfloat16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    cfg.dtype = None
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("float16", cfg) == torch.float16
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("int8", cfg)

    model = load_model(path, load_hf_config(path), resolve_dtype("bfloat16", cfg), CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
