"""The pooling and compatibility flags in vLLM's and SGLang's spellings resolve onto the engine and server
settings; a bad value is refused naming the flag."""

from __future__ import annotations

import json

import pytest

from longserve.server.args import cli_message, parse

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}


@pytest.mark.parametrize(
    "argv,runner,convert",
    [
        (["--runner", "pooling"], "pooling", "auto"),  # vLLM
        (["--is-embedding"], "pooling", "auto"),  # SGLang
        (["--task", "embed"], "auto", "embed"),  # vLLM's older spelling
        (["--task", "embedding"], "auto", "embed"),
        (["--task", "score"], "auto", "classify"),
        (["--convert", "classify"], "auto", "classify"),
        (["--task", "generate"], "auto", "none"),
        ([], "auto", "auto"),
    ],
)
def test_runner_and_convert(argv, runner, convert):
    engine, _ = parse(argv, environ={})
    assert (engine.runner, engine.convert) == (runner, convert)


def test_hf_overrides_from_flag_env_and_both_spellings():
    for flag in ("--hf-overrides", "--hf_overrides"):
        engine, _ = parse([flag, json.dumps(RERANKER)], environ={})
        assert engine.hf_overrides == RERANKER
    engine, _ = parse([], environ={"LONGSERVE_HF_OVERRIDES": json.dumps(RERANKER)})
    assert engine.hf_overrides == RERANKER
    with pytest.raises(ValueError) as e:
        parse(["--hf-overrides", "[1, 2]"], environ={})
    assert "--hf-overrides must be a JSON object" in cli_message(e.value)


def test_server_compat_flags():
    _, server = parse([], environ={})
    assert (server.strict_model_name, server.metrics_names) == (False, "longserve")
    _, server = parse(["--strict-model-name", "--metrics-names", "sglang"], environ={})
    assert (server.strict_model_name, server.metrics_names) == (True, "sglang")
    with pytest.raises(SystemExit):
        parse(["--metrics-names", "prometheus"], environ={})


def test_model_as_vllm_places_it(tmp_path):
    """`vllm serve MODEL`: the model may come positionally; with --model-path/--model too, they must agree."""
    from longserve.assets import default_model_path
    from longserve.cli import build_parser as cli_parser
    from longserve.server.args import resolve

    m = default_model_path()
    assert parse([m], environ={})[0].model == m
    assert parse([m, "--model", m, "--port", "8000"], environ={})[0].model == m
    args = cli_parser().parse_args(["serve", m, "--max-model-len", "256"])  # `longserve serve MODEL`
    assert resolve(args, environ={})[0].model == m
    args = cli_parser().parse_args(["generate", m, "--prompt", "hi"])
    assert resolve(args, environ={})[0].model == m
    with pytest.raises(ValueError, match="the model is given twice"):
        parse([m, "--model-path", str(tmp_path)], environ={})
    with pytest.raises(SystemExit):  # one model only
        parse([m, m], environ={})


def test_accepted_no_op_flags_and_data_parallel_refusal():
    engine, _ = parse([], environ={})
    assert (engine.trust_remote_code, engine.swap_space, engine.dp_size) == (False, None, 1)
    engine, _ = parse(["--trust-remote-code", "--swap-space", "4", "--dp-size", "1"], environ={})
    assert (engine.trust_remote_code, engine.swap_space, engine.dp_size) == (True, 4.0, 1)
    assert parse(["--data-parallel-size", "1"], environ={})[0].dp_size == 1
    engine, _ = parse([], environ={"LONGSERVE_TRUST_REMOTE_CODE": "true"})
    assert engine.trust_remote_code
    for flag in ("--dp-size", "--data-parallel-size"):
        with pytest.raises(ValueError) as e:
            parse([flag, "2"], environ={})
        message = cli_message(e.value)
        assert (
            message.startswith("--dp-size 2: data parallelism is not supported")
            and "load balancer" in message
        )
    with pytest.raises(ValueError, match="swap_space must be a number of GiB >= 0"):
        parse(["--swap-space", "-1"], environ={})


def test_chat_template_from_a_file_or_the_text(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    engine, _ = parse(["--chat-template", str(path)], environ={})
    assert engine.chat_template == str(path) and engine.chat_template_text == template
    assert parse(["--chat-template", template], environ={})[0].chat_template_text == template
    # typed in a shell on one line, with \n escapes: read as vLLM reads it
    assert parse(["--chat-template", "{{ 'a' }}\\n{{ 'b' }}"], environ={})[0].chat_template_text == (
        "{{ 'a' }}\n{{ 'b' }}"
    )
    assert parse([], environ={})[0].chat_template_text is None
    with pytest.raises(FileNotFoundError) as e:  # a path that cannot be read fails before anything loads
        parse(["--chat-template", str(tmp_path / "missing.jinja")], environ={})
    assert cli_message(e.value).startswith(
        f"--chat-template {tmp_path / 'missing.jinja'} looks like a file path"
    )


def test_expert_parallel_on_a_dense_model_warns(caplog):
    """vLLM ignores --enable-expert-parallel on a dense model; longserve too, and says so at start-up."""
    from longserve.assets import default_model_path
    from longserve.engine_checks import log_ignored_settings
    from longserve.models import load_hf_config

    dense = load_hf_config(default_model_path())
    for argv in (
        ["--enable-expert-parallel"],
        ["--ep-size", "1", "--trust-remote-code", "--swap-space", "2"],
    ):
        caplog.clear()
        with caplog.at_level("INFO", logger="longserve.engine"):
            log_ignored_settings(parse(argv, environ={})[0], dense)
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        if argv[0] == "--enable-expert-parallel":
            assert len(warnings) == 1 and "is not a mixture of experts" in warnings[0].getMessage()
        else:
            assert not warnings
            text = caplog.text
            assert "trust_remote_code (--trust-remote-code) has no effect" in text
            assert "swap_space=2.0 GiB (--swap-space) has no effect" in text and "recomputes" in text


def test_piecewise_cuda_graph_tokens_from_flag_env_and_yaml(tmp_path):
    """SGLang's --piecewise-cuda-graph-tokens: the piecewise graphs' step sizes, ascending; refused otherwise,
    naming the setting."""
    engine, _ = parse(["--piecewise-cuda-graph-tokens", "64", "96", "2176"], environ={})
    assert engine.piecewise_cuda_graph_tokens == (64, 96, 2176)
    engine, _ = parse([], environ={"LONGSERVE_PIECEWISE_CUDA_GRAPH_TOKENS": "128,256"})
    assert engine.piecewise_cuda_graph_tokens == (128, 256)
    config = tmp_path / "serve.yaml"
    config.write_text("piecewise-cuda-graph-tokens: [32, 48]\n")
    assert parse(["--config", str(config)], environ={})[0].piecewise_cuda_graph_tokens == (32, 48)
    assert parse([], environ={})[0].piecewise_cuda_graph_tokens is None  # the default schedule
    for bad in (["256", "128"], ["64", "64"], ["0", "64"]):
        with pytest.raises(ValueError) as e:
            parse(["--piecewise-cuda-graph-tokens", *bad], environ={})
        assert cli_message(e.value) == (
            f"--piecewise-cuda-graph-tokens must be token counts >= 1 in ascending order; got [{', '.join(bad)}]"
        )


def test_hybrid_state_flags_of_vllm_and_sglang(capsys):
    engine, _ = parse([], environ={})
    assert (engine.mamba_cache_mode, engine.mamba_ssm_cache_dtype) == ("align", "auto")
    engine, _ = parse(["--mamba-cache-mode", "none", "--mamba-ssm-dtype", "float32"], environ={})
    assert (engine.mamba_cache_mode, engine.mamba_ssm_cache_dtype) == ("none", "float32")
    engine, _ = parse(["--max-mamba-cache-size", "64"], environ={})
    assert engine.max_mamba_cache_size == 64
    engine, _ = parse(
        ["--mamba-cache-dtype", "float32"], environ={}
    )  # vLLM's: the conv state (and the ssm's)
    assert (engine.mamba_cache_dtype, engine.mamba_ssm_cache_dtype) == ("float32", "auto")
    # SGLang's Qwen3-Next / Qwen3.5 launch lines as its own tests write them
    engine, _ = parse(["--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", "128",
                       "--mamba-ssm-dtype", "bfloat16", "--max-mamba-cache-size", "160"], environ={})  # fmt: skip
    assert (engine.mamba_scheduler_strategy, engine.mamba_track_interval) == ("extra_buffer", 128)
    engine, _ = parse(["--linear-attn-backend", "flashinfer", "--mamba-backend", "triton"], environ={})
    assert (engine.linear_attn_backend, engine.mamba_backend, engine.linear_attn_decode_backend) == (
        "flashinfer",
        "triton",
        None,
    )
    with pytest.raises(SystemExit):
        parse(["--mamba-scheduler-strategy", "ping_pong"], environ={})
    assert "invalid choice: 'ping_pong'" in capsys.readouterr().err
    engine, _ = parse(["--mamba-full-memory-ratio", "0.9"], environ={})  # SGLang's launch lines for Qwen3.5
    assert engine.mamba_full_memory_ratio == 0.9 and parse([], environ={})[0].mamba_full_memory_ratio is None
    with pytest.raises(SystemExit):
        parse(["--mamba-cache-mode", "all"], environ={})  # vLLM's state at every block: not offered
    assert "invalid choice: 'all'" in capsys.readouterr().err
