"""LLM: the offline API. `LLM(model=PATH, ...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from collections.abc import Sequence

from longserve.config import EngineConfig
from longserve.engine import Engine
from longserve.outputs import RequestOutput
from longserve.pooling import (
    EmbeddingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    cosine,
    encode_pair,
    pair_up,
    shared_prefix_len,
)
from longserve.pooling_params import PoolingParams
from longserve.sampling_params import SamplingParams
from longserve.tokenization.tokenizer import apply_chat_template

# a string, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": str} / {"prompt_token_ids": [int]}
Prompt = str | list[int] | dict
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def prompt_of(prompt: Prompt) -> str | list[int]:
    """A prompt as the engine takes it: vLLM's prompt dicts unwrapped (other keys, e.g. multi_modal_data, are
    refused by name rather than dropped)."""
    if not isinstance(prompt, dict):
        return prompt
    extra = sorted(set(prompt) - set(_PROMPT_KEYS))
    given = [k for k in _PROMPT_KEYS if k in prompt]
    if extra or len(given) != 1:
        raise ValueError(
            f"a prompt dict takes one of {', '.join(_PROMPT_KEYS)}"
            + (f"; {', '.join(extra)} not supported" if extra else f"; got {', '.join(given) or 'neither'}")
        )
    return prompt[given[0]]


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        """`kwargs`: EngineConfig's fields, or any spelling of them that `longserve serve` takes as a flag
        (vLLM's max_model_len, gpu_memory_utilization, tensor_parallel_size, ...; server/args.engine_keywords)."""
        from longserve.server.args import engine_keywords

        self.config = EngineConfig(**engine_keywords({"model": model, **kwargs}))
        self.engine = Engine(self.config)
        self.engine.warm_up()  # on this thread, which generate() steps on

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.config = config
        llm.engine = Engine(config)
        llm.engine.warm_up()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...} dicts); one output per prompt, in order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):  # one prompt (of token ids: add_request checks every id)
            prompts = [prompts]
        prompts = [prompt_of(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, params))
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt leaves nothing queued
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        chat = self.engine.prompts.chat if self.engine.prompts is not None else None
        prompts = [
            chat(conv, add_generation_prompt, **template_kwargs)
            if chat is not None
            else apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt, **template_kwargs)
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
    ) -> list[PoolingRequestOutput]:
        """An embedding model's embedding of each prompt (`.outputs.embedding`: normalized, its first
        `pooling_params.dimensions` components on a Matryoshka model), in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        outs = self._pool(list(prompts), pooling_params or PoolingParams(), use_tqdm)
        return [
            PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled), o.cached_tokens)
            for o in outs
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
    ) -> list[PoolingRequestOutput]:
        """Relevance of each (text_1, text_2) pair (one text_1 with each text_2, or pairwise), vLLM's
        `LLM.score`: a reranker's sigmoid of its yes/no logit difference over the pair's prompt
        (pooling.encode_pair), an embedding model's cosine similarity of the two embeddings."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = pair_up(first, second)
        params = pooling_params or PoolingParams()
        spec = self.engine.runner.pooler
        if spec is not None and spec.task == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            emb = {t: o.pooled for t, o in zip(texts, self._pool(texts, params, use_tqdm))}
            return [
                PoolingRequestOutput(f"score-{i}", [], ScoringOutput(cosine(emb[a], emb[b])))
                for i, (a, b) in enumerate(pairs)
            ]
        if self.engine.tokenizer is None:
            raise ValueError("score() needs the model's tokenizer to build its prompts")
        prompts = [encode_pair(self.engine.tokenizer, a, b) for a, b in pairs]
        # the documents wait for the first one's prompt pages, then find the query's in the prefix cache
        share = self.config.enable_prefix_caching and len(prompts) > 1
        if share and shared_prefix_len(prompts) >= self.config.page_size:
            params = dataclasses.replace(params, prefix_group=f"score-{uuid.uuid4().hex}")
        outs = self._pool(prompts, params, use_tqdm)
        return [
            PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.pooled), o.cached_tokens)
            for o in outs
        ]

    def _pool(
        self, prompts: list[Prompt], params: PoolingParams, use_tqdm: bool | None
    ) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(self.engine.add_request(prompt, params))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        outs = self._run(ids, use_tqdm)
        failed = next((o for o in outs if o.error or o.pooled is None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} failed: {failed.error or 'no pooled output'}")
        return outs

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty() and len(ids) > 1
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="req", file=sys.stderr)
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def close(self) -> None:
        """Shut the engine down (stops tensor-parallel workers); the LLM is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
