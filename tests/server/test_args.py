"""The flag resolver: SGLang and vLLM spellings onto one config, precedence flag > env > file > default,
attention backend names of other engines, clear refusals (a tp size the heads cannot split, unknown keys, bad values), --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longserve.server.args import OPTIONS, build_parser, parse
from tests.server.conftest import REPO

SGLANG = (
    "--model-path {m} --host 0.0.0.0 --port 30000 --tp-size 1 --mem-fraction-static 0.8 --context-length 131072 "
    "--chunked-prefill-size 8192 --attention-backend flashinfer --enable-prefix-caching --device cpu"
)
VLLM = (
    "--model {m} --port 8000 --max-model-len 131072 --max-num-batched-tokens 8192 --enable-prefix-caching "
    "--gpu-memory-utilization 0.8 --device cpu"
)


@pytest.fixture(scope="module")
def m(tiny_model):
    return tiny_model


def test_sglang_and_vllm_spellings_agree(m):
    eng_s, srv_s = parse(SGLANG.format(m=m).split(), environ={})
    eng_v, srv_v = parse(VLLM.format(m=m).split(), environ={})
    for eng in (eng_s, eng_v):
        assert eng.model == m and eng.context_length == 131072 and eng.chunked_prefill_size == 8192
        assert eng.mem_fraction_static == 0.8 and eng.enable_prefix_caching and eng.device == "cpu"
    assert eng_s.attention_backend == "torch"  # flashinfer -> triton -> torch on the CPU
    assert (srv_s.host, srv_s.port, srv_v.host, srv_v.port) == ("0.0.0.0", 30000, "127.0.0.1", 8000)


def test_defaults_bind_loopback(m):
    eng, srv = parse(["--model", m], environ={})
    assert srv.host == "127.0.0.1" and srv.port == 30000 and srv.api_key is None
    assert eng.enable_prefix_caching and eng.tp_size == 1


@pytest.mark.parametrize(
    "flags,field,value",
    [
        (["--disable-radix-cache"], "enable_prefix_caching", False),
        (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
        (["--enforce-eager"], "enforce_eager", True),
        (["--disable-cuda-graph"], "enforce_eager", True),
        (["--max-num-seqs", "7"], "max_running_requests", 7),
        (["--max-running-requests", "7"], "max_running_requests", 7),
        (["--block-size", "32"], "page_size", 32),
        (["--dtype", "half"], "dtype", "float16"),
        (["--attention-backend", "torch_native"], "attention_backend", "torch"),
        (["--attention-backend", "fa3"], "attention_backend", "torch"),  # CPU
        (["--load-format", "dummy"], "load_format", "dummy"),
    ],
)
def test_aliases(m, flags, field, value):
    eng, _ = parse(["--model-path", m, "--device", "cpu", *flags], environ={})
    assert getattr(eng, field) == value


def test_precedence_flag_env_file_default(m, tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        f"model-path: {m}\npage_size: 32\nport: 9000\nmax-num-seqs: 5\ndisable-radix-cache: true\n"
    )
    env = {"LONGSERVE_PORT": "9100", "LONGSERVE_MAX_RUNNING_REQUESTS": "6", "LONGSERVE_API_KEY": "k"}
    eng, srv = parse(["--config", str(cfg), "--max-num-seqs", "4"], environ=env)
    assert eng.max_running_requests == 4  # flag over env over file
    assert srv.port == 9100 and srv.api_key == "k"  # env over file
    assert eng.page_size == 32 and not eng.enable_prefix_caching  # file over default
    assert eng.chunked_prefill_size == 8192  # default


def test_refusals(m, tmp_path):
    with pytest.raises(ValueError, match="tp_size=3 does not divide the model's 4 attention heads"):
        parse(["--model-path", m, "--tp-size", "3"], environ={})
    eng, _ = parse(
        ["--model-path", m, "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h:5000"],
        environ={},
    )
    assert (eng.tp_size, eng.nnodes, eng.node_rank, eng.dist_init_addr) == (2, 2, 1, "h:5000")
    with pytest.raises(ValueError, match="needs dist_init_addr"):
        parse(["--model-path", m, "--tp-size", "2", "--nnodes", "2"], environ={})
    from longserve.assets import default_model_path

    assert parse([], environ={})[0].model == default_model_path()  # no model: the embedded default
    with pytest.raises(ValueError, match="unknown attention backend"):
        parse(["--model-path", m, "--attention-backend", "magic"], environ={})
    with pytest.raises(ValueError, match="LONGSERVE_PORT"):
        parse(["--model-path", m], environ={"LONGSERVE_PORT": "eighty"})
    with pytest.raises(ValueError, match="disagree"):
        parse(
            ["--model-path", m],
            environ={"LONGSERVE_MAX_NUM_SEQS": "2", "LONGSERVE_MAX_RUNNING_REQUESTS": "3"},
        )
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle-path: x\n")
    with pytest.raises(ValueError, match="unknown option 'modle-path'"):
        parse(["--config", str(bad)], environ={})
    with pytest.raises(FileNotFoundError, match="does not exist"):
        parse(["--model-path", str(tmp_path / "nope")], environ={})
    with pytest.raises(
        ValueError, match="step_log: the folder of .* does not exist"
    ):  # before the model loads
        parse(["--model-path", m, "--step-log", str(tmp_path / "nope" / "steps.jsonl")], environ={})
    _, server = parse(["--model-path", m], environ={"LONGSERVE_STEP_LOG": str(tmp_path / "steps.jsonl")})
    assert server.step_log == str(tmp_path / "steps.jsonl")


def test_schedule_policy_spellings(m):
    for flags, policy in (
        ([], "short-first"),
        (["--schedule-policy", "fcfs"], "fcfs"),
        (["--scheduling-policy", "fcfs"], "fcfs"),  # vLLM's spelling
        (["--schedule-policy", "lpm"], "short-first"),  # SGLang's longest-prefix-match
    ):
        assert parse(["--model-path", m, *flags], environ={})[0].schedule_policy == policy, flags
    assert (
        parse(["--model-path", m], environ={"LONGSERVE_SCHEDULE_POLICY": "fcfs"})[0].schedule_policy == "fcfs"
    )
    with pytest.raises(ValueError, match="'dfs-weight': expected short-first, fcfs, or lpm"):
        parse(["--model-path", m], environ={"LONGSERVE_SCHEDULE_POLICY": "dfs-weight"})
    r = subprocess.run(
        [sys.executable, "-m", "longserve", "serve", "--schedule-policy", "random"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "'random': expected short-first, fcfs, or lpm" in r.stderr


def test_help_documents_every_flag():
    text = build_parser().format_help()
    for opt in OPTIONS:
        for flag in opt.flags:
            assert flag in text, flag
    assert "--config" in text


def test_cli_serve_help_and_tp_refusal(m):
    out = subprocess.run(
        [sys.executable, "-m", "longserve", "serve", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0 and "--tensor-parallel-size" in out.stdout and "--max-model-len" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "longserve", "serve", "--model-path", m, "--tp-size", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "tp_size=3 does not divide" in out.stderr
