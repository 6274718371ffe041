"""The engine's per-step outputs are made lazily (engine_outputs.py): each one must read, whenever it is
read, as the step that made it saw the request. Per completion: the new token ids of the steps concatenate
to the final token ids, the new texts to the final text, logprobs line up with the tokens, and an output
read after later steps still shows its own step; n > 1 siblings and a stop string included."""

from __future__ import annotations

import pytest

from longserve import LLM, SamplingParams
from longserve.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return LLM(path, dtype="float32", device="cpu", max_total_tokens=4096).engine


def run(engine, params_list, read_now: bool):
    """Step until every request ends; each step's outputs (with their fields read at once if read_now)."""
    ids = [engine.add_request("Return the value of", p) for p in params_list]
    steps = []
    while engine.has_unfinished():
        outs = engine.step()
        if read_now:
            snapshot = [(o.request_id, o.finished, [_fields(c) for c in o.outputs]) for o in outs]
        steps.append(snapshot if read_now else outs)
    if not read_now:  # read every output only now: each must still show its own step
        steps = [
            [(o.request_id, o.finished, [_fields(c) for c in o.outputs]) for o in outs] for outs in steps
        ]
    return ids, steps


def _fields(c):
    return (c.index, c.token_ids, c.new_token_ids, c.text, c.new_text, c.logprobs, c.cumulative_logprob,
            c.finish_reason)  # fmt: skip


PARAMS = [
    SamplingParams(max_new_tokens=20, temperature=0.8, seed=1, ignore_eos=True, n=2, logprobs=2),
    SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=0.9, seed=3, ignore_eos=True, stop=["e"]),  # eager text
]


def test_outputs_concatenate_to_the_final_output_read_now_or_late(engine):
    ids, now = run(engine, PARAMS, read_now=True)
    ids2, late = run(engine, PARAMS, read_now=False)
    rename = dict(zip(ids2, ids))
    assert [[(rename[r], f, c) for r, f, c in step] for step in late] == now
    for rid in ids:
        per_index: dict[int, list] = {}
        for step in now:
            for r, finished, comps in step:
                if r == rid:
                    for c in comps:
                        per_index.setdefault(c[0], []).append((finished, c))
        assert per_index
        for seq in per_index.values():
            final = seq[-1][1]
            assert seq[-1][0] and final[7] is not None
            index, token_ids, _, text, _, logprobs, cumulative, _ = final
            assert [t for _, c in seq for t in c[2]] == token_ids
            assert "".join(c[4] for _, c in seq) == text
            for _, c in seq:  # each step's lists are prefixes of the final ones
                assert token_ids[: len(c[1])] == c[1] and text.startswith(c[3])
            if logprobs is not None:
                assert len(logprobs) == len(token_ids) and cumulative == pytest.approx(sum(logprobs))
    engine.check_integrity()


def test_text_equals_a_full_decode_without_stop_strings(engine):
    _, steps = run(engine, PARAMS[:2], read_now=False)
    finals = [c for step in steps for _, finished, comps in step if finished for c in comps]
    assert len(finals) == 3
    for c in finals:
        assert c[3] == engine.tokenizer.decode(c[1], skip_special_tokens=True)


@pytest.mark.parametrize("caching", [False, True])
def test_page_rows_follow_the_page_ids(tmp_path, monkeypatch, caching):
    # build_step keeps each request's page table as an int64 array across steps, taking only appended pages
    # (runner.inputs.PageRow): every step's rows must equal the requests' page ids then, through preemption
    # and, with the prefix cache, the swap of a page computed twice for the cache's copy (same prompts at once)
    import longserve.runner.model_runner as model_runner
    from longserve.runner.inputs import build_step

    rows_checked = []

    def checked(out):
        step = build_step(out)
        for s, row in zip(out.scheduled, step.page_tables):
            assert row.tolist() == s.request.page_ids
        rows_checked.append(len(step.page_tables))
        return step

    monkeypatch.setattr(model_runner, "build_step", checked)
    path = make_tiny_checkpoint(tmp_path, "llama")
    m = LLM(path, dtype="float32", device="cpu", max_total_tokens=160, page_size=4, chunked_prefill_size=24,
            enable_prefix_caching=caching)  # fmt: skip
    prompt = list(range(20, 60))
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    outs = m.generate([prompt, prompt, prompt[:30] + [7] * 9, prompt, list(range(100, 130))], params)
    assert m.engine.scheduler.num_preemptions > 0 and sum(rows_checked) > 100
    assert outs[0].token_ids == outs[1].token_ids == outs[3].token_ids
    m.engine.check_integrity()
