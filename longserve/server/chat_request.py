"""A chat completion's prompt, grammar and output reading, from its messages, tools and constraint fields:
the tools and tool_choice checked (chat_tools.ChatTools), the conversation rendered through the model's own
chat template with the tools, the forced-call grammar or the request's constraint (one of them; behind the
reasoning section when --reasoning-parser is set) compiled off the event loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from longserve.sampling_params import SamplingParams
from longserve.server.chat_tools import ChatOutput, ChatTools
from longserve.server.errors import APIError
from longserve.server.grammars import constraint_fields, spec_of
from longserve.server.state import ServerState
from longserve.structured.reasoning import get_reasoning_parser, prompt_reasoning_state

_TAIL_TOKENS = 16  # the prompt's last tokens, decoded to see whether the template opened a <think> section


@dataclass
class PreparedChat:
    prompt: list[int]
    params: SamplingParams
    grammar: Any  # compiled, or None
    output: ChatOutput


@functools.lru_cache(maxsize=8)
def _special_tokens(tokenizer: Any) -> frozenset[str]:
    return frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


async def prepare_chat(
    state: ServerState, req: Any, params: SamplingParams, messages: list[dict], deadline: float | None
) -> PreparedChat:
    config = state.server_config
    tokenizer = state.tokenizers.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    tools = ChatTools.from_request(req, config)
    spec, field = spec_of(constraint_fields(req))
    forced = tools.grammar(template)
    if forced is not None:
        if spec is not None:
            raise APIError(
                400,
                f"{field} cannot constrain a reply whose tool_choice forces a call; drop one",
                param=field,
            )
        spec, field = forced, "tools"
    prompt = await state.tokenizers.chat(
        tools.template_messages(messages, template),
        req.add_generation_prompt,
        deadline=deadline,
        template_variables=req.chat_template_kwargs,
        tools=tools.tools,
    )
    reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
    in_reasoning = None
    if reasoning is not None:
        tail = await state.tokenizers.decode(prompt[-_TAIL_TOKENS:])
        in_reasoning = prompt_reasoning_state(tail, reasoning.start, reasoning.end)
    output = ChatOutput(tools, reasoning, in_reasoning)
    spec = output.constrain(spec)
    grammar = await state.grammars.compile(spec, field, deadline) if spec is not None else None
    if output.parser is not None and any(m in _special_tokens(tokenizer) for m in output.parser.markers):
        # Llama's <|python_tag|>, Mistral's [TOOL_CALLS]: the parser must see them in the text
        params = params.clone(skip_special_tokens=False)
    return PreparedChat(prompt, params, grammar, output)
