"""Grammar-constrained decoding on xgrammar: compile GrammarSpecs (LRU-cached, thread-safe, meant to run
off the engine thread), match one request's output token by token, and mask logits on their own device.

How the engine uses it each step (the wiring lives in the engine and sampler, not here):
  * once: `compiler = GrammarCompiler(tokenizer, vocab_size=<lm_head rows>, stop_token_ids=<eos ids>)` and
    `bitmask = TokenBitmask(max_num_seqs, vocab_size, device)` (host buffer pinned when CUDA is there).
  * on arrival, off the engine thread: `compiled = compiler.compile(spec)`; a ValueError is the client's
    400. The request then carries `GrammarMatcher(compiled)` (cheap to make).
  * each step, while the GPU runs the forward: `rows = bitmask.fill({row: matcher, ...})` on the host,
    then `mask = bitmask.to_device(num_rows)`: one non-blocking host->device copy, no sync.
  * in the sampler, after the raw logprobs and before bans/penalties/temperature:
    `apply_token_bitmask(logits, mask, bitmask.rows_on_device(rows))`.
  * after sampling, when the token ids reach the host anyway: `matcher.defer_accept(t)` per row (applied
    by the next fill, off the critical path). A stop token is what the grammar allows once complete (and
    only then); accepting it terminates the matcher, and defer_accept applies it at once to say so.
    Once `is_completed` leaves nothing but stop tokens, a ban on them (min_new_tokens, ignore_eos) would
    mask every token: the grammar must win there (finish the request).
Rows left out of `rows` are not touched, so requests without a grammar share the batch at no cost.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from longserve.structured.spec import GrammarSpec, choice_ebnf


class StructuredOutputsUnavailable(RuntimeError):
    """xgrammar, which compiles and enforces every output constraint, does not import on this machine: a request
    asking for one is refused with this (the server's 400 naming the field), the rest keep being served."""


def _xgrammar() -> Any:
    """The xgrammar module, or StructuredOutputsUnavailable saying what failed and how to install it (a server
    installed with `.[server]` alone has no xgrammar; a wheel missing its own dependency fails inside it, as on a GPU
    machine without `apache-tvm-ffi`: "No module named 'tvm_ffi'", which reached the client as a 500)."""
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputsUnavailable(
            f"structured outputs are not available on this server: xgrammar did not import ({e}); "
            "install it: pip install xgrammar (longserve's `structured` extra)"
        ) from e
    return xgrammar


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _reason(err: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(err).strip())


# Two flaws of xgrammar 0.2.9's JSON strings, mended by rewriting the character classes of the printed grammar:
# * a string with minLength/maxLength repeats `[^"\\\r\n]`, which lets raw control characters (invalid
#   JSON) through (xgrammar issue #800);
# * every string class admits the UTF-8 encoding of a surrogate (U+D800-DFFF), which is not valid UTF-8:
#   the text comes out with U+FFFD in its place (and longer than a maxLength allowed).
# Escapes stay out of length-bounded strings, as in xgrammar itself: an escape alternative inside the counted
# repetition (`(char | "\\" escape){0,40}`) made every mask fill re-check most of the vocabulary. Measured on a
# 59K-token BPE vocab with scripts/gpu/bench_structured.py's schema: 2.0-2.8 ms a row on average and up to
# 120 ms (against 0.015-0.023 ms with the plain class), which at batch 64 cost 94% of decode throughput on an
# H200 (2026-12-02, a4e6031: 142.7 against 8.4 ms a step).
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_NO_SURROGATES = r"\ud800-\udfff]"


def _fix_json_strings(ebnf: str) -> str:
    """No raw control characters in bounded strings; no surrogates anywhere (one class for one character,
    so a bounded string's count stays the number of characters the client decodes)."""
    ebnf = ebnf.replace(_STRING_CHAR, _STRING_CHAR[:-1] + _NO_SURROGATES)
    return ebnf.replace(_BOUNDED_STRING_CHAR, r"[^\0-\x1f\"\\" + _NO_SURROGATES)


_JSON_WHITESPACE = r"[ \n\r\t]*"  # how xgrammar prints the whitespace allowed between JSON tokens


def _bound_whitespace(ebnf: str, limit: int | None) -> str:
    """At most `limit` whitespace characters between JSON tokens (0: none), in JSON schemas and in the
    JSON inside structural tags alike (xgrammar's own max_whitespace_cnt covers schemas only and must be
    positive). A small model tends to loop on whitespace where any amount is allowed; a bound makes every
    schema whose values are bounded a finite language, so its output ends."""
    if limit is None:
        return ebnf
    return ebnf.replace(_JSON_WHITESPACE, f"[ \\n\\r\\t]{{0, {limit}}}" if limit else '""')


def _tokenizer_info(tokenizer: Any, vocab_size: int | None, stop_token_ids: Sequence[int] | None) -> Any:
    """xgrammar's view of the vocabulary, with the stop tokens' text blanked. xgrammar treats a token whose
    text it can decode as text even if it is a stop token, so `<|im_end|>` could be taken as 10 characters of
    a regex or JSON string and then end generation short of a complete match. Blank, a token is special to
    xgrammar: never allowed as text, a stop token only where the output is complete."""
    xgr = _xgrammar()

    stops = list(stop_token_ids) if stop_token_ids else None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    encoded = [""] * info.vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < info.vocab_size:
            encoded[idx] = token
    for idx in info.stop_token_ids:
        encoded[idx] = ""
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=info.vocab_type,
        vocab_size=info.vocab_size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer. `compile` is thread-safe; concurrent calls for one spec
    compile it once; the last `max_entries` compiled grammars are kept (least recently used dropped)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_entries: int = 256,
        max_threads: int = 4,
        any_whitespace: bool = True,
        max_whitespace: int | None = None,
    ) -> None:
        """`vocab_size`: the model's (lm_head rows), which may exceed the tokenizer's; ids past the
        tokenizer's are never allowed. `stop_token_ids`: what ends a complete output (all of the model's eos
        ids, e.g. Llama 3.1's three); default the tokenizer's eos. `any_whitespace=False` makes JSON compact,
        which keeps small models from padding whitespace forever; `max_whitespace` bounds each run of
        whitespace between JSON tokens instead (0: none at all; None: no bound, as xgrammar does)."""
        if max_whitespace is not None and (not isinstance(max_whitespace, int) or max_whitespace < 0):
            raise ValueError(f"max_whitespace must be an integer >= 0 or None; got {max_whitespace!r}")
        xgr = _xgrammar()

        info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = info.vocab_size
        self.stop_token_ids = tuple(info.stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_whitespace = max_whitespace
        # xgrammar's own cache is off: this class owns caching, so memory has one bound (max_entries).
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._max_entries = max_entries
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._inflight: dict[GrammarSpec, Future] = {}
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """The xgrammar CompiledGrammar for `spec`; ValueError (with xgrammar's reason) if it cannot compile."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
            future = self._inflight.get(spec)
            owner = future is None
            if owner:
                future = self._inflight[spec] = Future()
        if not owner:
            return future.result()
        try:
            compiled = self._compile_uncached(spec)
        except BaseException as e:
            with self._lock:
                del self._inflight[spec]
            future.set_exception(e)
            raise
        with self._lock:
            del self._inflight[spec]
            self._cache[spec] = compiled
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        future.set_result(compiled)
        return compiled

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return spec in self._cache

    def _compile_uncached(self, spec: GrammarSpec) -> Any:
        xgr = _xgrammar()

        c = self._xgr
        try:
            if spec.kind in ("json_schema", "json_object", "structural_tag"):
                if spec.kind == "structural_tag":
                    grammar = xgr.Grammar.from_structural_tag(spec.text)
                else:
                    grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=self.any_whitespace)
                ebnf = str(grammar)
                fixed = _bound_whitespace(_fix_json_strings(ebnf), self.max_whitespace)
                return c.compile_grammar(fixed if fixed != ebnf else grammar)
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return c.compile_grammar(spec.text)
            if spec.kind == "lark":
                return c.compile_lark(spec.text)
            return c.compile_grammar(choice_ebnf(spec.choices()))
        except (RuntimeError, ValueError, TypeError) as e:
            # pydantic's ValidationError (a bad structural tag) is a ValueError; xgrammar's C++ errors are
            # RuntimeErrors. Either way the client's grammar is at fault.
            raise ValueError(f"cannot compile the {spec.kind} constraint: {_reason(e)}") from None


class GrammarMatcher:
    """One request's position in its grammar.

    `defer_accept` records a sampled token and leaves advancing the matcher to its next use: the next step's
    mask fill, which runs on the host while the device computes that step's forward pass. Advancing 64
    matchers one by one right after the sampled ids arrive was the largest part of what a JSON schema cost
    decode on an H200 (2.17 ms of a 12.2 ms step at batch 64, 2026-12-02, 841eb99; RESULTS.md). Every method
    here applies a deferred token first, so no reader sees a stale position."""

    __slots__ = ("_m", "_pending", "_stops")

    def __init__(self, compiled: Any) -> None:
        xgr = _xgrammar()

        self._m = xgr.GrammarMatcher(compiled)
        self._pending: int | None = None  # a sampled token not yet applied to _m
        self._stops = frozenset(self._m.stop_token_ids)

    def _flush(self) -> None:
        if self._pending is not None:
            token = self._pending
            if not self._m.accept_token(token):  # state unchanged; kept pending, so every later use raises
                raise RuntimeError(f"the grammar refused token {token}, sampled under its mask")
            self._pending = None

    @staticmethod
    def flush_all(matchers: Sequence[GrammarMatcher]) -> None:
        """Apply the deferred tokens of `matchers` in one call into xgrammar; RuntimeError if one refused its
        token (the others are applied; the refusing one keeps it, so its own next use raises alone)."""
        pending = [m for m in matchers if m._pending is not None]
        if not pending:
            return
        xgr = _xgrammar()

        accepted = xgr.BatchGrammarMatcher.batch_accept_token(
            [m._m for m in pending], [m._pending for m in pending]
        )
        for m, ok in zip(pending, accepted):
            if ok:
                m._pending = None
        if not all(accepted):
            raise RuntimeError("a grammar refused a token sampled under its mask")

    def defer_accept(self, token_id: int) -> bool:
        """Take one sampled token; True if it ends the output (a stop token after a complete match: what
        accepting it would report as terminated). Other tokens are applied on the matcher's next use, where
        a token the grammar refuses (a bug: the mask allows only what it accepts) raises RuntimeError."""
        self._flush()
        self._pending = int(token_id)
        if self._pending not in self._stops:
            return False
        self._flush()  # a stop token may terminate the output: applied now, to answer exactly
        return self._m.is_terminated()

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (then the state is
        unchanged: a token sampled under the mask is always allowed, so False means a bug or a row the mask
        was not applied to)."""
        self._flush()
        return self._m.accept_token(int(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into host `bitmask[row]`; False when every token is allowed."""
        self._flush()
        return self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted after a complete output."""
        self._flush()
        return self._m.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (the next token may be a stop token)."""
        self._flush()
        return self._m.is_completed()

    def rollback(self, num_tokens: int) -> None:
        self._flush()
        self._m.rollback(num_tokens)

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (e.g. for n > 1 samples of one prompt)."""
        self._flush()
        twin = GrammarMatcher.__new__(GrammarMatcher)
        twin._m, twin._pending, twin._stops = self._m.fork(), None, self._stops
        return twin


class TokenBitmask:
    """A [max_rows, ceil(vocab/32)] int32 bitmask on the host (pinned when the device is CUDA, so the
    copy is truly asynchronous) and its twin on the device.

    Refilling the host buffers while the previous step's copies are in flight would race; it does not,
    because the engine reads each step's sampled tokens on the host (a sync) before it fills the next step.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        shape = (max_rows, (vocab_size + 31) // 32)
        pin = self.device.type == "cuda"
        self.host = torch.full(shape, -1, dtype=torch.int32, pin_memory=pin)
        self._device = (
            self.host if self.device.type == "cpu" else torch.empty_like(self.host, device=self.device)
        )
        self._rows_host = torch.empty(max_rows, dtype=torch.int32, pin_memory=pin)
        self.vocab_size = vocab_size
        self._batch: tuple[int, Any] | None = None  # (threads, xgrammar BatchGrammarMatcher) of fill_batch

    def fill(self, matchers: Mapping[int, GrammarMatcher]) -> list[int]:
        """Fill row r for each {r: matcher}; returns the rows that need masking (sorted)."""
        return sorted(row for row, m in matchers.items() if m.fill_bitmask(self.host, row))

    def fill_batch(self, matchers: Mapping[int, GrammarMatcher], max_threads: int) -> list[int]:
        """`fill` on up to `max_threads` threads (xgrammar's batch matcher), for large batches; returns every
        row given (a row that allows every token is all ones: masking it changes nothing)."""
        xgr = _xgrammar()

        if self._batch is None or self._batch[0] != max_threads:
            self._batch = (max_threads, xgr.BatchGrammarMatcher(max_threads=max_threads))
        rows = sorted(matchers)
        GrammarMatcher.flush_all([matchers[r] for r in rows])
        self._batch[1].batch_fill_next_token_bitmask([matchers[r]._m for r in rows], self.host, rows)
        return rows

    def to_device(self, num_rows: int) -> torch.Tensor:
        """The first `num_rows` rows on the device, by one non-blocking copy."""
        if self._device is self.host:
            return self.host[:num_rows]
        dst = self._device[:num_rows]
        dst.copy_(self.host[:num_rows], non_blocking=True)
        return dst

    def rows_on_device(self, rows: Sequence[int]) -> torch.Tensor:
        """`rows` as an int32 tensor on the device, through the pinned buffer (no sync)."""
        n = len(rows)
        self._rows_host[:n] = torch.as_tensor(rows, dtype=torch.int32)
        return self._rows_host[:n].to(self.device, non_blocking=True)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """In place: logits[r, t] = -inf where bit t of bitmask[r] is 0, for r in `rows` (all rows if None).

    logits [N, V] (float32/bf16/fp16) and bitmask [>=N, ceil(V/32)] int32 must be on one device; `rows`
    on that device too (a list is fine on CPU). No host sync: CUDA uses xgrammar's Triton kernel, CPU its
    C++ kernel, other devices the plain torch version below. Columns past bitmask's 32*width stay as they are.
    """
    if bitmask.device != logits.device:
        raise ValueError(f"logits on {logits.device} but bitmask on {bitmask.device}: copy the bitmask first")
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.device.type == "cpu":
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

        indices = (
            rows.tolist() if isinstance(rows, torch.Tensor) else (list(rows) if rows is not None else None)
        )
        apply_token_bitmask_inplace_cpu(logits, bitmask, vocab, indices)
    elif logits.device.type == "cuda" and _have_triton():
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton

        if rows is not None and not isinstance(rows, torch.Tensor):
            raise ValueError(
                "on CUDA pass rows as a device tensor (TokenBitmask.rows_on_device): a list syncs"
            )
        apply_token_bitmask_inplace_triton(logits, bitmask, vocab, rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)
    return logits


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """The same masking in plain torch ops (any device, no sync); the reference for the kernels."""
    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    rows = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)  # [R]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((bitmask[rows].unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()  # [R, vocab]
    masked = logits[rows, :vocab].masked_fill(~allowed, float("-inf"))  # [R, vocab]
    logits[rows, :vocab] = masked
    return logits


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
