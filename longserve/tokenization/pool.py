"""TokenizerPool: tokenization, chat templates and detokenization in worker threads, off the event loop.

Each worker thread loads its own tokenizer: HF fast tokenizers are not safe to share across threads, and the
engine thread keeps the engine's instance for incremental detokenization. Long prompts and rendered chats go
through a shared PrefixTokenCache: a turn that re-sends a conversation tokenizes only what is new. A refusal
is a TokenizationError carrying the HTTP status and request field that a server answers with.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from longserve.pooling import encode_pair
from longserve.tokenization.prefix_token_cache import PrefixTokenCache, PromptTokenizer
from longserve.tokenization.tokenizer import check_template_variables, load_tokenizer

# A prompt is refused by its size, before any tokenizing, when it has more characters than this many per
# token of the context: it could not fit. English averages ~4 characters a token, code ~3; 32 leaves room
# for runs of whitespace or repeated characters that merge into long tokens. Tokenizing 10 MB of text took
# 12 s of a tokenizer thread; at a 128K context the bound is 4M characters.
MAX_CHARS_PER_TOKEN = 32


class TokenizationError(Exception):
    """A prompt refused by its size or content, or not tokenized by its deadline: `status` is the HTTP status
    to answer (400: the client's input, 504: the deadline), `param` the request field it is about, `code` the
    error code (None: the status)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


class TokenizerPool:
    def __init__(
        self,
        path: str,
        num_workers: int = 2,
        prefix_cache_size: int = 64,
        max_chars: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        """max_chars: the longest text (a prompt, or a chat's messages together) tokenized for one request;
        longer ones are refused by their size, before any tokenizing (None: no limit). chat_template: the
        server's template text (--chat-template), used instead of the tokenizer's."""
        self.path = path
        self.chat_template = chat_template
        self.max_chars = max_chars
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="longserve-tokenizer")
        self.tokenizer = load_tokenizer(
            path, chat_template=chat_template
        )  # checks the files now, and serves cheap attribute reads
        self.prompts = PromptTokenizer(self.tokenizer, prefix_cache_size)  # the shared prefix token cache

    @property
    def prefix_cache(self) -> PrefixTokenCache | None:
        return self.prompts.cache

    def _tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = load_tokenizer(self.path, chat_template=self.chat_template)
        return tok

    def check_size(self, num_chars: int, param: str) -> None:
        if self.max_chars is not None and num_chars > self.max_chars:
            # OpenAI's opening words and its code in the text too, as clients map context errors by them
            # (server/state.context_length_error)
            raise TokenizationError(
                f"This model's maximum context length is {self.max_chars // MAX_CHARS_PER_TOKEN} tokens. "
                f"However, the {param} has {num_chars:,} characters; at most {self.max_chars:,} are tokenized "
                "for one request (more than the context length could hold): shorten it "
                "(context_length_exceeded)",
                param=param,
                code="context_length_exceeded",
            )

    async def run(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        """fn(tokenizer, *args) in a worker thread. Past `deadline` (time.monotonic()) the caller gets a 504
        (the thread finishes its work, bounded by max_chars, and its result is dropped)."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, lambda: fn(self._tokenizer(), *args))
        if deadline is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise TokenizationError(
                "request timed out (--request-timeout) while its prompt was tokenized", 504, code="timeout"
            ) from None

    async def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        use_cache: bool = True,
        deadline: float | None = None,
        param: str = "prompt",
    ) -> list[int]:
        """use_cache=False (/tokenize): tokenized whole and not kept, so that counting a benchmark's prompts
        beforehand does not make their tokenizing free when they are sent."""
        self.check_size(len(text), param)

        def work(tok, text: str) -> list[int]:
            return self.prompts.encode(text, add_special_tokens, tokenizer=tok, use_cache=use_cache)

        try:
            return await self.run(work, text, deadline=deadline)
        except TokenizationError:
            raise
        except Exception as e:  # a lone surrogate and the like: the client's text, not our bug
            raise TokenizationError(f"could not tokenize the {param}: {e}", param=param) from None

    async def encode_pair(
        self, first: str, second: str, deadline: float | None = None, param: str = "documents"
    ) -> list[int]:
        """A (query, document) pair as one reranker prompt: the tokenizer's text pair (pooling.encode_pair)."""
        self.check_size(len(first) + len(second), param)
        try:
            return await self.run(lambda tok: encode_pair(tok, first, second), deadline=deadline)
        except TokenizationError:
            raise
        except Exception as e:
            raise TokenizationError(f"could not tokenize the {param}: {e}", param=param) from None

    async def chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        use_cache: bool = True,
        deadline: float | None = None,
        template_variables: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the model's own chat template; `template_variables`
        (chat_template_kwargs) may set only the template's variables (tokenizer.check_template_variables).
        `tools`: OpenAI tool objects, for the template's tool section."""
        variables = template_variables or {}
        try:
            check_template_variables(variables)
        except ValueError as e:
            raise TokenizationError(str(e), param="chat_template_kwargs") from None
        size = sum(len(m.get("content") or "") + len(str(m.get("tool_calls") or "")) for m in messages)
        self.check_size(size + (len(str(tools)) if tools else 0), "messages")
        if tools:
            variables = {**variables, "tools": tools}

        def work(tok) -> list[int]:
            return self.prompts.chat(messages, add_generation_prompt, tok, use_cache, **variables)

        try:
            return await self.run(work, deadline=deadline)
        except TokenizationError:
            raise
        except Exception as e:  # template errors (role order, missing fields) come from the messages
            raise TokenizationError(f"could not apply the chat template: {e}", param="messages") from None

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        def work(tok) -> str:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

        try:
            return await self.run(work)
        except Exception as e:
            raise TokenizationError(f"could not decode the token ids: {e}", param="tokens") from None

    async def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs), decoded one by one."""
        return await self.run(lambda tok: [tok.decode([i]) for i in ids])

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
