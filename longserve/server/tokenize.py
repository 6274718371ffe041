"""TokenizerPool: tokenization, chat templates and detokenization in worker threads, off the event loop.

Each worker thread loads its own tokenizer: HF fast tokenizers are not safe to share across threads, and the
engine thread keeps the engine's instance for incremental detokenization. Long prompts and rendered chats go
through a shared PrefixTokenCache: a turn that re-sends a conversation tokenizes only what is new.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from longserve.server.errors import APIError
from longserve.tokenizer import load_tokenizer
from longserve.tokenizer_cache import PrefixTokenCache, PromptTokenizer


class TokenizerPool:
    def __init__(self, path: str, num_workers: int = 2, prefix_cache_size: int = 64) -> None:
        self.path = path
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="longserve-tokenizer")
        self.tokenizer = load_tokenizer(path)  # checks the files now, and serves cheap attribute reads
        self.prompts = PromptTokenizer(self.tokenizer, prefix_cache_size)  # the shared prefix token cache

    @property
    def prefix_cache(self) -> PrefixTokenCache | None:
        return self.prompts.cache

    def _tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = load_tokenizer(self.path)
        return tok

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tokenizer, *args) in a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._tokenizer(), *args))

    async def encode(self, text: str, add_special_tokens: bool = True, use_cache: bool = True) -> list[int]:
        """use_cache=False (/tokenize): tokenized whole and not kept, so that counting a benchmark's prompts
        beforehand does not make their tokenizing free when they are sent."""

        def work(tok, text: str) -> list[int]:
            return self.prompts.encode(text, add_special_tokens, tokenizer=tok, use_cache=use_cache)

        try:
            return await self.run(work, text)
        except Exception as e:  # a lone surrogate and the like: the client's text, not our bug
            raise APIError(400, f"could not tokenize the prompt: {e}", param="prompt") from None

    async def chat(
        self, messages: list[dict], add_generation_prompt: bool = True, use_cache: bool = True, **kwargs: Any
    ) -> list[int]:
        def work(tok) -> list[int]:
            return self.prompts.chat(messages, add_generation_prompt, tok, use_cache, **kwargs)

        try:
            return await self.run(work)
        except Exception as e:  # template errors (role order, missing fields) come from the messages
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from None

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        def work(tok) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

        try:
            return await self.run(work)
        except Exception as e:
            raise APIError(400, f"could not decode the token ids: {e}", param="tokens") from None

    async def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), decoded one by one."""
        return await self.run(lambda tok: [tok.decode([i]) for i in ids])

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
