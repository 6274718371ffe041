"""Engine: tokenizer + scheduler + model runner. `add_request` / `abort` / `step()`; one thread drives it.

Every accepted request ends with a finished RequestOutput: a result, an abort or an error. Callers read its
state through `stats()` (an EngineStats snapshot) and act through `abort_all`, `flush_cache` and
`check_integrity`, never through the scheduler or the KV cache. A checked prompt's requests (its group's
members, their text assemblers) are built by engine_requests.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from longserve.cache.manager import KVCacheManager
from longserve.config import ConfigError, EngineConfig
from longserve.engine_checks import (
    check_limits,
    check_token_ids,
    log_ignored_settings,
    resolve_overlap,
)
from longserve.engine_outputs import Group, engine_stats, request_output
from longserve.engine_requests import assemble_text, new_group
from longserve.engine_tokens import TokenHandler
from longserve.models import load_hf_config
from longserve.outputs import EngineStats, RequestOutput, SchedulerOutput, StepStats
from longserve.pooling_params import PoolingParams
from longserve.request import FinishReason
from longserve.runner import prompt_logprobs
from longserve.runner.model_runner import ModelRunner
from longserve.runner.pooling import bind_tokenizer, check_pooling
from longserve.runner.sampled import SampledStep
from longserve.sampling_params import SamplingParams, with_every_logprob
from longserve.sched.scheduler import Scheduler, SchedulerConfig
from longserve.structured.grammar import GrammarCompiler
from longserve.tokenization.detokenizer import IncrementalDetokenizer
from longserve.tokenization.prefix_token_cache import PromptTokenizer
from longserve.tokenization.tokenizer import load_generation_eos_ids, load_tokenizer

logger = logging.getLogger("longserve.engine")


class Launched(NamedTuple):
    """A step whose forward pass and sampling are queued on the device; its tokens not read yet."""

    sched_out: SchedulerOutput
    sampled: SampledStep


class Engine:
    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        """detokenize=False: outputs carry token ids only (empty text) and stop strings are not checked;
        the caller assembles text with tokenization.detokenizer.TextAssembler and ends a request at a stop
        string with `stop_at_string` (the server does this on its event loop, off the step loop)."""
        self.config = config
        self.detokenize = detokenize
        start = time.perf_counter()
        self.hf_config = load_hf_config(config.model)
        log_ignored_settings(config, self.hf_config)
        self.tokenizer = load_tokenizer(
            config.tokenizer_path,
            required=config.load_format != "dummy",
            chat_template=config.chat_template_text,
        )
        self.runner = ModelRunner(config, self.hf_config)
        bind_tokenizer(self.runner, self.tokenizer)  # a reranker's yes/no token ids
        self.eos_token_ids = self._eos_ids()
        self.context_length = self.runner.context_length
        # the most top logprobs a request may ask for (EngineConfig.max_logprobs; -1: the vocabulary)
        self.max_logprobs = self.runner.model.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        runner = self.runner
        self.kv = KVCacheManager(
            runner.num_pages, config.page_size, config.enable_prefix_caching, runner.num_state_slots,
            runner.num_state_checkpoints, track_interval=config.mamba_track_interval,
        )  # fmt: skip
        # a lone prompt's steps as the runner resolved them; chunks end on its attention backend's granule
        lone, granule = self.runner.lone_prefill_chunk_size, self.runner.backend.chunk_granule
        sched = SchedulerConfig.from_engine_config(config, self.context_length, lone, granule)
        self.scheduler = Scheduler(sched, self.kv)
        self.tokens = TokenHandler(self.scheduler, self.context_length)  # what each sampled token does
        self.overlap = resolve_overlap(config.overlap_schedule, self.runner)
        self._in_flight: Launched | None = None  # overlapped: the step left running by the last call
        self.detokenizer = (
            IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None and detokenize else None
        )
        self.groups: dict[str, Group] = {}
        self._group_of: dict[str, Group] = {}  # member request id -> group
        self._ids = itertools.count()
        self.last_step_stats = StepStats()
        self._wait_time = 0.0  # this step's time in _complete waiting for the device
        self._read_at: float | None = None  # when this step's first _complete had the tokens
        self.broken = False  # an abort failed: page accounting can no longer be trusted (see abort_all)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        if config.seed is not None:
            torch.manual_seed(config.seed)
        logger.info(
            "%s; ready in %.1fs",
            self.runner.describe(),
            time.perf_counter() - start,
        )

    @functools.cached_property
    def _candidate_detokenizer(self) -> IncrementalDetokenizer | None:
        """Text of best_of candidates when the caller assembles text itself (detokenize=False)."""
        return IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None

    @functools.cached_property
    def prompts(self) -> PromptTokenizer | None:
        """String prompts and chats: a prompt that starts with a recent long one (a batch of questions over
        one document, a conversation's next turn) tokenizes only what follows
        (tokenization/prefix_token_cache.py). Built on first use: a server's engine gets token ids and never
        needs it."""
        return PromptTokenizer(self.tokenizer) if self.tokenizer is not None else None

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of output grammars (structured outputs, forced tool calls), built on first use: the
        model's vocab (lm_head rows) and all of its eos ids. Thread-safe, unlike the rest of the engine: the
        server compiles on its own threads and hands `add_request` the compiled grammar."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need a tokenizer; this engine has none")
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer,
                    vocab_size=self.runner.model.vocab_size,
                    stop_token_ids=sorted(self.eos_token_ids),
                    max_whitespace=self.config.structured_outputs_max_whitespace,
                )
            return self._grammar_compiler

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set(load_generation_eos_ids(self.config.model))
        cfg_eos = getattr(self.hf_config, "eos_token_id", None)
        if not ids and cfg_eos is not None:
            ids.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(int(i) for i in ids)

    # ---- requests -------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError(
                "this engine has no tokenizer (load_format='dummy' without tokenizer files): pass token ids",
                "load_format",
            )
        assert self.prompts is not None
        return self.prompts.encode(text)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        grammar: Any = None,
    ) -> str:
        """Queue a request; raises ValueError (nothing queued) for input that cannot be served.
        arrival_time (a time.perf_counter() value, default now) starts its timings (ttft, queue_time): the
        server passes when the HTTP request came, so that tokenizing and waiting for this thread count.
        grammar: the output's compiled grammar (`grammar_compiler.compile(spec)`, done off this thread by the
        server); None compiles params.structured_outputs here, if it is set."""
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        params = params or SamplingParams()
        pooling, params = check_pooling(self.runner, params)  # a pooling request: a prefill, no sample
        vocab = self.runner.model.vocab_size
        params = with_every_logprob(params, vocab)  # -1: every token
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids, token_array = prompt, self.encode(prompt), None
        else:
            text, token_ids = None, list(prompt)
            token_array = check_token_ids(token_ids, vocab)
        check_limits(token_ids, params, vocab, self.context_length, pooling is not None, self.max_logprobs)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.grammar_compiler.compile(params.structured_outputs)  # ValueError: a bad spec
        group = new_group(request_id, text, token_ids, token_array, params, pooling, grammar, self.eos_token_ids,
                          arrival_time)  # fmt: skip
        self.groups[request_id] = group
        # best_of candidates end at their stop strings here even when the caller assembles the text: they
        # report nothing until chosen, and a candidate's rank must not count tokens past its stop
        detokenizer = self.detokenizer or (self._candidate_detokenizer if group.ranked else None)
        for req in group.members:
            if detokenizer is not None:
                assemble_text(req, detokenizer)
            self._group_of[req.request_id] = group
            self.scheduler.add_request(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its n members); returns its final output, None if unknown or done."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for req in group.members:
            self.scheduler.finish_request(req, FinishReason.ABORT)
        return self._group_output(group)

    def stop_at_string(self, request_id: str, index: int, stop: str) -> RequestOutput | None:
        """End completion `index` of a request because the caller found stop string `stop` in its text
        (finish reason "stop"); returns the request's output, None if unknown or already done."""
        group = self.groups.get(request_id)
        if group is None or group.members[index].is_finished:
            return None
        req = group.members[index]
        req.stop_reason = stop
        self.scheduler.finish_request(req, FinishReason.STOP)
        return self._group_output(group)

    def abort_all(self, error: str | None = None) -> list[RequestOutput]:
        """Abort every request in flight; each final output carries `error`. A request whose abort raises
        is dropped as it is and the engine is marked `broken` (its page accounting cannot be trusted)."""
        outs = []
        for request_id in list(self.groups):
            try:
                out = self.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed; the engine is broken", request_id)
                self.broken = True
                group = self.groups.pop(request_id)
                for req in group.members:
                    self._group_of.pop(req.request_id, None)
                out = RequestOutput(request_id, group.prompt, [], [], finished=True)
            if out is not None:
                out.error = error
                outs.append(out)
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    @property
    def num_requests(self) -> int:
        return len(self.groups)

    # ---- the step -------------------------------------------------------------------------------
    def step(self, on_outputs: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Plan and launch one step; return the outputs of requests that progressed.

        Overlapped (`overlap`), the step launched here is left running, and the one the call before
        launched is read and processed while its forward pass runs; its sampling is queued after that, so
        that grammars and penalties see every token up to the new one. The host's part of a step
        (scheduling, inputs, outputs, grammar masks) hides behind the device's; the outputs returned are the
        earlier step's. A request that stops in step N has one wasted row in step N+1 (its token is dropped;
        its pages are freed at once: the device runs the steps in order), unless N's token was sure to be its
        last (max_tokens, context length).

        `on_outputs` (the server's): when the new step computes prompt tokens, its launch (eager, no CUDA
        graph) takes the host about as long as the device takes to run it, and the earlier step's tokens
        would wait for all of it: then they are read before the launch and handed to `on_outputs` at once."""
        t0 = time.perf_counter()
        self._wait_time = 0.0
        self._read_at = None
        touched: dict[str, Group] = {}
        prev, self._in_flight = self._in_flight, None
        sched_out = self.scheduler.schedule()
        # tokens of prompts (prefill) vs of generated text (decode), before the counts advance
        num_prefill = 0
        for s in sched_out.scheduled:
            left = len(s.request.prompt_token_ids) - s.request.num_computed_tokens
            if left > 0:
                num_prefill += min(s.num_new_tokens, left)
        launched = None
        if not sched_out.is_empty:
            prev_sampled = prev.sampled if prev is not None else None
            inputs = self.runner.prepare(sched_out, prev_sampled)
            early = None
            if prev is not None and on_outputs is not None and num_prefill and prev.sched_out.samples:
                # a 1.2K-token step of an 8B model on an H200: 31 ms to launch, 31 ms to run; its first token
                # reached clients 30 ms after the device had it (scripts/probes/step_timeline.py, 2026-12-02).
                # So it is read during the launch, once the new step's first layers are queued behind it
                # (runner.launch: the device runs them meanwhile), and handed out at once.
                def early() -> None:
                    nonlocal prev
                    if prev is not None:
                        done, prev = prev, None  # read once, even if reading it raises
                        self._complete(done, touched)
                        on_outputs(self._outputs(touched))
                        touched.clear()

            try:
                logits = self.runner.launch(inputs, prev_sampled, early)
            finally:
                if early is not None:  # (a launch that failed before its first layers: read it all the same)
                    early()
            if prev is not None:
                self._complete(prev, touched)
                prev = None
            sampled = self.runner.sample(sched_out, logits, self.eos_token_ids)
            self.scheduler.advance(sched_out)
            launched = Launched(sched_out, sampled)
        elif self.scheduler.has_unfinished() and not self.scheduler.running:
            # nothing runs and nothing can be admitted: the queue head cannot fit the pool
            self._fail_unschedulable()
            touched.update((g.request_id, g) for g in list(self.groups.values()) if g.done)
        if prev is not None:
            self._complete(prev, touched)
        if launched is not None:
            if self.overlap and self._more_to_come(sched_out):
                self._in_flight = launched
            else:
                self._complete(launched, touched)
        outputs = self._outputs(touched)
        self.last_step_stats = StepStats(
            num_prefill_tokens=num_prefill,
            num_decode_tokens=sched_out.num_batched_tokens - num_prefill,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(sched_out.preempted),
            kv_usage=self.kv.usage(),
            step_time=time.perf_counter() - t0,
            wait_time=self._wait_time,
            read_time=self._read_at - t0 if self._read_at is not None else -1.0,
        )
        return outputs

    def _outputs(self, touched: dict[str, Group]) -> list[RequestOutput]:
        # best_of candidates report once all have ended and the best are known
        return [self._group_output(g) for g in touched.values() if not g.ranked or g.done]

    def _more_to_come(self, sched_out: SchedulerOutput) -> bool:
        """Whether a step may follow this one: else it is read at once, so that a lone request's last token
        (a max_tokens=1 request, a prefix hit's answer) does not wait for another call."""
        if self.scheduler.waiting:
            return True
        return any(not (s.samples and s.request.pending_final) for s in sched_out.scheduled)

    def _complete(self, launched: Launched, touched: dict[str, Group]) -> None:
        """Read a launched step's tokens (waiting for it) and hand them to their requests."""
        sched_out = launched.sched_out
        start = time.perf_counter()
        runner_out = launched.sampled.result()
        read = time.perf_counter()
        self._wait_time += read - start
        if self._read_at is None:
            self._read_at = read
        requests = self.scheduler.requests
        for request_id, result in (runner_out.prompt_logprobs or {}).items():
            if request_id in requests:  # not ended meanwhile
                prompt_logprobs.record(requests[request_id], result)
        new_tokens = self.scheduler.commit(sched_out, runner_out.sampled_token_ids)
        now = time.perf_counter()
        for i, req, token in new_tokens:
            failure = runner_out.failed.get(req.request_id)
            if failure is None:
                try:
                    self.tokens.accept(req, i, token, runner_out, now)
                    continue
                except Exception as e:  # this request's own output handling: the others go on
                    failure = self.tokens.log_failure(req, e)
            req.output_token_ids.pop()  # the placeholder, or a token it could not take
            self.tokens.fail(req, failure, internal=True)
        group_of = self._group_of
        for s in sched_out.scheduled:
            g = group_of.get(s.request.request_id)
            if g is not None:
                touched[g.request_id] = g

    def _fail_unschedulable(self) -> None:
        req = self.scheduler.waiting[0]
        needed = self.kv.pages_needed(req, min(req.num_tokens, self.config.chunked_prefill_size))
        self.tokens.fail(req, f"request needs {needed} pages but the KV pool has {self.kv.num_total_pages}")

    # ---- outputs --------------------------------------------------------------------------------
    def _group_output(self, group: Group) -> RequestOutput:
        out = request_output(group)
        if out.finished:
            del self.groups[group.request_id]
            for req in group.members:
                self._group_of.pop(req.request_id, None)
        return out

    def stats(self) -> EngineStats:
        """A snapshot of queues, KV pages and counters (O(1)); call it on the thread that drives the engine."""
        return engine_stats(self.scheduler, self.kv, len(self.groups))

    def flush_cache(self) -> int:
        """Evict every cached page no request holds; returns pages freed."""
        return self.kv.flush()

    def check_integrity(self) -> None:
        """Assert the page accounting is exact (tests call this after every scenario)."""
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.kv.check_integrity(live)

    def warm_up(self, counts: list[int] | None = None) -> None:
        """Build and compile what a step would otherwise build mid-step (runner/warm_up.py; cuDNN plans are
        kept per thread) on the thread that will step (LLM's, the server's engine thread); counts: its passes'
        token counts, run on any device (tests). The model's own lone step may shrink to what fits."""
        self.runner.warm_up(counts)
        lone = self.runner.lone_prefill_chunk_size
        self.scheduler.config = dataclasses.replace(self.scheduler.config, lone_prefill_chunk_size=lone)

    def close(self) -> None:
        """Release the runner: stops tensor-parallel worker processes (a no-op at tp=1). Idempotent."""
        self.runner.shutdown()
