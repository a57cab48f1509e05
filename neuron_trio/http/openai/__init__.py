"""The OpenAI wire format: `request_schemas` (the bodies), `body_decode` (a 400 naming the
field), `requests` (validation into a job) and `responses` (bodies, SSE chunks, the error
shape)."""

from neuron_trio.http.openai.body_decode import decode_struct
from neuron_trio.http.openai.request_schemas import ChatCompletionRequest, CompletionRequest
from neuron_trio.http.openai.requests import ParsedRequest, parse_chat_request
from neuron_trio.http.openai.responses import (
    SSE_DONE,
    ChunkWriter,
    Transcript,
    completion_response,
    error_body,
    new_id,
    now,
    sse_data,
)

__all__ = [
    "SSE_DONE",
    "ChatCompletionRequest",
    "ChunkWriter",
    "CompletionRequest",
    "ParsedRequest",
    "Transcript",
    "completion_response",
    "decode_struct",
    "error_body",
    "new_id",
    "now",
    "parse_chat_request",
    "sse_data",
]
