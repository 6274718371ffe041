"""Our models vs transformers (eager, float32) on tiny random checkpoints: full prefill, chunked prefill over
a non-contiguous paged KV cache, a mixed two-request step, greedy decode, and RoPE scaling parity."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from longserve.attention.base import ForwardContext, KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.attention.torch_backend import TorchAttentionBackend
from longserve.models import load_hf_config, load_model
from longserve.models.rope import compute_inv_freq, rope_parameters_from_config
from longserve.testing.checkpoints import make_tiny_checkpoint

PAGE_SIZE = 4
PAGE_IDS = [5, 2, 9, 0, 7, 11, 3, 8, 1, 6, 13, 4, 10, 12, 15, 14, 17, 16, 19, 18]
NUM_PAGES = 24
CASES = [
    ("llama", False),
    ("llama", True),
    ("llama31", False),
    ("mistral", False),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
]


def make_meta(
    prefix_lens: list[int], query_lens: list[int], page_tables: list[list[int]]
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step built by hand (independent of the runner); returns (meta, positions [T])."""
    positions, slots = [], []
    for prefix, query, pages in zip(prefix_lens, query_lens, page_tables):
        for pos in range(prefix, prefix + query):
            positions.append(pos)
            slots.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
    max_pages = max(len(p) for p in page_tables)
    table = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables], dtype=torch.int32)
    seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        page_size=PAGE_SIZE,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        page_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def new_cache(model: torch.nn.Module) -> KVCache:
    return KVCache(
        model.num_layers, NUM_PAGES, PAGE_SIZE, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )


def run_step(
    model: torch.nn.Module,
    cache: KVCache,
    token_ids: list[torch.Tensor],
    prefix_lens: list[int],
    page_tables: list[list[int]],
) -> torch.Tensor:
    """One step over several requests' new tokens; returns logits [T, V] of every new token."""
    meta, positions = make_meta(prefix_lens, [len(t) for t in token_ids], page_tables)
    ctx = ForwardContext(meta=meta, kv_cache=cache, backend=TorchAttentionBackend())
    with torch.no_grad():
        hidden = model(torch.cat(token_ids), positions, ctx)  # [T, H]
        return model.compute_logits(hidden)  # [T, V]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], str]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        (arch, tie): make_tiny_checkpoint(root / f"{arch}-{tie}", arch, tie_word_embeddings=tie, seed=7)
        for arch, tie in CASES
    }


def load_both(path: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    ours = load_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return ours, hf


def hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()  # [T, V]


def prompt(vocab_size: int, n: int = 40, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (n,), generator=gen)  # [n]
    ids[0] = 0  # <|begin_of_text|>
    return ids


def two_chunks(model, ids: list[int], split: int = 17) -> torch.Tensor:
    """The logits of `ids` prefilled as two chunks (the second over the first's cached K/V), [len(ids), V]."""
    cache = new_cache(model)
    first = run_step(model, cache, [ids[:split]], [0], [PAGE_IDS])
    return torch.cat([first, run_step(model, cache, [ids[split:]], [split], [PAGE_IDS])])


@pytest.mark.parametrize("arch,tie", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_prefill_and_chunked_match_hf(checkpoints: dict, arch: str, tie: bool) -> None:
    ours, hf = load_both(checkpoints[(arch, tie)])
    assert ours.tie_word_embeddings == tie
    ids = prompt(ours.vocab_size)
    ref = hf_logits(hf, ids)  # [40, V]

    full = run_step(ours, new_cache(ours), [ids], [0], [PAGE_IDS])
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)

    torch.testing.assert_close(two_chunks(ours, ids), ref, atol=1e-4, rtol=1e-4)


def test_mixed_step_two_requests(checkpoints: dict) -> None:
    """A decode token of one request and a prefill chunk of another in the same flattened step."""
    ours, hf = load_both(checkpoints[("qwen2", False)])
    a, b = prompt(ours.vocab_size, 21, seed=1), prompt(ours.vocab_size, 13, seed=2)
    pages_a, pages_b = PAGE_IDS[:6], PAGE_IDS[6:10]
    cache = new_cache(ours)
    run_step(ours, cache, [a[:20]], [0], [pages_a])
    logits = run_step(ours, cache, [a[20:], b], [20, 0], [pages_a, pages_b])  # [1 + 13, V]
    torch.testing.assert_close(logits[:1], hf_logits(hf, a)[20:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1:], hf_logits(hf, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama31", "qwen3"])
def test_greedy_decode_matches_hf_and_is_stable(checkpoints: dict, arch: str) -> None:
    """Token-by-token decode through the KV cache equals HF's greedy tokens; the tiny model is not degenerate."""
    ours, hf = load_both(checkpoints[(arch, False)])
    ids = prompt(ours.vocab_size, 12, seed=3)
    cache = new_cache(ours)
    logits = run_step(ours, cache, [ids], [0], [PAGE_IDS])[-1]  # [V]
    seq, gaps = ids.tolist(), []
    for _ in range(32):
        ref = hf_logits(hf, torch.tensor(seq))[-1]  # [V]
        top2 = ref.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        assert int(logits.argmax()) == int(ref.argmax())
        seq.append(int(ref.argmax()))
        logits = run_step(ours, cache, [torch.tensor(seq[-1:])], [len(seq) - 1], [PAGE_IDS])[-1]
    generated = seq[len(ids) :]
    assert len(set(generated)) >= 4, generated
    assert sorted(gaps)[len(gaps) // 2] > 1e-3, gaps


def test_bfloat16_close_to_hf_float32(checkpoints: dict) -> None:
    """bf16 weights and KV cache stay within bf16 noise of HF float32 (HF's own bf16 run differs by ~0.2)."""
    from transformers import AutoModelForCausalLM

    path = checkpoints[("llama31", False)]
    ours = load_model(path, load_hf_config(path), torch.bfloat16, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = prompt(ours.vocab_size)
    cache = KVCache(
        ours.num_layers, NUM_PAGES, PAGE_SIZE, ours.num_kv_heads, ours.head_dim, torch.bfloat16, "cpu"
    )
    logits = run_step(ours, cache, [ids], [0], [PAGE_IDS])  # [40, V]
    assert logits.dtype == torch.float32
    assert float((logits - hf_logits(hf, ids)).abs().max()) < 0.5


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
}


@pytest.mark.parametrize("partial", [1.0, 0.25], ids=["full", "partial"])
@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_inv_freq_matches_hf(rope_type: str, partial: float) -> None:
    """Every rope type's frequencies, over the whole head or (partial_rotary_factor, Qwen3.5) its first quarter."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={**ROPE_CASES[rope_type], "partial_rotary_factor": partial},
    )
    params = rope_parameters_from_config(cfg)
    ours, scaling = compute_inv_freq(128, params, cfg.max_position_embeddings)
    assert ours.shape == (int(64 * partial),)
    if rope_type == "default":
        dim = int(128 * partial)
        ref, ref_scaling = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim)), 1.0
    else:
        ref, ref_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    torch.testing.assert_close(ours, ref, atol=0, rtol=1e-6)
    assert scaling == pytest.approx(ref_scaling)


def test_rope_old_style_config_and_unknown_type() -> None:
    old = types.SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=4096,
    )
    params = rope_parameters_from_config(old)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500000.0
    inv_freq, _ = compute_inv_freq(64, params, 4096)
    torch.testing.assert_close(inv_freq, 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64)) / 2.0)
    no_scaling = types.SimpleNamespace(rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096)
    assert rope_parameters_from_config(no_scaling) == {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(ValueError, match="supported: default, linear, llama3, yarn"):
        compute_inv_freq(64, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, 4096)


def test_checkpoint_files(tmp_path: Path) -> None:
    import json

    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path / "c", "llama31")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    gen = json.loads((tmp_path / "c" / "generation_config.json").read_text())
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    assert gen["eos_token_id"] == [1, 3] and len(tok) == cfg["vocab_size"] == 512
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
