"""Tensor parallelism on the CPU (gloo): TP=2 (and TP=4, kv heads replicated) greedy tokens equal TP=1 for
every architecture through the public LLM API, with a chunked prompt and a prefix-cache hit; clear
refusals of tp sizes the heads cannot split; a dead worker fails the engine instead of hanging."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from longserve import LLM, SamplingParams
from longserve.distributed import get_tp_group
from longserve.models.decoder import head_layout
from longserve.testing.checkpoints import ARCHS, make_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(shared: int = 40) -> list[list[int]]:
    """Three prompts with a common head (page-aligned prefix hits), the longest spanning several chunks."""
    g = torch.Generator().manual_seed(0)
    head = torch.randint(10, 500, (shared,), generator=g).tolist()
    return [head + torch.randint(10, 500, (n,), generator=g).tolist() for n in (5, 18, 31)]


def run(path: str, **kw) -> tuple[list[list[int]], list[int], int]:
    """(tokens of the batch, tokens of a follow-up that hits the prefix cache, tokens it computed)."""
    ps = prompts()
    with LLM(
        path,
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        page_size=16,
        chunked_prefill_size=16,
        **kw,
    ) as m:
        batch = [o.token_ids for o in m.generate(ps[:2], GREEDY)]
        before = m.engine.runner.num_tokens_computed
        hit = m.generate(ps[2], GREEDY)[0].token_ids
        computed = m.engine.runner.num_tokens_computed - before
        m.engine.check_integrity()
    assert get_tp_group() is None and not dist.is_initialized()  # closed: the group is gone
    return batch, hit, computed


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_greedy_equals_tp1(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen2")
    expected = run(path)
    got = run(path, tensor_parallel_size=2)
    assert got[:2] == expected[:2]
    assert len(set(expected[1])) > 3, "degenerate output: the test would prove little"
    num_prompt = len(prompts()[2])
    assert got[2] == expected[2] < num_prompt + GREEDY.max_new_tokens  # the shared pages were not recomputed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_overlapped_halves_equal_tp1(tmp_path, arch):
    """Steps split in two halves whose all-reduces overlap (a request cut mid-chunk continues in the
    second half over the first as prefix) give TP=1's tokens."""
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen2")
    expected = run(path)
    ps = prompts()
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, chunked_prefill_size=16,
             tp_size=2, tp_overlap_min_tokens=6) as m:  # fmt: skip
        got = [o.token_ids for o in m.generate(ps[:2], GREEDY)]
        assert m.engine.runner.num_overlapped_passes > 0
        m.engine.check_integrity()
    assert got == expected[0]


def test_overlapped_schedule_under_tp_equals_tp1(tmp_path):
    """The overlapped schedule at TP=2: rank 0 sends each step's pending ids to the other rank on the
    device group; greedy and seeded tokens, a stop token mid-batch and a prefix hit equal TP=1's plain
    run, and the steps did overlap."""
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    ps = prompts()
    params = [GREEDY, SamplingParams(max_new_tokens=9, temperature=0.8, seed=4, ignore_eos=True)]
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, chunked_prefill_size=16) as m:
        expected = [o.token_ids for o in m.generate(ps[:2], params)]
        stop = expected[0][5]
        stopped = m.generate(ps[2], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, chunked_prefill_size=16,
             tp_size=2, overlap_schedule=True) as m:  # fmt: skip
        assert m.engine.overlap
        gathered = []
        launch = m.engine.runner.launch

        def counting(step, prev=None, early=None):
            result = launch(step, prev, early)
            gathered.append(prev is not None)
            return result

        m.engine.runner.launch = counting
        got = [o.token_ids for o in m.generate(ps[:2], params)]
        got_stopped = m.generate(
            ps[2], SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
        )
        assert sum(gathered) > 10  # steps launched before the one before was read
        m.engine.check_integrity()
    assert got == expected
    assert got_stopped[0].token_ids == stopped[0].token_ids and got_stopped[0].finish_reason == "stop"


def test_split_step():
    from longserve.runner.inputs import StepInputs, split_step

    step = StepInputs(
        input_ids=[1, 2, 3, 4, 5, 6, 7], positions=[10, 11, 12, 3, 4, 5, 6], prefix_lens=[10, 3],
        query_lens=[3, 4], page_tables=[[7, 8], [9]], logits_indices=[2, 6],
    )  # fmt: skip
    a, b = split_step(step, 5)
    assert (a.input_ids, a.positions, a.prefix_lens, a.query_lens, a.page_tables) == (
        [1, 2, 3, 4, 5], [10, 11, 12, 3, 4], [10, 3], [3, 2], [[7, 8], [9]]
    )  # fmt: skip
    assert (b.input_ids, b.positions, b.prefix_lens, b.query_lens, b.page_tables) == (
        [6, 7], [5, 6], [5], [2], [[9]]
    )  # fmt: skip
    a, b = split_step(step, 3)  # at a request boundary
    assert (a.query_lens, b.prefix_lens, b.query_lens) == ([3], [3], [4])


def test_dummy_weights_do_not_depend_on_tp(tmp_path):
    """--load-format dummy draws each parameter's whole tensor: TP=2 is the same model as TP=1 (so
    benchmarks at tp > 1 run the model a tp=1 run does), and different seeds give different models."""
    path = make_tiny_checkpoint(tmp_path, "qwen2", tie_word_embeddings=True)
    expected = run(path, load_format="dummy")
    assert run(path, load_format="dummy", tp_size=2)[:2] == expected[:2]
    assert run(path, load_format="dummy", seed=1)[:2] != expected[:2]


def test_tp4_replicates_kv_heads(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")  # 4 heads, 2 kv heads: each kv head on two ranks
    assert run(path, tp_size=4)[:2] == run(path)[:2]


def test_head_layout():
    assert [head_layout(4, 2, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert [(h.q_start, h.num_q, h.kv_start, h.num_kv) for h in (head_layout(8, 4, 2, 1),)] == [(4, 4, 2, 2)]
    with pytest.raises(ValueError, match="one must divide the other"):
        head_layout(12, 4, 6, 0)


@pytest.mark.parametrize("tp", [3, 8])
def test_bad_tp_size_is_refused(tmp_path, tp):
    path = make_tiny_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match=f"tp_size={tp} does not divide the model's 4 attention heads"):
        LLM(path, device="cpu", tp_size=tp)
    assert get_tp_group() is None and not dist.is_initialized()
    with pytest.raises(ValueError, match="tp_size must be an integer >= 1"):
        LLM(path, device="cpu", tp_size=0)


def test_dead_worker_fails_the_engine_and_close_stops_workers(tmp_path, caplog):
    path = make_tiny_checkpoint(tmp_path, "llama")
    m = LLM(path, dtype="float32", device="cpu", max_total_tokens=1024, tp_size=2)
    workers = m.engine.runner.workers
    assert m.generate([5, 6, 7], GREEDY)[0].token_ids  # healthy
    (proc,) = workers.procs
    with caplog.at_level(logging.ERROR, logger="longserve.runner.tp_workers"):
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
            m.generate([5, 6, 7], GREEDY)
        assert time.monotonic() - start < 5
    assert "tensor-parallel rank 1" in caplog.text
    m.close()
    m.close()  # idempotent
    assert get_tp_group() is None and not dist.is_initialized()


def test_close_terminates_workers(tmp_path, monkeypatch):
    """close() stops the workers cleanly and removes the rendezvous directory the ranks met in (one node: a file
    in a temporary directory, not a port found free and bound later, which another process could take first)."""
    import tempfile

    path = make_tiny_checkpoint(tmp_path / "model", "qwen3")
    rendezvous_root = tmp_path / "tmp"
    rendezvous_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(rendezvous_root))
    m = LLM(path, dtype="float32", device="cpu", max_total_tokens=1024, tp_size=2)
    procs = list(m.engine.runner.workers.procs)
    assert all(p.is_alive() for p in procs)
    assert [d.name.startswith("longserve-tp-") for d in rendezvous_root.iterdir()] == [True]
    m.close()
    assert all(p.exitcode == 0 for p in procs)  # a clean exit on the shutdown message, not a kill
    assert list(rendezvous_root.iterdir()) == []


def test_worker_dying_at_start_fails_fast_with_the_reason(tmp_path):
    """A script that builds a TP engine at top level (no __main__ guard) kills its spawned worker while
    it imports the script: rank 0 must not wait in the rendezvous but fail at once, saying why."""
    import subprocess
    import sys

    path = make_tiny_checkpoint(tmp_path, "llama")
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from longserve import LLM\n"
        f"LLM({str(path)!r}, device='cpu', dtype='float32', max_total_tokens=1024, tp_size=2)\n"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode != 0
    assert "exited with code 1 while starting" in proc.stderr
    assert "if __name__ == '__main__':" in proc.stderr
    assert time.monotonic() - start < 60


def test_warm_up_runs_on_every_rank_and_changes_nothing(tmp_path):
    """The start-up warm-up (runner/warm_up.py) as a GPU server runs it: rank 0 sends the other rank a
    WarmUp on the step channel and both run the same forward passes (their all-reduces pair up, or this
    hangs); it writes no page but the reserved page 0, and the tokens after it equal TP=1's."""
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    expected = run(path)
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=2048, page_size=16, chunked_prefill_size=16,
             tp_size=2) as m:  # fmt: skip
        runner = m.engine.runner
        for t in (*runner.kv_cache.k, *runner.kv_cache.v):
            t[1:].normal_()
        before = [t[1:].clone() for t in (*runner.kv_cache.k, *runner.kv_cache.v)]
        computed = runner.num_tokens_computed
        runner.warm_up(counts=[7, 33])
        assert runner.num_tokens_computed == computed  # not steps: no step counted
        assert all(torch.equal(b, t[1:]) for b, t in zip(before, (*runner.kv_cache.k, *runner.kv_cache.v)))
        got = [o.token_ids for o in m.generate(prompts()[:2], GREEDY)]
        m.engine.check_integrity()
    assert got == expected[0]
