"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory,
per process, bounded.

OpenAI keeps a response (`store`, default true) so that the next request can name it
instead of resending the conversation. neuron keeps the last `max_responses` of them, at
most `max_bytes` in all (their conversations as JSON), and forgets the oldest first; a
restart forgets them all. A follow-up must therefore reach the node that answered (a router
pins on the response id) or resend its input; a forgotten id is a 404 naming it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from neuron_trio.errors import RequestError

__all__ = ["ResponseNotFoundError", "ResponseStore", "StoredResponse"]


class ResponseNotFoundError(RequestError):
    """Raised if a request names a response this node does not hold (404)."""

    status = 404

    def __init__(self, response_id: str, param: str | None) -> None:
        super().__init__(
            f"response {response_id!r} not found (neuron keeps recent responses in memory, "
            "on the node that answered)",
            param=param,
            code="response_not_found",
        )


@dataclass(frozen=True)
class StoredResponse:
    history: tuple[dict[str, Any], ...]  # the conversation, answer included, as chat messages
    document: dict[str, Any]  # the final `response` object
    size: int  # bytes, as JSON


class ResponseStore:
    """Least recently stored first out, by count and by bytes.

    Invariant: `len(self._items) <= max_responses` and `self._bytes <= max_bytes`.
    """

    def __init__(self, *, max_responses: int = 256, max_bytes: int = 32 << 20) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(
        self, response_id: str, history: tuple[dict[str, Any], ...], doc: dict[str, Any]
    ) -> None:
        size = len(msgspec.json.encode(history)) + len(msgspec.json.encode(doc))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a follow-up gets a 404)
        self._items[response_id] = StoredResponse(history, doc, size)
        self._bytes += size
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            _, oldest = self._items.popitem(last=False)
            self._bytes -= oldest.size

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        """The stored response; ResponseNotFoundError (404, naming `param`) if there is none."""
        found = self._items.get(response_id)
        if found is None:
            raise ResponseNotFoundError(response_id, param)
        return found

    def delete(self, response_id: str) -> None:
        found = self._items.pop(response_id, None)
        if found is None:
            raise ResponseNotFoundError(response_id, None)
        self._bytes -= found.size

    def __len__(self) -> int:
        return len(self._items)
