"""The two kinds of side `bench accuracy` compares: a checkpoint run offline, or a running server.

Each side encodes text, answers greedily, and scores a token sequence teacher-forced: per position j >= 1
(token j given tokens < j) the token's own logprob and the top-k logprobs {token id: logprob}.
"""

from __future__ import annotations

from typing import Any

Scored = list[tuple[float, dict[int, float]]]


class Side:
    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def describe(self) -> str:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        raise NotImplementedError

    def score(self, ids: list[int], top_k: int) -> Scored:
        raise NotImplementedError


class OfflineSide(Side):
    """A checkpoint in this process (longserve's LLM), loaded on entering and freed on leaving."""

    def __init__(self, path: str, **engine: Any) -> None:
        self.path, self.engine_kw = path, {k: v for k, v in engine.items() if v is not None}
        self.llm = None

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.engine_kw.items() if v not in ("auto", None))
        return f"{self.path}" + (f" ({extra})" if extra else "")

    def check_same_tokenizer(self, other: OfflineSide) -> None:
        """Refuse two checkpoints whose tokenizers differ (before either model is loaded)."""
        from transformers import AutoTokenizer

        a, b = AutoTokenizer.from_pretrained(self.path), AutoTokenizer.from_pretrained(other.path)
        if a.get_vocab() != b.get_vocab():
            raise ValueError(
                f"{self.path} and {other.path} have different tokenizers (vocabularies of {len(a)} and {len(b)} "
                "tokens that differ): bench accuracy compares next-token distributions token by token, so both "
                "checkpoints must share one tokenizer"
            )

    def __enter__(self) -> OfflineSide:
        from longserve import LLM

        self.llm = LLM(self.path, max_logprobs=-1, **self.engine_kw)  # any --top-k, up to the vocabulary
        return self

    def __exit__(self, *exc: object) -> None:
        if self.llm is not None:
            self.llm.__exit__(*exc)
            self.llm = None

    def encode(self, text: str) -> list[int]:
        return list(self.llm.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        from longserve import SamplingParams

        out = self.llm.generate(
            [ids], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), use_tqdm=False
        )
        return list(out[0].token_ids)

    def score(self, ids: list[int], top_k: int) -> Scored:
        from longserve import SamplingParams

        sp = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=top_k)  # -1: every token
        out = self.llm.generate([ids], sp, use_tqdm=False)[0]
        return [(out.prompt_logprobs[j], dict(out.prompt_top_logprobs[j])) for j in range(1, len(ids))]


class ServerSide(Side):
    """A running server: /tokenize and /detokenize, greedy answers through /generate (longserve's and SGLang's
    output_ids), teacher-forced scores through /v1/completions' prompt_logprobs (vLLM's format)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.url, self.model = url.rstrip("/").removesuffix("/v1"), model
        self.client = httpx.Client(base_url=self.url, timeout=timeout)

    def describe(self) -> str:
        return self.url + (f" (model {self.model})" if self.model else "")

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.model:
            body = {"model": self.model, **body}
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids, "skip_special_tokens": True})["prompt"]

    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        return list(self._post("/generate", body)["output_ids"])

    def score(self, ids: list[int], top_k: int) -> Scored:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k}
        entries = self._post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        scored = []
        for j in range(1, len(ids)):
            entry = entries[j]
            own = entry[str(ids[j])]["logprob"]
            top = {
                int(t): v["logprob"]
                for t, v in entry.items()
                if v.get("rank") is not None and v["rank"] <= top_k
            }
            scored.append((own, top or {ids[j]: own}))
        return scored
