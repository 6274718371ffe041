"""A launched step's sampled tokens: on the device for the next step's inputs, on their way to the host for
the engine.

`ModelRunner.forward` queues a step's forward pass and `ModelRunner.sample` its sampler; the `SampledStep`
it returns has waited for nothing on the device. Its ids stay on the device (`token_ids`), where the next
step, launched before this one's ids are read (the overlapped schedule, Engine.step), gathers the
inputs of its decodes from them; the copies to pinned host memory are queued right behind the sampler and
`result()` waits for them only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from longserve.outputs import RunnerOutput


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A non-blocking copy into pinned memory (CUDA), or the tensor itself (CPU: it is already there)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class StepLogits(NamedTuple):
    """A step whose forward pass is queued: the sampling rows' logits [N, V] fp32 (None: no row samples; a
    pooling model's values [N, D]) and its rows of prompt logprobs."""

    logits: torch.Tensor | None
    prompt_logprobs: dict[str, Any] | None


@dataclass
class SampledStep:
    """token_ids [N] int64 on the device (failed rows hold 0); logprobs [N], top values/ids [N, K] when asked."""

    token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    failed: dict[str, str] = field(default_factory=dict)  # request id -> message (its token is a placeholder)
    prompt_logprobs: dict[str, Any] | None = None  # this step's rows of the prompt logprobs asked for
    done: RunnerOutput | None = None  # a result already on the host (pooling; a row-by-row re-sample)
    _host: tuple[torch.Tensor | None, ...] = ()
    _event: Any = None

    def __post_init__(self) -> None:
        if self.done is not None or self.token_ids is None:
            return
        tensors = (self.token_ids, self.logprobs, self.top_logprobs, self.top_token_ids)
        self._host = tuple(None if t is None else _to_host(t) for t in tensors)
        if self.token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> RunnerOutput:
        """The step's output on the host: waits for the copies (and so for the step) to finish."""
        if self.done is not None:
            self.done.prompt_logprobs = self.prompt_logprobs
            return self.done
        if self.token_ids is None:  # a mid-prompt chunk samples nothing (it may owe prompt logprobs)
            return RunnerOutput(sampled_token_ids=[], prompt_logprobs=self.prompt_logprobs)
        if self._event is not None:
            self._event.synchronize()
        tokens, logprobs, top_values, top_ids = self._host
        top = None
        if top_values is not None and top_values.shape[-1] > 0:
            top = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        return RunnerOutput(
            sampled_token_ids=tokens.tolist(),
            logprobs=logprobs.tolist() if logprobs is not None else None,
            top_logprobs=top,
            failed=self.failed,
            prompt_logprobs=self.prompt_logprobs,
        )
