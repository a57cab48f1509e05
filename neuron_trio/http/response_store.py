"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory,
per process, bounded.

OpenAI keeps a response (`store`, default true) so that the next request can name it
instead of resending the conversation. neuron keeps the last `max_responses` of them, at
most `max_bytes` in all (their conversations as JSON), and forgets the oldest first; a
restart forgets them all. A follow-up must therefore reach the node that answered (a router
pins on the response id) or resend its input; a forgotten id is a 404 naming it.

A response belongs to its tenant (issue 47, #2): each tenant (http/tenancy.py; None without
keys) has a shelf of its own with the bounds above, so no tenant can evict another's
responses, and an id is looked up on the caller's shelf only: another tenant's GET, DELETE
or `previous_response_id` gets the same 404 as an id never issued (no oracle). Shelves are
made for configured tenants only, so their number is bounded by the configuration.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from neuron_trio.errors import RequestError
from neuron_trio.http.openai.request_schemas import InputMessage

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
    history: tuple[InputMessage, ...]  # the conversation, answer included, as chat messages
    document: dict[str, Any]  # the final `response` object
    size: int  # bytes, as JSON


class _Shelf:
    """One tenant's responses, least recently stored first out, by count and by bytes.

    Invariant: `len(self.items) <= max_responses` and `self.bytes <= max_bytes`.
    """

    def __init__(self) -> None:
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, item: StoredResponse, max_count: int, max_bytes: int) -> None:
        self.items[response_id] = item
        self.bytes += item.size
        while len(self.items) > max_count or self.bytes > max_bytes:
            _, oldest = self.items.popitem(last=False)
            self.bytes -= oldest.size


class ResponseStore:
    """Each tenant's recent responses, bounded per tenant (`max_responses`, `max_bytes`)."""

    def __init__(self, *, max_responses: int = 256, max_bytes: int = 32 << 20) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._shelves: dict[str | None, _Shelf] = {}

    def put(
        self,
        response_id: str,
        history: tuple[InputMessage, ...],
        doc: dict[str, Any],
        *,
        owner: str | None = None,
    ) -> None:
        """Keep a response for `owner` (a tenant's name; None without keys)."""
        size = len(msgspec.json.encode(history)) + len(msgspec.json.encode(doc))
        if size > self.max_bytes:
            return  # larger than the whole shelf: kept nowhere (a follow-up gets a 404)
        shelf = self._shelves.setdefault(owner, _Shelf())
        shelf.put(
            response_id, StoredResponse(history, doc, size), self.max_responses, self.max_bytes
        )

    def get(
        self, response_id: str, *, owner: str | None = None, param: str | None = None
    ) -> StoredResponse:
        """`owner`'s stored response; ResponseNotFoundError (404, naming `param`) if it has
        none of that id (another tenant's is not found either)."""
        shelf = self._shelves.get(owner)
        found = shelf.items.get(response_id) if shelf is not None else None
        if found is None:
            raise ResponseNotFoundError(response_id, param)
        return found

    def delete(self, response_id: str, *, owner: str | None = None) -> None:
        shelf = self._shelves.get(owner)
        found = None if shelf is None else shelf.items.pop(response_id, None)
        if shelf is None or found is None:
            raise ResponseNotFoundError(response_id, None)
        shelf.bytes -= found.size

    def __len__(self) -> int:
        return sum(len(shelf.items) for shelf in self._shelves.values())
