"""Tensor-parallel weight loading reads only each rank's slices of the checkpoint ("a rank reads only what
it needs"): parameters equal the exact expected slices of the full tensors, and the bytes read per rank are
about 1/tp of the checkpoint. A fake tp group is installed (loading runs no collectives), so no processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from longserve.distributed import TPGroup, parallel_state
from longserve.models import load_hf_config
from longserve.models.layers import MergedLinear, RowParallelLinear, default_weight_loader
from longserve.models.loader import CheckpointSlice, LoadStats, iterate_safetensors, load_model
from longserve.testing.checkpoints import ARCHS, make_tiny_checkpoint

CPU = torch.device("cpu")
ODD_VOCAB = 509  # not divisible by 2 or 4: the last rank's vocab slice ends in zero padding


def _shrink_vocab(path: str, vocab: int) -> None:
    """Cut the checkpoint's vocab to `vocab` rows (embed_tokens / lm_head and config.json)."""
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        tensors = load_file(file)
        hit = [k for k in tensors if k.endswith(("embed_tokens.weight", "lm_head.weight"))]
        if hit:
            for k in hit:
                tensors[k] = tensors[k][:vocab].contiguous()
            save_file(tensors, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    cfg = json.loads(Path(cfg_path).read_text())
    cfg["vocab_size"] = vocab
    Path(cfg_path).write_text(json.dumps(cfg))


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read in full with safetensors (the reference)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118
                    out[key] = f.get_tensor(key)
    return out


def _load(
    path: str, tp: int, rank: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.nn.Module, LoadStats]:
    group = (
        None
        if tp == 1
        else TPGroup(rank=rank, world_size=tp, local_rank=rank, device_group=None, cpu_group=None)
    )
    monkeypatch.setattr(parallel_state, "_TP", group)
    stats = LoadStats()
    try:
        model = load_model(path, load_hf_config(path), torch.float32, CPU, stats=stats)
    finally:
        monkeypatch.setattr(parallel_state, "_TP", None)
    return model, stats


def _kv_heads(num_kv: int, tp: int, rank: int) -> tuple[int, int]:
    """(first kv head, count) of a rank: split when tp <= kv heads, else replicated on tp/kv ranks."""
    if tp <= num_kv:
        return rank * (num_kv // tp), num_kv // tp
    return rank // (tp // num_kv), 1


def _expected(full: dict[str, torch.Tensor], cfg: object, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's expected parameters, sliced by hand from the full checkpoint tensors."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads  # type: ignore[attr-defined]
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads  # type: ignore[attr-defined]
    inter, vocab = cfg.intermediate_size, cfg.vocab_size  # type: ignore[attr-defined]
    nq, qs = heads // tp, rank * (heads // tp)
    ks, nk = _kv_heads(kv, tp, rank)
    ni, is_ = inter // tp, rank * (inter // tp)
    vp = -(-vocab // tp)

    def rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return t[start : start + n]

    def vocab_rows(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(vp, t.shape[1], dtype=t.dtype)
        real = t[rank * vp : (rank + 1) * vp]
        out[: real.shape[0]] = real
        return out

    exp: dict[str, torch.Tensor] = {}
    for name, t in full.items():
        if ".self_attn.q_proj." in name:
            base = name.replace(".q_proj.", ".qkv_proj.")
            k, v = full[name.replace(".q_proj.", ".k_proj.")], full[name.replace(".q_proj.", ".v_proj.")]
            exp[base] = torch.cat([rows(t, qs * d, nq * d), rows(k, ks * d, nk * d), rows(v, ks * d, nk * d)])
        elif ".mlp.gate_proj." in name:
            up = full[name.replace(".gate_proj.", ".up_proj.")]
            exp[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [rows(t, is_, ni), rows(up, is_, ni)]
            )
        elif ".o_proj.weight" in name:
            exp[name] = t[:, qs * d : (qs + nq) * d]
        elif ".down_proj.weight" in name:
            exp[name] = t[:, is_ : is_ + ni]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            exp[name] = vocab_rows(t)
        elif not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
            exp[name] = t  # replicated: norms (and o/down biases, if any)
    return exp


def _check_params(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == expected.keys()
    for name, want in expected.items():
        got = params[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(got, want), name


def _replicated_bytes(full: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for n, t in full.items() if "norm" in n)


@pytest.fixture(scope="module")
def odd_vocab_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for arch in ARCHS:
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=7)
        _shrink_vocab(path, ODD_VOCAB)
        out[arch] = path
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_ranks_load_exact_slices_and_read_half(
    arch: str, odd_vocab_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = odd_vocab_checkpoints[arch]
    cfg = load_hf_config(path)
    assert cfg.vocab_size == ODD_VOCAB
    full = _checkpoint_tensors(path)
    total = sum(t.numel() * t.element_size() for t in full.values())

    model, stats = _load(path, 1, 0, monkeypatch)
    _check_params(model, _expected(full, cfg, 1, 0))
    assert stats.bytes_total == total
    assert stats.bytes_read == total  # tp=1 reads everything, once

    read = []
    for rank in range(2):
        model, stats = _load(path, 2, rank, monkeypatch)
        _check_params(model, _expected(full, cfg, 2, rank))
        emb = model.model.embed_tokens.weight
        assert emb.shape[0] == 255
        if rank == 1:  # rows 255..508 real, row 509 of the padded vocab is zero
            assert torch.equal(emb[:254], full["model.embed_tokens.weight"][255:])
            assert torch.count_nonzero(emb[254]) == 0
        assert stats.bytes_total == total
        assert 0.4 * total < stats.bytes_read < 0.6 * total, (rank, stats.bytes_read, total)
        read.append(stats.bytes_read)
    # every sharded byte is read by exactly one rank; only the replicated norms are read by both
    assert sum(read) == total + _replicated_bytes(full)


def test_sharded_multi_file_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "qwen2", seed=5, sharded=True)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    cfg = load_hf_config(path)
    full = _checkpoint_tensors(path)
    total = sum(t.numel() * t.element_size() for t in full.values())
    read = []
    for rank in range(2):
        model, stats = _load(path, 2, rank, monkeypatch)
        _check_params(model, _expected(full, cfg, 2, rank))
        assert stats.num_files > 1 and stats.bytes_total == total
        assert 0.4 * total < stats.bytes_read < 0.6 * total
        read.append(stats.bytes_read)
    assert sum(read) == total + _replicated_bytes(full)


def test_tp4_replicated_kv_heads(
    odd_vocab_checkpoints: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = odd_vocab_checkpoints["llama"]
    cfg = load_hf_config(path)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    full = _checkpoint_tensors(path)
    total = sum(t.numel() * t.element_size() for t in full.values())
    for rank in range(4):
        model, stats = _load(path, 4, rank, monkeypatch)
        _check_params(model, _expected(full, cfg, 4, rank))
        qkv = model.model.layers[1].self_attn.qkv_proj.weight  # [16 q | 16 k | 16 v, 64]
        assert qkv.shape == (48, 64)
        kv_rows = slice(0, 16) if rank < 2 else slice(16, 32)  # ranks 0,1 -> kv head 0; ranks 2,3 -> head 1
        layer = "model.layers.1.self_attn."
        assert torch.equal(qkv[:16], full[layer + "q_proj.weight"][rank * 16 : (rank + 1) * 16])
        assert torch.equal(qkv[16:32], full[layer + "k_proj.weight"][kv_rows])
        assert torch.equal(qkv[32:], full[layer + "v_proj.weight"][kv_rows])
        if rank == 3:  # 128 vocab rows per rank: 125 real + 3 zero padding
            emb = model.model.embed_tokens.weight
            assert torch.equal(emb[:125], full["model.embed_tokens.weight"][384:])
            assert torch.count_nonzero(emb[125:]) == 0
        assert stats.bytes_read < 0.4 * total  # about a quarter (plus replicated kv and norms)


def test_tied_embeddings_tp2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_checkpoint(tmp_path / "c", "qwen3", seed=2, tie_word_embeddings=True)
    cfg = load_hf_config(path)
    full = _checkpoint_tensors(path)
    for rank in range(2):
        model, stats = _load(path, 2, rank, monkeypatch)
        expected = {k: v for k, v in _expected(full, cfg, 2, rank).items() if k != "lm_head.weight"}
        _check_params(model, expected)
        assert torch.equal(model.lm_head_weight, expected["model.embed_tokens.weight"])


def test_checkpoint_slice_narrow_composes_and_counts(tmp_path: Path) -> None:
    file = str(tmp_path / "t.safetensors")
    x = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    save_file({"x": x, "b": torch.arange(5, dtype=torch.bfloat16)}, file)
    stats = LoadStats()
    items = iterate_safetensors([file], CPU, stats)
    seen = {}
    for name, lazy in items:
        assert isinstance(lazy, CheckpointSlice)
        seen[name] = lazy.shape
        if name == "x":
            assert lazy.shape == torch.Size([6, 8]) and lazy.dtype == torch.float32
            view = lazy.narrow(0, 1, 4).narrow(1, 2, 3).narrow(0, 1, 2)
            assert view.shape == torch.Size([2, 3])
            before = stats.bytes_read
            assert torch.equal(view.materialize(), x[2:4, 2:5])
            assert stats.bytes_read - before == 2 * 3 * 4
            with pytest.raises(IndexError):
                lazy.narrow(1, 6, 3)
        else:
            assert lazy.dtype == torch.bfloat16
            assert torch.equal(lazy.narrow(0, -2, 2).to_tensor(), torch.tensor([3, 4], dtype=torch.bfloat16))
    assert seen == {"x": torch.Size([6, 8]), "b": torch.Size([5])}
    assert stats.num_tensors == 2 and stats.bytes_total == 6 * 8 * 4 + 5 * 2
    assert stats.bytes_read == 2 * 3 * 4 + 2 * 2


def test_loaders_accept_lazy_and_real_tensors_alike(tmp_path: Path) -> None:
    """The same weight loaders fill a parameter identically from a torch.Tensor and a lazy slice."""
    file = str(tmp_path / "w.safetensors")
    w = torch.randn(12, 8)
    save_file({"w": w}, file)
    merged = MergedLinear(
        8, {"a": 4, "b": 2}, bias=False, shard_starts={"a": 4, "b": 2}, full_shard_sizes={"a": 8, "b": 4}
    )
    row = RowParallelLinear(8, 12, bias=False)
    for source in ("real", "lazy"):
        for p in (merged.weight, row.weight):
            p.data.zero_()
        with safe_open(file, framework="pt", device="cpu") as f:
            stats = LoadStats()
            loaded = w if source == "real" else CheckpointSlice(f.get_slice("w"), CPU, stats)
            with torch.no_grad():
                merged.weight_loader(merged.weight, loaded, None)  # fused: a = rows 4..7, b = rows 10..11
                default_weight_loader(row.weight, loaded)
        assert torch.equal(merged.weight, torch.cat([w[4:8], w[10:12]])), source
        assert torch.equal(row.weight, w), source
        if source == "lazy":
            assert stats.bytes_read == (6 + 12) * 8 * 4
