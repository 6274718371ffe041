"""The Responses API's stored responses (`store: true`, OpenAI's default): each finished response's body, for
GET /v1/responses/{id}, and the conversation it ended (input and output as chat messages), which a request
naming it as previous_response_id continues. In the server's memory only, bounded, oldest dropped first: a
restart or a full store forgets them, and a request naming a forgotten one gets a 404 that says so."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
# the conversations' text, summed: agents' long tool histories repeat in every stored turn (each response
# holds its whole conversation), so the bound is on size as well as on count
MAX_CHARS = 64 * 2**20


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    chars: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(conversation, ensure_ascii=False)) + len(json.dumps(body, ensure_ascii=False))
        self.delete(body["id"])
        self._items[body["id"]] = StoredResponse(body, conversation, chars)
        self._chars += chars
        while self._items and (len(self._items) > self.max_responses or self._chars > self.max_chars):
            _, dropped = self._items.popitem(last=False)
            self._chars -= dropped.chars

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        dropped = self._items.pop(response_id, None)
        if dropped is not None:
            self._chars -= dropped.chars
        return dropped is not None
