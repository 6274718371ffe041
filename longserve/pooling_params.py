"""PoolingParams: what a pooling request (an embedding or a relevance score) asks of its prompt's last
position, vLLM's name for it. A pooling request is a prefill with no sampled token: the engine runs its prompt
(chunked, over a cached prefix like any other) and the last position yields a hidden state or a score."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    """`dimensions`: keep the first this many components of an embedding (Matryoshka models only; the
    caller checks the model allows it), then normalize. `normalize`: L2-normalize an embedding (the default,
    as sentence-transformers' Normalize module and vLLM do). `activation`: a score goes through the
    classifier's activation (sigmoid of the yes/no logit difference: a probability in (0, 1)); off, the raw
    logit difference. `prefix_group`: requests of one call whose prompts share a long prefix (a query
    before each document): the later ones wait for the first one's prompt pages and reuse them."""

    dimensions: int | None = None
    normalize: bool = True
    activation: bool = True
    prefix_group: str | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        for name in ("normalize", "activation"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
