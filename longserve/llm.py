"""LLM: the offline API. `LLM(model=PATH, ...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from longserve.config import EngineConfig
from longserve.engine import Engine
from longserve.outputs import RequestOutput
from longserve.sampling_params import SamplingParams
from longserve.tokenization.tokenizer import apply_chat_template

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        if "tensor_parallel_size" in kwargs:  # vLLM's spelling
            kwargs["tp_size"] = kwargs.pop("tensor_parallel_size")
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.engine = Engine(self.config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.config = config
        llm.engine = Engine(config)
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
        """Generate for each prompt (a string or a list of token ids); one output per prompt, in order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):  # one prompt of token ids (add_request checks every id)
            prompts = [prompts]
        prompts = list(prompts)
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
