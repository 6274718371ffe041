"""Grammar engine: every output sampled at random under the token mask parses and validates against its
schema / fullmatches its regex / is one of its choices; bad specs are ValueErrors; the bitmask kernels equal
a plain masked_fill; request dialects map to specs. (Forced tool calls: test_tool_parsers.py.)"""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longserve.structured.grammar import (
    GrammarCompiler,
    GrammarMatcher,
    TokenBitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
)
from longserve.structured.request_formats import grammar_spec_from_request
from longserve.structured.spec import GrammarSpec
from longserve.structured.tool_grammar import tool_call_grammar
from tests.fixtures.finite_schemas import SCALARS, arrays, objects
from tests.fixtures.grammar_sampling import RandomSampler
from tests.fixtures.tool_tokenizer import make_tokenizer

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PADDING = 40  # the model's vocab is larger than the tokenizer's, as with many real checkpoints


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(eos="<|im_end|>")


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, vocab_size=len(tok) + PADDING, stop_token_ids=[tok.eos_token_id, 1])


@pytest.fixture(scope="module")
def sample(tok, compiler):
    return RandomSampler(tok, compiler)


# ---- random JSON schemas
# property names, enum/const values, objects and arrays: the engine tests' (tests/fixtures/finite_schemas.py)


@st.composite
def string_schemas(draw):
    schema: dict = {"type": "string"}
    if draw(st.booleans()):
        lo = draw(st.integers(0, 3))
        schema.update(minLength=lo, maxLength=lo + draw(st.integers(0, 6)))
    elif draw(st.booleans()):
        schema["pattern"] = draw(st.sampled_from(["^[a-z]{1,6}$", "^[0-9]+-[A-Z]$", "^(yes|no)$"]))
    return schema


@st.composite
def integer_schemas(draw):
    schema: dict = {"type": "integer"}
    if draw(st.booleans()):
        lo = draw(st.integers(-1000, 1000))
        schema.update(minimum=lo, maximum=lo + draw(st.integers(0, 2000)))
    return schema


leaves = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "number"}]),
    string_schemas(),
    integer_schemas(),
    st.lists(SCALARS, min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    SCALARS.map(lambda v: {"const": v}),
)


json_schemas = st.recursive(
    leaves,
    lambda kids: st.one_of(
        objects(kids),
        arrays(kids, max_extra=3),
        st.lists(kids, min_size=2, max_size=2).map(lambda a: {"anyOf": a}),
    ),
    max_leaves=6,
)


@SETTINGS
@given(schema=json_schemas, seed=st.integers(0, 2**31))
def test_random_schema_outputs_validate(sample, schema, seed):
    text = sample(GrammarSpec.json_schema(schema), seed)
    jsonschema.validate(json.loads(text), schema)


@SETTINGS
@given(seed=st.integers(0, 2**31))
def test_json_object_outputs_an_object(sample, seed):
    assert isinstance(json.loads(sample(GrammarSpec.json_object(), seed)), dict)


# ---- random regexes (the subset where xgrammar's and Python's syntax mean the same)
atoms = st.sampled_from(["a", "b", "x", "0", r"\d", "[a-c]", "[0-9]", r"\.", "-", " ", "[^ab]", r"\w", "é"])
regexes = st.recursive(
    atoms,
    lambda r: st.one_of(
        st.tuples(r, r).map("".join),
        st.tuples(r, r).map(lambda t: f"({t[0]}|{t[1]})"),
        st.tuples(r, st.sampled_from(["?", "*", "+", "{2}", "{1,3}"])).map(lambda t: f"({t[0]}){t[1]}"),
    ),
    max_leaves=8,
)


@SETTINGS
@given(pattern=regexes, seed=st.integers(0, 2**31))
def test_random_regex_outputs_fullmatch(sample, pattern, seed):
    text = sample(GrammarSpec.regex(pattern), seed)
    assert re.fullmatch(pattern, text), (pattern, text)


@SETTINGS
@given(
    choices=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=5, unique=True),
    seed=st.integers(0, 99),
)
def test_choice_outputs_one_of_the_choices(sample, choices, seed):
    assert sample(GrammarSpec.choice(choices), seed) in choices


@pytest.mark.parametrize(
    "grammar,pattern",
    [
        ('root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+', r"\(\d+(,\d+)*\)"),
        ('start: "ab" NUM\nNUM: /[0-9]{2}/', r"ab\d\d"),
    ],
)
def test_ebnf_and_lark(sample, grammar, pattern):
    spec = GrammarSpec.grammar(grammar)
    assert spec.kind == ("ebnf" if "::=" in grammar else "lark")
    for seed in range(5):
        assert re.fullmatch(pattern, sample(spec, seed))


# ---- compile errors, cache
@pytest.mark.parametrize(
    "spec,reason",
    [
        (GrammarSpec.json_schema({"type": "bogus"}), "bogus"),
        (GrammarSpec.regex("(ab"), "parenthesis"),
        (GrammarSpec.grammar("root ::= undefined_rule"), "undefined_rule"),
        (GrammarSpec.grammar("start: @@"), ""),
        (GrammarSpec.structural_tag({"type": "no_such_format"}), ""),
    ],
)
def test_a_spec_that_cannot_compile_is_a_value_error(compiler, spec, reason):
    with pytest.raises(ValueError, match=f"cannot compile the {spec.kind} constraint: .*{reason}") as err:
        compiler.compile(spec)
    assert ".cc:" not in str(err.value)  # xgrammar's C++ location is not the client's business


@pytest.mark.parametrize(
    "make",
    [
        lambda: GrammarSpec.json_schema("{not json"),
        lambda: GrammarSpec.json_schema([1]),
        lambda: GrammarSpec.regex(""),
        lambda: GrammarSpec.choice([]),
        lambda: GrammarSpec.choice(["a", 1]),
        lambda: GrammarSpec("sql", "x"),
    ],
)
def test_malformed_specs(make):
    with pytest.raises(ValueError):
        make()


def test_equal_constraints_share_a_cache_entry(tok):
    compiler = GrammarCompiler(tok, max_entries=2)
    a = compiler.compile(
        GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    assert (
        compiler.compile(
            GrammarSpec.json_schema('{"type": "object",  "properties": {"x": {"type": "integer"}}}')
        )
        is a
    )
    compiler.compile(GrammarSpec.regex("a+"))
    compiler.compile(GrammarSpec.regex("b+"))  # evicts the least recently used: the schema
    assert not compiler.cached(
        GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    )
    assert compiler.cached(GrammarSpec.regex("a+")) and compiler.cached(GrammarSpec.regex("b+"))


def test_concurrent_compiles_of_one_spec_compile_once(tok, monkeypatch):
    compiler = GrammarCompiler(tok)
    calls, real = [], compiler._compile_uncached

    def slow(spec):
        calls.append(spec)
        time.sleep(0.05)
        return real(spec)

    monkeypatch.setattr(compiler, "_compile_uncached", slow)
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(compiler.compile(GrammarSpec.regex("[ab]+"))))
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 6 and all(r is results[0] for r in results)


# ---- the bitmask on logits
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,rows", [(100, None), (77, [0, 2]), (64, [3])])
def test_bitmask_application_equals_masked_fill(dtype, vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab + 5, generator=gen).to(dtype)  # wider than `vocab`, as padded lm_heads are
    width = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, width), generator=gen, dtype=torch.int64).to(torch.int32)
    covered = min(vocab + 5, 32 * width)  # columns past the bitmask's bits are left alone
    bits = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(covered)] for r in range(4)]
    allowed = torch.ones(4, vocab + 5, dtype=torch.bool)
    allowed[:, :covered] = torch.tensor(bits, dtype=torch.bool)
    masked_rows = torch.zeros(4, 1, dtype=torch.bool)
    masked_rows[rows if rows is not None else slice(None)] = True
    expected = logits.masked_fill(~allowed & masked_rows, float("-inf"))
    for apply in (apply_token_bitmask, apply_token_bitmask_torch):
        got = apply(logits.clone(), bitmask, rows)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bitmask_rows_and_devices(tok, compiler):
    matcher = GrammarMatcher(compiler.compile(GrammarSpec.regex("[0-9]")))
    bitmask = TokenBitmask(3, compiler.vocab_size)
    rows = bitmask.fill({2: matcher})
    assert rows == [2] and bitmask.to_device(3).data_ptr() == bitmask.host.data_ptr()
    assert bitmask.rows_on_device(rows).tolist() == [2]
    with pytest.raises(ValueError, match="same device|copy the bitmask"):
        apply_token_bitmask(torch.zeros(1, 8, device="meta"), bitmask.host)
    logits = torch.zeros(3, compiler.vocab_size)
    apply_token_bitmask(logits, bitmask.to_device(3), rows)
    allowed = {tok.decode([i]) for i in torch.isfinite(logits[2]).nonzero().flatten().tolist()}
    assert allowed and all(re.fullmatch("[0-9]+", t) for t in allowed)
    assert torch.isfinite(logits[:2]).all()  # rows without a grammar are untouched


# ---- request dialects
@pytest.mark.parametrize(
    "fields,expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True},
                }
            },
            GrammarSpec.json_schema({"type": "integer"}),
        ),
        ({"guided_json": '{"type": "string"}'}, GrammarSpec.json_schema({"type": "string"})),
        ({"guided_regex": "a+"}, GrammarSpec.regex("a+")),
        ({"guided_choice": ["yes", "no"]}, GrammarSpec.choice(["yes", "no"])),
        ({"guided_grammar": 'root ::= "a"'}, GrammarSpec("ebnf", 'root ::= "a"')),
        ({"structured_outputs": {"choice": ["a"]}}, GrammarSpec.choice(["a"])),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec.json_object()),
        ({"json_schema": '{"type": "null"}'}, GrammarSpec.json_schema({"type": "null"})),  # SGLang
        ({"ebnf": 'root ::= "b"'}, GrammarSpec("ebnf", 'root ::= "b"')),
        ({"regex": "b*", "guided_decoding_backend": "xgrammar"}, GrammarSpec.regex("b*")),
        (
            {
                "response_format": {
                    "type": "structural_tag",
                    "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                    "triggers": ["<f"],
                }
            },
            GrammarSpec.structural_tag(
                {
                    "type": "triggered_tags",
                    "triggers": ["<f"],
                    "tags": [
                        {
                            "type": "tag",
                            "begin": "<f>",
                            "content": {"type": "json_schema", "json_schema": {}},
                            "end": "</f>",
                        }
                    ],
                }
            ),
        ),
    ],
)
def test_request_dialects(fields, expected):
    assert grammar_spec_from_request(fields) == expected


@pytest.mark.parametrize(
    "fields,match",
    [
        (
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "only one output constraint.*guided_json, guided_regex",
        ),
        ({"response_format": {"type": "xml"}}, "response_format: type must be"),
        ({"guided_choice": "yes"}, "guided_choice: choices must be"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs: set one of"),
        ({"structural_tag": "{oops"}, "structural_tag: not valid JSON"),
    ],
)
def test_request_dialect_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        grammar_spec_from_request(fields)


def test_length_bounded_strings_are_valid_json(compiler):
    """xgrammar 0.2.9 lets raw control characters into strings with minLength/maxLength (its issue #800) and
    admits encoded surrogates (not UTF-8) in every string; the compiler rewrites those classes. Escapes stay
    out of bounded strings, as in xgrammar (allowing them there made mask fills ~100x slower: grammar.py)."""
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 3}, "other": {"type": "string"}},
        "required": ["s"],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    for spec, prefix in (
        (GrammarSpec.json_schema(schema), '{"s": "'),
        (tool_call_grammar("hermes", [tool], "required"), '<tool_call>\n{"name": "f", "arguments": {"s": "'),
    ):
        compiled = compiler.compile(spec)
        raw_control, escaped, plain, too_long = (GrammarMatcher(compiled)._m for _ in range(4))
        assert not raw_control.accept_string(prefix + "a\x0e")
        assert not escaped.accept_string(prefix + '\\"')
        assert plain.accept_string(prefix + 'a é"}')
        assert not too_long.accept_string(prefix + "abcd")
        for at in (prefix, prefix + 'a", "other": "'):  # a bounded string, then a plain one
            assert GrammarMatcher(compiled)._m.accept_string(at + "é")
            assert not GrammarMatcher(compiled)._m.accept_string(at.encode() + b"\xed\xa0\x80")
    # one character exactly: the class stands inside a sequence there, which the rewrite must keep intact
    one = compiler.compile(GrammarSpec.json_schema({"type": "string", "minLength": 1, "maxLength": 1}))
    for text, ok in (
        ('"a"', True),
        ('"é"', True),
        ('"\\t"', False),
        ('""', False),
        ('"",', False),
        ('"ab"', False),
    ):
        m = GrammarMatcher(one)
        assert (m._m.accept_string(text) and m.is_completed) is ok, text
