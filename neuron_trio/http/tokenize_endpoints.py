"""`POST /tokenize` and `POST /detokenize`, in llama.cpp's shapes and in vLLM's: clients count
a prompt's tokens before they send it.

- llama.cpp: `{"content", "add_special" (false), "parse_special" (true), "with_pieces"
  (false)}` → `{"tokens": [id, …]}`, or with pieces `{"tokens": [{"id", "piece"}, …]}` (a
  piece that is not valid UTF-8 on its own as its bytes, a list of ints, as llama.cpp sends it).
- vLLM: `{"model", "prompt", "add_special_tokens" (true)}`, or `{"model", "messages", "tools"}`
  (rendered as that chat request would be, so the count is what the request will cost) →
  `{"count", "max_model_len", "tokens", "token_strs"}` (`return_token_strs`).
- `/detokenize`: `{"model"?, "tokens": [id, …]}` → `{"content", "prompt"}`: the text (special
  tokens included) under llama.cpp's key and vLLM's.

`model` may be left out (llama.cpp's clients never name one) while the node serves one model.
They sit outside /v1, where llama.cpp and vLLM serve them, and need the API key as /v1 does
(`middleware.KEYED_ROOT_ROUTES`). Inputs are bounded by the body limit, the messages by
`server.max_messages`, a text by the model's context (service/requests/tokenize.py), and a detokenized
list by MAX_DETOKENIZE_TOKENS.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from neuron_trio.errors import RequestError
from neuron_trio.http.access_log import access_info
from neuron_trio.http.openai import decode_struct, parse_chat_request
from neuron_trio.http.openai.request_schemas import (
    ChatCompletionRequest,
    InputMessage,
    ModelId,
    TokenId,
    ToolDef,
)
from neuron_trio.service.api import NodeService, Tokenized, TokenizeJob

__all__ = ["MAX_DETOKENIZE_TOKENS", "TokenizeEndpoints"]

MAX_DETOKENIZE_TOKENS = 1 << 17  # more ids than any context neuron serves
_ANY_MODEL = "-"  # stands for "the node's only model" while a chat body is validated


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelId | None = None
    # llama.cpp's
    content: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    # vLLM's
    prompt: str | None = None
    messages: list[InputMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: ModelId | None = None
    tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_DETOKENIZE_TOKENS)]


def _refuse(field: str, why: str) -> RequestError:
    return RequestError(f"{field}: {why}", param=field, code="unsupported_value")


def _chat_job(req: TokenizeRequest, max_messages: int) -> TokenizeJob:
    """vLLM's chat form, validated as the chat request it stands for."""
    messages = req.messages or []
    if len(messages) > max_messages:
        raise RequestError(
            f"messages: {len(messages)} messages; at most {max_messages} (server.max_messages)",
            param="messages",
            code="too_many_messages",
        )
    if not req.add_generation_prompt or req.continue_final_message:
        field = "continue_final_message" if req.continue_final_message else "add_generation_prompt"
        raise _refuse(
            field, "the prompt is counted as a chat request's: the assistant's turn opened"
        )
    if req.add_special_tokens:
        raise _refuse("add_special_tokens", "a chat's special tokens are its template's")
    chat = ChatCompletionRequest(model=req.model or _ANY_MODEL, messages=messages, tools=req.tools)
    job = parse_chat_request(msgspec.json.encode(chat)).job
    return TokenizeJob(model=req.model, messages=job.messages, tools=job.params.tools)


def tokenize_job(req: TokenizeRequest, max_messages: int) -> TokenizeJob:
    """The job of a `/tokenize` body; RequestError (400) naming the field."""
    given = [k for k in ("content", "prompt", "messages") if getattr(req, k) is not None]
    if len(given) != 1:
        raise RequestError(
            "prompt: give exactly one of content (llama.cpp), prompt or messages (vLLM)"
            + (f"; got {', '.join(given)}" if given else ""),
            param=given[-1] if given else "prompt",
        )
    if not req.parse_special:
        raise _refuse("parse_special", "special tokens written in the text are always parsed")
    if req.messages is not None:
        return _chat_job(req, max_messages)
    if req.content is not None:
        return TokenizeJob(
            model=req.model,
            text=req.content,
            add_special=req.add_special,
            with_pieces=req.with_pieces,
            text_param="content",
        )
    add = True if req.add_special_tokens is None else req.add_special_tokens
    pieces = req.with_pieces or req.return_token_strs
    return TokenizeJob(model=req.model, text=req.prompt, add_special=add, with_pieces=pieces)


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize_body(req: TokenizeRequest, done: Tokenized) -> dict[str, Any]:
    """The answer in the shape the request came in."""
    if req.content is not None:  # llama.cpp
        if not req.with_pieces:
            return {"tokens": list(done.ids)}
        pairs = zip(done.ids, done.pieces, strict=True)
        return {"tokens": [{"id": i, "piece": _piece(p)} for i, p in pairs]}
    strs = [p.decode("utf-8", "replace") for p in done.pieces] if req.return_token_strs else None
    return {
        "count": len(done.ids),
        "max_model_len": done.context,
        "tokens": list(done.ids),
        "token_strs": strs,
    }


class TokenizeEndpoints:
    def __init__(self, node: NodeService, *, max_messages: int) -> None:
        self.node = node
        self.max_messages = max_messages

    async def tokenize(self, request: Request) -> Response:
        req = decode_struct(await request.body(), TokenizeRequest)
        _note_model(request, req.model)
        done = await self.node.tokenize(tokenize_job(req, self.max_messages))
        _note_model(request, done.model)
        return _json(tokenize_body(req, done))

    async def detokenize(self, request: Request) -> Response:
        req = decode_struct(await request.body(), DetokenizeRequest)
        _note_model(request, req.model)
        text = await self.node.detokenize(req.model, tuple(req.tokens))
        return _json({"content": text, "prompt": text})


def _note_model(request: Request, model: str | None) -> None:
    access = access_info(request.scope)
    if access is not None and model:
        access.model = model


def _json(doc: dict[str, Any]) -> Response:
    return Response(msgspec.json.encode(doc), media_type="application/json")
