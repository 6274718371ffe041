"""Incremental detokenization and stop-string handling for one request.

Text is decoded from a sliding window of tokens (`prefix_offset`..end) so each new token costs O(window),
and a token that ends inside a multi-byte character (decodes to U+FFFD) is held until it completes.
Streaming holds back the last (longest stop string - 1) characters so a stop string is never streamed
and then taken back.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    num_emitted_chars: int = 0  # characters of output_text already handed to the caller


def make_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) without clean-up of tokenization spaces. A fast Hugging Face
    tokenizer's Rust backend is called directly: its Python `decode` wrapper converts and re-checks the ids
    on every call, ~20 us each, twice per request per step (~1 ms a step at batch 64)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "decode", None)):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(
        ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    # context tokens before the new ones: enough for tokenizers that merge spaces across tokens
    WINDOW = 6

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = make_decoder(tokenizer)

    def start(self, prompt_ids: list[int]) -> DetokState:
        # decode the first output tokens with the end of the prompt as context (leading-space handling)
        offset = max(0, len(prompt_ids) - self.WINDOW)
        n = len(prompt_ids)
        return DetokState(prefix_offset=offset - n, read_offset=0)

    def step(
        self,
        state: DetokState,
        prompt_ids: list[int],
        output_ids: list[int],
        skip_special: bool,
        final: bool = False,
        end: int | None = None,
    ) -> str:
        """Return the new text that the last output token(s) complete ('' while a character is split).
        With `final`, text held back for an incomplete character is released as it decodes. `end`: decode
        output_ids[:end] (default all) without copying that prefix."""
        end = len(output_ids) if end is None else end

        # offsets are relative to output_ids; negative values reach back into the prompt
        def window(lo: int, hi: int) -> list[int]:
            if lo >= 0:
                return output_ids[lo:hi]
            return prompt_ids[len(prompt_ids) + lo :] + output_ids[:hi]

        prefix_text = self._decode(window(state.prefix_offset, state.read_offset), skip_special)
        full_text = self._decode(window(state.prefix_offset, end), skip_special)
        if (full_text.endswith("\ufffd") and not final) or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        state.prefix_offset = state.read_offset
        state.read_offset = end
        return new_text


def find_stop_string(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string that ends after `search_from`; (index, stop) or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, search_from - len(stop) + 1))
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


class TextAssembler:
    """The text of one completion, built token by token: incremental decoding, stop strings (the text is
    cut before the first one), and the streaming hold-back of a possible stop-string prefix. The engine
    uses one per request offline; the server keeps them on its event loop, off the engine's step loop."""

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        prompt_ids: list[int],
        stops: list[str],
        skip_special: bool,
        keep_stop: bool = False,
    ) -> None:
        self.detokenizer = detokenizer
        self.prompt_ids = prompt_ids
        self.stops = stops
        self.skip_special = skip_special
        # SGLang's no_stop_trim (vLLM's include_stop_str_in_output): the text ends after the stop string, and
        # a stop token's own text is kept (the callers decode it too)
        self.keep_stop = keep_stop
        self.state = detokenizer.start(prompt_ids)
        self.text = ""
        self.stop_hit: str | None = None  # the stop string that ended the text
        self.num_tokens_at_stop = 0  # output tokens decoded when it was found
        self._holdback = max((len(s) for s in stops), default=1) - 1

    def add(self, output_ids: list[int], final: bool = False, end: int | None = None) -> str | None:
        """Decode the output tokens so far (those that have text: output_ids[:end], default all); returns
        the stop string if one now ends the text. With `final`, bytes held for an incomplete character are
        released."""
        if self.stop_hit is not None:
            return None
        end = len(output_ids) if end is None else end
        new_text = self.detokenizer.step(
            self.state, self.prompt_ids, output_ids, self.skip_special, final, end
        )
        if not new_text:
            return None
        old_len = len(self.text)
        self.text += new_text
        hit = find_stop_string(self.text, self.stops, old_len) if self.stops else None
        if hit is None:
            return None
        self.text = self.text[: hit[0] + (len(hit[1]) if self.keep_stop else 0)]
        self.stop_hit = hit[1]
        self.num_tokens_at_stop = end
        return hit[1]

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, the tail that could start a stop string is held back."""
        visible = self.text
        if not finished and self.stop_hit is None and self._holdback:
            visible = self.text[: max(len(self.text) - self._holdback, 0)]
        new_text = visible[self.state.num_emitted_chars :]
        self.state.num_emitted_chars = max(self.state.num_emitted_chars, len(visible))
        return new_text


class DeferredText:
    """A TextAssembler fed only when its text is read: the engine records each `add` (how many output
    tokens, final or not) and the same calls run, in the same order, on the first read of a text that
    needs them, so the text is the one an eager assembler makes. Only for completions without stop
    strings: then nothing the engine decides depends on the text (scripts/dev/host_time.py, batch 64 x 4K
    on the CI CPU: incremental decoding was 1.0 ms cumulative under cProfile of a 2.8 ms decode step, for
    text that LLM.generate reads once at the end and a benchmark never reads). `output_ids` is the request's own list: it only grows, so a recorded
    count still names the same tokens later."""

    __slots__ = ("assembler", "output_ids", "ends", "final_at", "applied", "lengths", "emitted")

    def __init__(self, assembler: TextAssembler, output_ids: list[int]) -> None:
        assert not assembler.stops, "a completion with stop strings is assembled as it runs"
        self.assembler = assembler
        self.output_ids = output_ids
        self.ends = array.array("q")  # each recorded add's token count
        self.final_at = -1  # the index in `ends` of the final add (the last), -1: none yet
        self.applied = 0  # recorded adds run so far
        self.lengths = array.array("q", [0])  # len(text) after each run add (lengths[0]: before any)
        self.emitted = 0  # recorded adds whose text a delta has handed out (see `mark`)

    def add(self, end: int, final: bool = False) -> None:
        """Record TextAssembler.add(output_ids, final, end)."""
        if final:
            self.final_at = len(self.ends)
        self.ends.append(end)

    def mark(self) -> tuple[int, int]:
        """The recorded adds whose text a new delta covers, (from, to), as TextAssembler.delta would hand
        out now (no stop strings: nothing is held back)."""
        span = (self.emitted, len(self.ends))
        self.emitted = span[1]
        return span

    def text_at(self, upto: int) -> str:
        """The text after the first `upto` recorded adds."""
        asm, ids = self.assembler, self.output_ids
        while self.applied < upto:
            end = self.ends[self.applied]
            asm.add(ids, self.applied == self.final_at, end)
            self.applied += 1
            self.lengths.append(len(asm.text))
        return asm.text[: self.lengths[upto]]

    def delta_of(self, span: tuple[int, int]) -> str:
        text = self.text_at(span[1])
        return text[self.lengths[span[0]] :]

    @property
    def text(self) -> str:
        return self.text_at(len(self.ends))
