"""The Responses API's server-sent events, in the order OpenAI sends them.

```
response.created, response.in_progress
  thinking:   response.output_item.added (a reasoning item), response.content_part.added,
              response.reasoning_text.delta …, response.reasoning_text.done,
              response.content_part.done, response.output_item.done
  a message:  response.output_item.added, response.content_part.added,
              response.output_text.delta …, response.output_text.done,
              response.content_part.done, response.output_item.done
  each call:  response.output_item.added, response.function_call_arguments.delta,
              response.function_call_arguments.done, response.output_item.done
response.completed (or response.incomplete: max_output_tokens)
```

Every event is `event: TYPE` + `data: {…, "type": TYPE, "sequence_number": k}`; no
`[DONE]` ends the stream (OpenAI sends none here). An error after the start is one `error`
event. Text that is only whitespace before the first call opens no message (the chat
answer's `content` is null in that case too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from neuron_trio.http.openai.responses import Transcript
from neuron_trio.http.openai.responses_api import (
    ParsedResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    output_text_part,
    reasoning_item,
    response_object,
    responses_usage,
)
from neuron_trio.service.api import SequenceEvent, ToolCall

__all__ = ["ResponsesStreamWriter", "sse_event"]


def sse_event(kind: str, doc: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(doc) + b"\n\n"


@dataclass
class ResponsesStreamWriter:
    """Turns one request's engine events into Responses events, in order."""

    parsed: ParsedResponsesRequest
    response_id: str
    created_at: int
    output: list[dict[str, Any]] = field(default_factory=list)  # items done, in order
    _sequence: int = 0
    _message_id: str | None = None  # the message item open now
    _text: list[str] = field(default_factory=list)
    _pending_space: str = ""  # whitespace held back until text that is not whitespace
    _reasoning_id: str | None = None  # the reasoning item open now
    _reasoning: list[str] = field(default_factory=list)

    def _event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(kind, doc)

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        return response_object(
            self.parsed,
            self.response_id,
            self.created_at,
            status=status,
            output=list(self.output),
            usage=usage,
        )

    def opening(self) -> bytes:
        response = self._response("in_progress", None)
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def event(self, event: SequenceEvent) -> bytes:
        out = b""
        if event.reasoning:
            out += self._reasoning_delta(event.reasoning)
        if event.text:
            out += self._text_delta(event.text)
        for call in event.tool_calls or ():
            out += self._close_reasoning("completed")
            out += self._close_message("completed") + self._call(call)
        return out

    def _reasoning_delta(self, text: str) -> bytes:
        out = b""
        if self._reasoning_id is None:
            self._reasoning_id = new_item_id("rs")
            item = reasoning_item(self._reasoning_id, "", "in_progress")
            out += self._event(
                "response.output_item.added", output_index=len(self.output), item=item
            )
            out += self._event(
                "response.content_part.added",
                item_id=self._reasoning_id,
                output_index=len(self.output),
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        self._reasoning.append(text)
        return out + self._event(
            "response.reasoning_text.delta",
            item_id=self._reasoning_id,
            output_index=len(self.output),
            content_index=0,
            delta=text,
        )

    def _close_reasoning(self, status: str) -> bytes:
        """End the open reasoning item, if one is."""
        item_id = self._reasoning_id
        if item_id is None:
            return b""
        text, index = "".join(self._reasoning), len(self.output)
        part = {"type": "reasoning_text", "text": text}
        fields = {"item_id": item_id, "output_index": index, "content_index": 0}
        out = self._event("response.reasoning_text.done", text=text, **fields)
        out += self._event("response.content_part.done", part=part, **fields)
        item = reasoning_item(item_id, text, status)
        out += self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self._reasoning_id, self._reasoning = None, []
        return out

    def _text_delta(self, text: str) -> bytes:
        if self._message_id is None:
            if not (self._pending_space + text).strip():
                self._pending_space += text
                return b""
            text, self._pending_space = self._pending_space + text, ""
            head = self._close_reasoning("completed") + self._open_message()
        else:
            head = b""
        self._text.append(text)
        return head + self._event(
            "response.output_text.delta",
            item_id=self._message_id,
            output_index=len(self.output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _open_message(self) -> bytes:
        """A new message item, empty and in progress, with its one text part."""
        self._message_id = new_item_id("msg")
        item = {**message_item(self._message_id, "", "in_progress"), "content": []}
        return self._event(
            "response.output_item.added", output_index=len(self.output), item=item
        ) + self._event(
            "response.content_part.added",
            item_id=self._message_id,
            output_index=len(self.output),
            content_index=0,
            part=output_text_part(""),
        )

    def _close_message(self, status: str, *, always: bool = False) -> bytes:
        """End the open message; with `always`, open (and end) an empty one if none is."""
        if self._message_id is None:
            if not always:
                return b""
            opened = self._open_message()
        else:
            opened = b""
        message_id = self._message_id
        assert message_id is not None  # open, or opened above
        text = "".join(self._text)
        index = len(self.output)
        item = message_item(message_id, text, status)
        out = opened + self._event(
            "response.output_text.done",
            item_id=message_id,
            output_index=index,
            content_index=0,
            text=text,
            logprobs=[],
        )
        out += self._event(
            "response.content_part.done",
            item_id=message_id,
            output_index=index,
            content_index=0,
            part=output_text_part(text),
        )
        out += self._event("response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self._message_id = None
        self._text = []
        return out

    def _call(self, call: ToolCall) -> bytes:
        item_id = new_item_id("fc")
        index = len(self.output)
        added = function_call_item(item_id, call.id, call.name, "", "in_progress")
        done = function_call_item(item_id, call.id, call.name, call.arguments, "completed")
        out = self._event("response.output_item.added", output_index=index, item=added)
        out += self._event(
            "response.function_call_arguments.delta",
            item_id=item_id,
            output_index=index,
            delta=call.arguments,
        )
        out += self._event(
            "response.function_call_arguments.done",
            item_id=item_id,
            output_index=index,
            arguments=call.arguments,
        )
        out += self._event("response.output_item.done", output_index=index, item=done)
        self.output.append(done)
        return out

    def closing(self, t: Transcript) -> bytes:
        """The end: the open message closed, then response.completed or .incomplete."""
        status = "incomplete" if t.finish_reason == "length" else "completed"
        out = self._close_reasoning(status)
        out += self._close_message(status, always=not self.output or self._only_reasoning())
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, response=self.final(t))

    def _only_reasoning(self) -> bool:
        """Whether the output so far is thinking alone (an answer then still gets its
        message, empty, as a chat answer gets its `content`)."""
        return all(item["type"] == "reasoning" for item in self.output)

    def final(self, t: Transcript) -> dict[str, Any]:
        status = "incomplete" if t.finish_reason == "length" else "completed"
        return self._response(status, responses_usage(t))

    def error(self, message: str, code: str | None, param: str | None) -> bytes:
        return self._event("error", code=code, message=message, param=param)
