"""`LLM(...)`, `longserve serve` (server/args.py's resolution) and `longserve bench latency` read the same
settings alike: every attention backend spelling of the registry gives the same EngineConfig through all
three and the same backend on a device; an unknown one is refused by each. Errors name the settings as the
entry point spells them: flags on a command line, Python keywords in `LLM(...)`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from longserve import cli, llm
from longserve.bench import latency, run_latency
from longserve.config import ConfigError, ConfigPathError, EngineConfig
from longserve.platform import (
    ATTENTION_BACKEND_CHOICES,
    ATTENTION_BACKENDS,
    normalize_attention_backend,
    resolve_attention_backend,
)
from longserve.server.args import build_parser, cli_message, parse

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 512,
}  # fmt: skip


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


@pytest.fixture
def no_engine(monkeypatch):
    """LLM without building the engine: what reaches Engine is the EngineConfig under test."""
    built: list[EngineConfig] = []

    def fake_engine(config: EngineConfig) -> SimpleNamespace:
        built.append(config)
        return SimpleNamespace(config=config, close=lambda: None, warm_up=lambda: None)

    monkeypatch.setattr(llm, "Engine", fake_engine)
    monkeypatch.setattr(latency, "free_memory", lambda: None)  # nothing to collect: no engine was built
    return built


def _through_llm(model: str, device: str, name: str) -> EngineConfig:
    return llm.LLM(model, device=device, load_format="dummy", attention_backend=name).config


def _through_serve(model: str, device: str, name: str) -> EngineConfig:
    argv = ["--model-path", model, "--device", device, "--load-format", "dummy", "--attention-backend", name]
    return parse(argv, environ={})[0]


def _through_bench(device: str, name: str) -> EngineConfig:
    seen: list[EngineConfig] = []

    def measure(fake_llm, args, skipped):
        seen.append(fake_llm.config)
        return [], {"device": device, "dtype": "float32"}

    argv = ["--config", "tiny", "--device", device, "--attention-backend", name, "--prompt-lens", "8"]
    run_latency([*argv, "--max-total-tokens", "1024", "--warmup", "0", "--repeat", "1"], measure=measure)
    return seen[0]


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_every_backend_spelling_agrees_across_entry_points(model_dir, no_engine, device):
    assert set(ATTENTION_BACKENDS) <= set(ATTENTION_BACKEND_CHOICES) and "auto" in ATTENTION_BACKEND_CHOICES
    for spelling in ATTENTION_BACKEND_CHOICES:
        for name in (spelling, spelling.upper()):  # case-insensitive everywhere
            configs = [
                _through_llm(model_dir, device, name),
                _through_serve(model_dir, device, name),
                _through_bench(device, name),
            ]
            stored = {c.attention_backend for c in configs}
            assert len(stored) == 1, (name, stored)
            (backend,) = stored
            # an explicit CPU device stores the backend that runs there; "auto" keeps the canonical name
            assert backend == ("torch" if device == "cpu" else normalize_attention_backend(spelling)), name
            assert resolve_attention_backend(backend, "cpu") == "torch"
            if device == "auto":  # the runner resolves it once the device is known, as for the spelling
                on_cuda = resolve_attention_backend(backend, "cuda")
                assert (
                    on_cuda == resolve_attention_backend(spelling, "cuda") and on_cuda in ATTENTION_BACKENDS
                )


def test_an_unknown_backend_is_refused_by_every_entry_point(model_dir, no_engine, capsys):
    with pytest.raises(ConfigError, match="unknown attention backend 'magic'; accepted: auto, torch"):
        _through_llm(model_dir, "cpu", "magic")
    with pytest.raises(ValueError, match="unknown attention backend 'magic'"):
        _through_serve(model_dir, "cpu", "magic")
    argv = ["bench", "latency", "--config", "tiny", "--attention-backend", "magic", "--prompt-lens", "8"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown attention backend 'magic'" in err and "flashinfer" in err


def test_cli_errors_name_flags_and_the_python_api_keeps_keywords(tmp_path, no_engine, capsys):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigPathError, match="or load_format='dummy' with a directory"):
        llm.LLM(missing)
    assert cli.main(["generate", "--model-path", missing, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "or --load-format dummy with a directory" in err and "load_format" not in err

    bad = ["bench", "latency", "--config", "tiny", "--prompt-lens", "8", "--page-size", "0"]
    assert cli.main(bad) == 2
    err = capsys.readouterr().err
    assert "error: --page-size must be an integer >= 1; got 0" in err

    with pytest.raises(ConfigError, match=r"^tp_size=4 must be a multiple of nnodes=3 "):
        EngineConfig(model=missing, load_format="dummy", tp_size=4, nnodes=3, dist_init_addr="h:1")
    argv = ["--model-path", str(tmp_path), "--tp", "4", "--nnodes", "3", "--dist-init-addr", "h:1"]
    with pytest.raises(ConfigError) as exc:
        parse(argv, environ={})
    assert cli_message(exc.value).startswith("--tp-size 4 must be a multiple of --nnodes 3 ")


def test_cli_message_spells_only_the_settings_an_error_names():
    e = ConfigError(
        "context_length=131,072 cannot fit; lower context_length or raise max_total_tokens", "context_length"
    )
    assert (
        cli_message(e)
        == "--context-length 131,072 cannot fit; lower --context-length or raise max_total_tokens"
    )
    e = ConfigPathError("no tokenizer in 'x' (pass tokenizer=DIR to load it from elsewhere)", "tokenizer")
    assert cli_message(e) == "no tokenizer in 'x' (pass --tokenizer-path DIR to load it from elsewhere)"
    plain = ValueError("tp_size=3 does not divide the model's 4 attention heads")
    assert cli_message(plain) == str(plain)  # names no settings: left as it is


def test_help_says_what_a_missing_model_means():
    text = " ".join(build_parser().format_help().split())
    assert "default: the small built-in demo model" in text
    assert "default: None" not in text


def test_llm_takes_every_engine_spelling_of_the_option_table(model_dir, no_engine):
    """LLM(...) takes vLLM's and SGLang's keyword spellings of every engine option `longserve serve` takes
    as a flag (server/args.py's one table), and builds the EngineConfig those flags build."""
    vllm = llm.LLM(
        model_dir, max_model_len=256, gpu_memory_utilization=0.5, max_num_batched_tokens=64, max_num_seqs=3,
        block_size=32, enforce_eager=True, enable_prefix_caching=False, seed=7, trust_remote_code=True,
        tokenizer=model_dir, tensor_parallel_size=1, swap_space=4, dtype="half", load_format="dummy",
        device="cpu", scheduling_policy="fcfs", kv_cache_dtype="fp8",
    ).config  # fmt: skip
    argv = (
        f"--model {model_dir} --max-model-len 256 --gpu-memory-utilization 0.5 --max-num-batched-tokens 64 "
        f"--max-num-seqs 3 --block-size 32 --enforce-eager --no-enable-prefix-caching --seed 7 "
        f"--trust-remote-code --tokenizer {model_dir} --tensor-parallel-size 1 --swap-space 4 --dtype half "
        "--load-format dummy --device cpu --scheduling-policy fcfs --kv-cache-dtype fp8"
    )
    assert vllm == parse(argv.split(), environ={})[0]
    assert (vllm.context_length, vllm.page_size, vllm.dtype, vllm.enable_prefix_caching) == (
        256, 32, "float16", False
    )  # fmt: skip
    sglang = llm.LLM(
        model_dir, context_length=256, mem_fraction_static=0.5, disable_radix_cache=True,
        disable_cuda_graph=True, random_seed=7, load_format="dummy", schedule_policy="lpm",
    ).config  # fmt: skip
    assert (sglang.context_length, sglang.enable_prefix_caching, sglang.enforce_eager, sglang.seed) == (
        256, False, True, 7
    )  # fmt: skip
    assert sglang.schedule_policy == "short-first"  # lpm, as the flag reads it


def test_llm_refuses_unknown_disagreeing_and_server_keywords(model_dir, no_engine):
    with pytest.raises(
        TypeError, match="unknown engine argument 'max_modle_len': did you mean 'max_model_len'"
    ):
        llm.LLM(model_dir, max_modle_len=256)
    with pytest.raises(TypeError, match=r"max_model_len=256 and context_length=512 set the same setting"):
        llm.LLM(model_dir, load_format="dummy", max_model_len=256, context_length=512)
    assert (
        llm.LLM(model_dir, load_format="dummy", max_model_len=256, context_length=256).config.context_length
        == 256
    )
    with pytest.raises(TypeError, match="'port' is a server setting"):
        llm.LLM(model_dir, port=8000)
    with pytest.raises(ConfigError, match="data parallelism is not supported"):
        llm.LLM(model_dir, load_format="dummy", data_parallel_size=2)
    with pytest.raises(ConfigError, match="dtype='fp9': expected auto"):
        llm.LLM(model_dir, load_format="dummy", dtype="fp9")
