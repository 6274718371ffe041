"""End to end on CPU: the offline LLM API against HF transformers, and every scheduling path against
the plain one (cache on/off, chunk sizes, preemption, batching) with exact greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.engine_checks import PromptTooLongError
from longserve.testing.checkpoints import make_tiny_checkpoint

# LONGSERVE_TEST_DEVICE=cuda runs the same checks on a GPU (the transformers reference stays on the CPU)
DEVICE = os.environ.get("LONGSERVE_TEST_DEVICE", "cpu")
ARCHS = ["llama", "llama31", "mistral", "qwen2", "qwen3"]
GREEDY32 = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def prompts(n=4, shared=40, seed=0):
    """Token-id prompts of mixed lengths; the first `shared` tokens are common to all."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(10, 500, (shared,), generator=g).tolist()
    return [head + torch.randint(10, 500, (5 + 13 * i,), generator=g).tolist() for i in range(n)]


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEVICE)
    kw.setdefault("max_total_tokens", 4096)
    return LLM(path, **kw)


def hf_greedy(path, ids, n):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = (
        None  # like ignore_eos: exactly n tokens (None alone is merged away)
    )
    cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=0, do_sample=False, pad_token_id=0)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return out[0, len(ids) :].tolist()


def assert_clean(engine):
    engine.check_integrity()
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0
    engine.flush_cache()
    assert engine.kv.num_free_pages == engine.kv.num_total_pages  # no page left held


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_transformers(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen2")
    ids = prompts(1, shared=24)[0]
    expected = hf_greedy(path, ids, 32)
    assert len(set(expected)) > 4, "degenerate reference output: the test would prove little"
    engine_llm = llm(path, page_size=16, chunked_prefill_size=16)  # the prompt spans two chunks
    out = engine_llm.generate(ids, GREEDY32)[0]
    assert out.token_ids == expected
    assert out.finish_reason == "length" and out.prompt_tokens == len(ids)
    assert_clean(engine_llm.engine)


def test_text_prompt_and_chat(ckpt):
    m = llm(ckpt)
    out = m.generate("The quick brown fox", GREEDY32)[0]
    ids = m.tokenizer.encode("The quick brown fox")
    assert out.prompt_token_ids == ids and out.token_ids == hf_greedy(ckpt, ids, 32)
    assert out.text == m.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hello there"}]
    chat = m.chat(msgs, GREEDY32)[0]
    templ = m.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert m.tokenizer.decode(chat.prompt_token_ids) == templ
    assert chat.token_ids == m.generate(chat.prompt_token_ids, GREEDY32)[0].token_ids
    # vLLM's prompt dicts (TextPrompt, TokensPrompt), one or a list; anything else in them is refused by name
    as_dicts = m.generate([{"prompt": "The quick brown fox"}, {"prompt_token_ids": ids}], GREEDY32)
    assert [o.token_ids for o in as_dicts] == [out.token_ids] * 2
    assert m.generate({"prompt_token_ids": ids}, GREEDY32)[0].token_ids == out.token_ids
    with pytest.raises(ValueError, match="multi_modal_data not supported"):
        m.generate({"prompt": "a", "multi_modal_data": {}}, GREEDY32)
    assert_clean(m.engine)


def test_chat_template_replaces_the_tokenizers(ckpt, tmp_path):
    """chat_template (--chat-template; a file or the Jinja text) renders every chat instead of the
    tokenizer's template; vLLM's keyword spellings (max_model_len, max_tokens) read as ours."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    msgs = [{"role": "user", "content": "hello there"}]
    for given in (str(path), template):
        m = llm(ckpt, chat_template=given, max_model_len=256)
        out = m.chat(msgs, SamplingParams(max_tokens=2, temperature=0.0))[0]
        assert m.tokenizer.decode(out.prompt_token_ids) == "[user] hello there\n[assistant]"
        assert len(out.token_ids) == 2 and m.engine.context_length == 256
        m.close()


def run_all(path, ps, **kw):
    m = llm(path, **kw)
    outs = m.generate(ps, GREEDY32)
    assert_clean(m.engine)
    return [o.token_ids for o in outs], m.engine


@pytest.fixture(scope="module")
def baseline(ckpt):
    """Each prompt alone, unchunked, no prefix cache."""
    ps = prompts()
    alone = []
    for p in ps:
        toks, _ = run_all(ckpt, [p], enable_prefix_caching=False, chunked_prefill_size=4096)
        alone.append(toks[0])
    return ps, alone


def test_batch_of_mixed_lengths_equals_each_alone(ckpt, baseline):
    ps, alone = baseline
    toks, _ = run_all(ckpt, ps, enable_prefix_caching=False, chunked_prefill_size=4096)
    assert toks == alone


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_unchunked(ckpt, baseline, chunk):
    ps, alone = baseline
    toks, engine = run_all(ckpt, ps, enable_prefix_caching=False, chunked_prefill_size=chunk)
    assert toks == alone


def record_chunks(scheduler) -> list[int]:
    """The new tokens of every request each step schedules from now on, in order (the list fills as it runs)."""
    chunks: list[int] = []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend(x.num_new_tokens for x in out.scheduled)
        return out

    scheduler.schedule = recorded
    return chunks


def test_lone_chunks_equal_unchunked(ckpt, baseline):
    """Each prompt alone in steps of 7 prompt tokens, or 32 while it is all the work (lone_prefill_chunk_size):
    the lone chunks run, and every token is the plain run's."""
    ps, alone = baseline
    m = llm(ckpt, enable_prefix_caching=False, chunked_prefill_size=7, lone_prefill_chunk_size=32)
    chunks = record_chunks(m.engine.scheduler)
    assert [m.generate([p], GREEDY32)[0].token_ids for p in ps] == alone
    assert max(chunks) == 32
    assert_clean(m.engine)


def test_warm_up_out_of_memory_names_the_step_and_the_remedies(ckpt, monkeypatch):
    """A step too large for the memory beside the KV pool fails at start-up with the step's size and the flags
    that shrink it, not with the device's bare error later under load."""
    m = llm(ckpt)
    model = m.engine.runner.model
    forward = type(model).forward

    def short_of_memory(self, input_ids, *args, **kwargs):
        if input_ids.numel() > 32:  # as a device would at a large step
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", short_of_memory)
    m.engine.runner.warm_up(counts=[16, 32])  # fits
    with pytest.raises(RuntimeError, match=r"warm-up ran out of device memory in a step of 64 prompt tokens.*"
                       r"--lone-prefill-chunk-size.*--mem-fraction-static") as e:  # fmt: skip
        m.engine.runner.warm_up(counts=[16, 64])
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    monkeypatch.undo()
    assert len(m.generate([list(range(5, 50))], GREEDY32)[0].token_ids) == 32  # the engine still serves
    assert_clean(m.engine)


def test_chunks_on_a_granule_equal_unchunked(ckpt, baseline, monkeypatch):
    """A backend with a chunk granule (the cuDNN path's 2,048; 16 here) hands it to the scheduler: behind a cached
    prefix of 40 tokens, the next prompt's first chunk ends on the granule (24 of its 32 tokens, to 64), the rest
    follows, and every token is the plain run's."""
    from longserve.attention.base import AttentionBackend

    monkeypatch.setattr(AttentionBackend, "chunk_granule", 16)  # the torch backends' (Triton's is its own)
    ps, alone = baseline
    m = llm(ckpt, attention_backend="torch", page_size=4, chunked_prefill_size=32)
    assert m.engine.scheduler.config.chunk_granule == 16
    assert m.generate([ps[0]], GREEDY32)[0].token_ids == alone[0]
    chunks = record_chunks(m.engine.scheduler)
    out = m.generate([ps[3]], GREEDY32)[0]
    assert out.token_ids == alone[3] and out.cached_tokens == 40
    assert chunks[:2] == [24, 20]
    assert_clean(m.engine)


def test_prefix_cache_on_equals_off(ckpt, baseline):
    ps, alone = baseline
    m = llm(ckpt, enable_prefix_caching=True, page_size=4)
    first = [o.token_ids for o in m.generate(ps, GREEDY32)]
    again = m.generate(ps, GREEDY32)  # now every prompt is cached
    assert first == alone and [o.token_ids for o in again] == alone
    assert all(o.cached_tokens >= len(p) - 4 for o, p in zip(again, ps))
    assert_clean(m.engine)


def test_forced_preemption_equals_no_preemption(ckpt, baseline):
    ps, alone = baseline
    # 12 pages of 16 tokens cannot hold four requests of 45..84 + 32 tokens at once
    for caching in (False, True):
        toks, engine = run_all(ckpt, ps, enable_prefix_caching=caching, max_total_tokens=192, page_size=16)
        assert engine.scheduler.num_preemptions > 0
        assert toks == alone


def test_cached_prefix_is_not_recomputed(ckpt):
    m = llm(ckpt, page_size=16)
    a = prompts(1, shared=60)[0][:60]
    b = a[:48] + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # shares exactly 3 pages with a
    one = SamplingParams(max_new_tokens=1, temperature=0)
    out_a = m.generate(a, one)[0]
    assert out_a.cached_tokens == 0
    before = m.engine.runner.num_tokens_computed
    out_b = m.generate(b, one)[0]
    assert out_b.cached_tokens == 48
    assert m.engine.runner.num_tokens_computed - before == len(b) - 48
    assert out_b.token_ids == llm(ckpt, enable_prefix_caching=False).generate(b, one)[0].token_ids
    assert_clean(m.engine)


def test_seeded_sampling_is_reproducible(ckpt):
    m = llm(ckpt)
    p = prompts(1)[0]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a = m.generate(p, sp)[0].token_ids
    b = m.generate([p, prompts(2, seed=5)[1]], [sp, SamplingParams(max_new_tokens=5, temperature=1.0)])[
        0
    ].token_ids
    c = m.generate(p, sp.clone(seed=124))[0].token_ids
    assert a == b, "the same seed gives the same tokens, whatever else is in the batch"
    assert a != c


def test_stop_strings_and_stop_ids(ckpt):
    m = llm(ckpt)
    p = "Once upon a time"
    ref = m.generate(p, GREEDY32)[0]
    assert len(ref.text) > 12
    stop = ref.text[6:10]
    idx = ref.text.find(stop)
    out = m.generate(p, GREEDY32.clone(stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == ref.text[:idx] and stop not in out.text
    assert out.outputs[0].stop_reason == stop
    stop_id = ref.token_ids[5]
    k = ref.token_ids.index(stop_id)
    out = m.generate(p, GREEDY32.clone(stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: k + 1]
    assert out.outputs[0].stop_reason == stop_id
    # min_new_tokens bans the stop id until it is reached
    out = m.generate(p, GREEDY32.clone(stop_token_ids=[stop_id], min_new_tokens=k + 2))[0]
    assert stop_id not in out.token_ids[: k + 2]


def test_eos_ends_generation_unless_ignored(ckpt):
    m = llm(ckpt)
    p = prompts(1)[0]
    ref = m.generate(p, GREEDY32)[0].token_ids
    eos = ref[3]
    m.engine.eos_token_ids = frozenset([eos])  # pretend that token is the eos
    out = m.generate(p, SamplingParams(max_new_tokens=32, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(eos) + 1]
    assert m.generate(p, GREEDY32)[0].token_ids == ref


def test_n_siblings_share_the_prompt(ckpt):
    m = llm(ckpt, page_size=8)
    p = prompts(1, shared=40)[0]  # 45 tokens
    before = m.engine.runner.num_tokens_computed
    sp = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    out = m.generate(p, sp)[0]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    computed = m.engine.runner.num_tokens_computed - before
    # the prompt once, then each sibling only its last partial page (45 = 5*8 + 5) and 6 decode steps
    assert computed == len(p) + 2 * 5 + 3 * 5
    assert_clean(m.engine)


def test_n_siblings_fork_the_prompt_without_the_prefix_cache(ckpt):
    """With prefix caching off, the siblings take the leader's full prompt pages by fork: the same work."""
    m = llm(ckpt, page_size=8, enable_prefix_caching=False)
    assert m.engine.kv.siblings_fork
    p = prompts(1, shared=40)[0]  # 45 tokens
    before = m.engine.runner.num_tokens_computed
    sp = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    out = m.generate(p, sp)[0]
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 6 for o in out.outputs)
    assert m.engine.runner.num_tokens_computed - before == len(p) + 2 * 5 + 3 * 5
    assert m.engine.stats().num_cached_pages == 0
    assert_clean(m.engine)


def test_short_first_answers_a_short_request_during_a_long_prefill(ckpt):
    """A short prompt that arrives while a long one is prefilled in 64-token chunks gets its first token in
    the next step with the short-first policy (after every chunk with fcfs); both policies give the same
    greedy tokens, and the long prompt loses one step."""
    long_prompt = torch.randint(10, 500, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    short_prompt = [11, 12, 13, 14, 15, 16, 17]  # 7 tokens <= 64 // 8
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    first_token_step, tokens = {}, {}
    for policy in ("fcfs", "short-first"):
        # steps counted as the scheduler plans them: the overlapped engine reports each a call later
        engine = llm(ckpt, chunked_prefill_size=64, schedule_policy=policy, overlap_schedule=False).engine
        long_id = engine.add_request(long_prompt, sp)
        engine.step()
        short_id = engine.add_request(short_prompt, sp)
        steps, firsts, outs = 1, {}, {}
        while engine.has_unfinished():
            steps += 1
            for out in engine.step():
                if out.outputs[0].token_ids:
                    firsts.setdefault(out.request_id, steps)
                outs[out.request_id] = out.outputs[0].token_ids
        first_token_step[policy] = (firsts[short_id], firsts[long_id])
        tokens[policy] = (outs[short_id], outs[long_id])
        assert_clean(engine)
    assert first_token_step["fcfs"] == (7, 7)  # 400 tokens = 7 chunks of 64 (the short one rides along)
    assert first_token_step["short-first"] == (2, 8)
    assert tokens["fcfs"] == tokens["short-first"]


def test_string_prompts_over_one_document_reuse_its_tokens(ckpt):
    """A batch of questions over one long document and a chat's next turn: the engine's prompt ids are
    transformers' (encode, apply_chat_template) while each prompt after the first re-uses cached tokens."""
    from longserve.tokenization.tokenizer import apply_chat_template

    m = llm(ckpt, context_length=8192, max_total_tokens=32768)  # past the tiny model's 512 positions
    tok = m.engine.tokenizer
    g = torch.Generator().manual_seed(3)
    words = ["the", "cat", "sat", "on", "a", "mat", "1234", ",", ".", "\n", "hello", "world"]
    doc = " ".join(words[i] for i in torch.randint(0, len(words), (1200,), generator=g).tolist())
    questions = [f" Question {i}: what did the cat do {i * 37}?" for i in range(5)]
    outs = m.generate([doc + q for q in questions], SamplingParams(max_new_tokens=1))
    for out, q in zip(outs, questions):
        assert out.prompt_token_ids == list(tok.encode(doc + q))
    cache = m.engine.prompts.cache
    assert cache.misses == 1 and cache.hits == len(questions) - 1
    chat = [{"role": "user", "content": doc}]
    first = m.chat(chat, SamplingParams(max_new_tokens=1))[0]
    chat += [{"role": "assistant", "content": "sure"}, {"role": "user", "content": "and then?"}]
    second = m.chat(chat, SamplingParams(max_new_tokens=1))[0]
    assert first.prompt_token_ids == apply_chat_template(tok, chat[:1])
    assert second.prompt_token_ids == apply_chat_template(tok, chat)
    assert cache.hits == len(questions)  # the second turn re-used the first
    assert_clean(m.engine)


def test_abort_releases_pages(ckpt):
    m = llm(ckpt, chunked_prefill_size=8)
    engine = m.engine
    rid = engine.add_request(prompts(1)[0], GREEDY32)
    engine.step()
    engine.step()
    assert engine.kv.num_free_pages < engine.kv.num_total_pages
    final = engine.abort(rid)
    assert final.finished and final.finish_reason == "abort"
    assert_clean(engine)


def test_stats_is_a_snapshot_of_queues_pages_and_prefix_hits(ckpt):
    """Engine.stats(): what the server's /server_info and metrics read, agreeing with the engine's parts."""
    engine = llm(ckpt, page_size=16, chunked_prefill_size=16).engine
    idle = engine.stats()
    assert (idle.num_running, idle.num_waiting, idle.num_unfinished_requests) == (0, 0, 0)
    assert idle.page_size == 16 and idle.num_free_pages == idle.num_total_pages > 0
    assert (idle.num_used_pages, idle.num_cached_pages, idle.kv_usage) == (0, 0, 0.0)
    assert idle.max_total_num_tokens == 16 * idle.num_total_pages
    a = prompts(1, shared=60)[0][:60]
    engine.add_request(a, SamplingParams(max_new_tokens=2, temperature=0), request_id="a")
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, temperature=0), request_id="b")
    engine.step()  # a's first 16-token chunk fills the budget: b waits
    busy = engine.stats()
    assert (busy.num_running, busy.num_waiting, busy.num_unfinished_requests) == (1, 1, 2)
    assert busy.num_used_pages == 1 == busy.num_cached_pages  # the computed page is cached and still held
    assert busy.kv_usage == 1 / busy.num_total_pages and busy.num_prefix_query_tokens == 60
    with pytest.raises(AttributeError):
        busy.num_running = 0  # frozen: a snapshot, not a view
    while engine.has_unfinished():
        engine.step()
    engine.add_request(a[:48] + [7, 8, 9], SamplingParams(max_new_tokens=1, temperature=0), request_id="c")
    while engine.has_unfinished():
        engine.step()
    done = engine.stats()
    assert done.num_prefix_query_tokens == 60 + 3 + 51 and done.num_prefix_hit_tokens == 48
    assert (done.num_running, done.num_waiting, done.num_unfinished_requests) == (0, 0, 0)
    assert done.num_used_pages == 0 and done.num_cached_pages == done.num_reclaimable_cached_pages > 0
    assert done.num_cached_pages == done.num_total_pages - done.num_free_pages
    assert done.num_cached_pages == engine.flush_cache() and engine.stats().num_cached_pages == 0
    assert_clean(engine)


def test_text_without_a_tokenizer_is_refused_naming_load_format(ckpt, tmp_path):
    """Dummy weights over a directory with only config.json serve token ids; a text prompt is refused with
    the setting named (`load_format='dummy'` in Python, `--load-format dummy` on a command line)."""
    import shutil

    from longserve.config import ConfigError
    from longserve.server.args import cli_message

    shutil.copy(os.path.join(ckpt, "config.json"), tmp_path / "config.json")
    m = llm(str(tmp_path), load_format="dummy")
    assert len(m.generate([5, 6, 7], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    with pytest.raises(ConfigError, match=r"\(load_format='dummy' without tokenizer files\)") as exc:
        m.generate("Hello", SamplingParams(max_new_tokens=2))
    assert "(--load-format dummy without tokenizer files)" in cli_message(exc.value)
    assert_clean(m.engine)


def test_prompt_longer_than_context_is_refused(ckpt):
    m = llm(ckpt, context_length=64)
    with pytest.raises(PromptTooLongError, match=r"prompt has 80 tokens; the context length is 64"):
        m.generate(list(range(1, 81)), GREEDY32)
    out = m.generate(list(range(1, 41)), SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True))[
        0
    ]
    assert out.finish_reason == "length" and out.prompt_tokens + len(out.token_ids) == 64
    assert_clean(m.engine)


def test_bad_token_ids_are_refused_and_nothing_is_queued(ckpt):
    import numpy as np

    m = llm(ckpt)
    vocab = m.engine.runner.model.vocab_size
    for bad, shown in (([5, 2.5], "2.5"), ([5, "a"], "'a'"), ([5, None], "None"), ([-1, 5], "-1"),
                       ([5, vocab], str(vocab)), ([5, 2**70], str(2**70))):  # fmt: skip
        with pytest.raises(ValueError, match=rf"integers in \[0, {vocab}\); got \[{shown}\]"):
            m.engine.add_request(bad, GREEDY32)
        assert not m.engine.has_unfinished()
    ok = [8, np.int64(7), True, vocab - 1]  # numpy ints and bools are ints
    assert m.generate(ok, SamplingParams(max_new_tokens=2))[0].prompt_tokens == 4
    assert_clean(m.engine)


def test_bfloat16_runs(ckpt):
    m = llm(ckpt, dtype="bfloat16")
    assert next(m.engine.runner.model.parameters()).dtype == torch.bfloat16
    out = m.generate(prompts(1)[0], GREEDY32)[0]
    assert len(out.token_ids) == 32


def test_context_length_beyond_the_pool_is_refused(ckpt):
    with pytest.raises(
        ValueError, match=r"context_length=1,000 cannot fit: the KV pool holds only 256 tokens"
    ):
        llm(ckpt, context_length=1000, max_total_tokens=256)
    m = llm(ckpt, max_total_tokens=256)  # no explicit context length: capped to the pool
    assert m.engine.context_length == 256


def test_pool_sized_by_memory_fraction(ckpt):
    fraction = 0.9
    # on a GPU other test processes share (gpu_check.sh tests runs five): ~2 GiB past what is in use, not 90% of it
    # (0.9 took 58 GB of an H100 and another process's allocation failed, 2026-12-06)
    if DEVICE == "cuda":
        free, total = torch.cuda.mem_get_info()
        fraction = min(0.9, (total - free + 2 * 2**30) / total)
    m = llm(ckpt, max_total_tokens=None, mem_fraction_static=fraction)
    runner = m.engine.runner
    assert runner.num_pages >= 1 and runner.kv_cache.k[0].shape[0] == runner.num_pages + 1
    assert m.generate(prompts(1)[0], GREEDY32)[0].finish_reason == "length"
    with pytest.raises(RuntimeError, match="no memory left for the KV pool.*raise mem_fraction_static"):
        llm(ckpt, max_total_tokens=None, mem_fraction_static=0.0001)


def _run_all(engine, requests):
    """Add (rid, prompt, params) requests together and step until all end; rid -> final output."""
    for rid, ids, params in requests:
        engine.add_request(ids, params, rid)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("stage", ["setup", "sampling"])
def test_a_request_whose_own_sampling_fails_ends_alone(ckpt, monkeypatch, stage):
    """One request's own failure (its sampling setup, or its row of a batched sampling call) ends that
    request with an internal error; the others in the same steps produce exactly their plain tokens."""
    m = llm(ckpt)
    engine = m.engine
    batch = prompts(4)
    plain = _run_all(engine, [(f"r{i}", ids, GREEDY32) for i, ids in enumerate(batch)])
    seeded = SamplingParams(max_new_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    plain_seeded = _run_all(engine, [("s", batch[0], seeded)])["s"]

    poison = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True, top_k=3)
    runner = engine.runner
    if stage == "setup":
        real_info = runner.step_sampler.sampling_info

        def info(req, eos):
            if req.request_id == "bad":
                raise RuntimeError("poisoned setup")
            return real_info(req, eos)

        monkeypatch.setattr(runner.step_sampler, "sampling_info", info)
    else:
        real_sampler = runner.step_sampler.sampler

        def sampler(logits, infos, **kw):  # any batch holding the poisoned row raises, as a bad bound would
            if any(i.params.top_k == 3 for i in infos):
                raise RuntimeError("poisoned row")
            return real_sampler(logits, infos, **kw)

        monkeypatch.setattr(runner.step_sampler, "sampler", sampler)
    requests = [(f"r{i}", ids, GREEDY32) for i, ids in enumerate(batch)]
    requests += [("bad", batch[1], poison), ("s", batch[0], seeded)]
    finals = _run_all(engine, requests)
    bad = finals["bad"]
    assert bad.finish_reason == "error" and bad.error_internal and "request bad" in bad.error
    assert bad.token_ids == []
    for i in range(len(batch)):
        assert finals[f"r{i}"].error is None and finals[f"r{i}"].token_ids == plain[f"r{i}"].token_ids
    # a seeded request sampled beside the failure draws exactly what it draws alone
    assert finals["s"].token_ids == plain_seeded.token_ids
    assert_clean(engine)


def test_warm_up_passes_stay_within_the_context_and_change_no_output(ckpt):
    """The start-up warm-up (runner/warm_up.py) as a GPU engine runs it, here on this device: forward passes
    at 512, 1024, ... tokens up to a chunk, but never past the context length (the GPU's rotary kernel does
    not bound-check positions: its cos/sin cache covers the context, models/rope.py `reserve`); no page but
    the reserved page 0 is written, and generation afterwards equals a fresh engine's."""
    from longserve.runner.warm_up import warm_up, warm_up_counts

    assert warm_up_counts(8192, 131072) == [512, 1024, 2048, 4096, 8192]
    assert warm_up_counts(8192, 600) == [512, 600] and warm_up_counts(6000, 7000) == [
        512,
        1024,
        2048,
        4096,
        6000,
    ]
    assert warm_up_counts(8192, 300) == [] and warm_up_counts(256, 4096) == []
    ps = prompts()
    with llm(ckpt, context_length=600, chunked_prefill_size=8192) as m:
        expected = [o.token_ids for o in m.generate(ps, GREEDY32)]
    with llm(ckpt, context_length=600, chunked_prefill_size=8192) as m:
        runner = m.engine.runner
        pages = [t[1:].clone() for t in (*runner.kv_cache.k, *runner.kv_cache.v)]
        warm_up(
            runner.model, runner.backend, runner.kv_cache, runner._graph_shape(), 8192
        )  # counts: 512, 600
        assert all(torch.equal(p, t[1:]) for p, t in zip(pages, (*runner.kv_cache.k, *runner.kv_cache.v)))
        assert [o.token_ids for o in m.generate(ps, GREEDY32)] == expected
        m.engine.check_integrity()


@pytest.mark.parametrize("freeze", [True, False])
def test_the_warm_up_freezes_the_start_up_heap_and_close_unfreezes_it(ckpt, monkeypatch, freeze):
    """After the runner's warm-up (a GPU engine's start-up; on the CPU with explicit counts) the objects alive are
    in the collector's permanent generation, so full collections while serving skip them: a reference cycle alive
    at the freeze survives its deletion, one made later is collected, a later start-up's freeze collects what an
    earlier one kept, outputs are unchanged, and closing the engine unfreezes (FREEZE_HEAP off: nothing frozen).
    Told by cycles, not by gc.get_freeze_count(): the GPU machine's Python 3.12 puts a few hundred objects of its own
    in the permanent generation again after gc.unfreeze() (375, traced: no gc.freeze call made them)."""
    import gc
    import weakref

    from longserve.runner import warm_up as warm_up_module

    class Cycle:
        pass

    def cycle() -> tuple[Cycle, weakref.ref]:
        c = Cycle()
        c.me = c
        return c, weakref.ref(c)

    monkeypatch.setattr(warm_up_module, "FREEZE_HEAP", freeze)
    ps = prompts()
    with llm(ckpt, context_length=600) as m:
        runner = m.engine.runner
        assert runner.heap_frozen is (
            freeze and DEVICE == "cuda"
        )  # a GPU engine's start-up warmed up; a CPU's not
        expected = [o.token_ids for o in m.generate(ps, GREEDY32)]
        c, ref = cycle()
        runner.warm_up([512])
        assert runner.heap_frozen is freeze
        del c
        gc.collect()
        assert (ref() is not None) is freeze  # alive at the freeze: not walked, and so not collected
        later, later_ref = cycle()
        del later
        gc.collect()
        assert later_ref() is None  # made after the freeze: collected
        runner.warm_up([512])  # another engine's start-up: unfreezes, collects, freezes again
        assert ref() is None  # the next freeze collects what an earlier one held
        assert [o.token_ids for o in m.generate(ps, GREEDY32)] == expected
        c, ref = cycle()
        runner.warm_up([512])
        del c
    gc.collect()
    assert ref() is None and not runner.heap_frozen  # close unfroze: the cycle frozen alive is collected
