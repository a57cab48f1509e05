"""Constrained decoding: the tokens a sequence may take next, as a mask over the vocabulary.

A `Constraint` (JSON Schema, or a tool call) becomes an llguidance grammar; each constrained
sequence holds a `GrammarState` (llguidance's matcher) that, at every step, fills its row of a
bitmask with the tokens that keep the output inside the grammar and then consumes the token
that was sampled. Rows without a constraint get an all-ones row, so constrained and free rows
(and rows with different grammars) share one batch, one forward and one sampler call.

Why llguidance (1.9) rather than xgrammar (0.2): measured on the built-in model's 49 152-token
vocabulary (issue 14's closing note), both are far below a decode step (xgrammar ~5 µs per mask
after a 1-5 ms compile; llguidance ~15-30 µs per mask, no ahead-of-time compile, <1 ms per
schema); but xgrammar's wheel requires torch, transformers, triton and pydantic (an unpinned
torch may pull a CUDA build of several GB: docs/STACK-NOTES.md), while llguidance is one 8 MB wheel
with no dependencies. llguidance also refuses schema keywords it cannot enforce (`if`/`then`,
an unknown `format`: a 400 naming them, as docs/DESIGN.md asks), and its Lark grammars embed JSON
Schemas (`%json {...}`), which is what a tool call in a model's own format needs.

A batch's masks are filled and applied by `grammar_masks`; how a model writes a tool call, and
the grammar of its calls, is `tool_call_format`.

Compilation (`GrammarCompiler.compile`) parses the grammar once per distinct constraint and
caches the resulting matcher in its initial state (`grammar_cache`: bounded in entries and in
measured bytes, node-wide); each sequence gets a deep copy (µs). A constraint carries its
`scope` (the job's prefix-cache salt: its tenant or tenant group): a compile is shared only
within one scope, so that a cache hit's speed never tells a tenant that another tenant sent
the same schema (issue 47); Lark grammars of auto tool calls are scoped the same way. Before the compiler sees a schema, its
size and shape are bounded (`schema_limits`) and client conventions made explicit
(`schema_prep`: strict mode, `$ref`s inside a tool call); a Rust panic in the compiler is a
400. The service layer runs compiles on the model's own compile thread (`compile_threads`,
`service.requests.grammar_compiles`), never on the event loop or trio's shared worker threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import llguidance
import torch

from neuron_trio.engine.text.structured.grammar_cache import GrammarCache, HeapMeter
from neuron_trio.engine.text.structured.grammar_masks import allowed_tokens, apply_masks, fill_masks
from neuron_trio.engine.text.structured.schema_limits import (
    SchemaSize,
    check_schema,
    check_size,
    schema_bytes,
)
from neuron_trio.engine.text.structured.schema_prep import (
    close_objects,
    one_line,
    refuse_remote_refs,
)
from neuron_trio.engine.text.tokenizer import Tokenizer
from neuron_trio.engine.text.tools.tool_call_format import (
    MAX_PARALLEL_TOOL_CALLS,
    ToolCallFormat,
    decode_schema,
    detect_tool_format,
)
from neuron_trio.engine.types import Constraint
from neuron_trio.errors import ApiError, RequestError

# The grammar's public surface in one place (the engine imports it from here): the compiler
# and a sequence's state, with the masks (grammar_masks) and tool-call formats
# (tool_call_format) they work with.
__all__ = [
    "MAX_PARALLEL_TOOL_CALLS",
    "GrammarCompiler",
    "GrammarState",
    "ScopedCompiler",
    "ToolCallFormat",
    "allowed_tokens",
    "apply_masks",
    "detect_tool_format",
    "fill_masks",
    "is_rust_panic",
]

log = logging.getLogger(__name__)

# JSON without optional whitespace: a small model that may emit whitespace forever, won't.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "coerce_one_of": False}

# The compiler's own resource limits, beside `schema_limits`' bounds on its input: errors
# without the grammar and parser state (a client must never get the compiler's dump).
# `max_lexer_states` (1-2 KB each, llguidance's docs) bounds what masks add to a grammar
# after its compile: 20 000 is ~40 MB, where the default 250 000 would allow 500 MB; JSON
# schemas within the bounds reach a few thousand.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False, max_lexer_states=20_000)


class _TokenizerLike(Protocol):
    token_bytes: list[bytes]
    special_ids: frozenset[int]

    @property
    def eos_id(self) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...

    def token_to_id(self, text: str) -> int | None: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


def _param_of(constraint: Constraint) -> str:
    """The request field that a constraint's errors name (`param`: the top-level field)."""
    return "response_format" if constraint.kind == "json" else "tools"


def _lark_of(constraint: Constraint, tool_format: ToolCallFormat) -> tuple[str, SchemaSize]:
    """The grammar of `constraint` and what its schemas hold, once they passed
    `schema_limits`' bounds; RequestError naming the field otherwise."""
    if constraint.kind == "json":
        param = "response_format.json_schema.schema"
        text_bytes = schema_bytes(constraint.schema)  # UTF-8 bytes, not characters
        check_size(text_bytes, param=param)
        schema = decode_schema(constraint.schema, param)
        size = check_schema(schema, param=param, size=text_bytes)
        if constraint.strict:
            close_objects(schema)
        refuse_remote_refs(schema, param=param)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        return grammar, size
    if not constraint.tools:
        raise RequestError("tool_choice: no tool to call", param="tool_choice")
    # A call the request demands (`required`, a named function) admits only the keys its
    # objects list, whatever `strict` says (vLLM's default grammar backend closes them too):
    # the grammar writes the whole call, and open, a small sampled model invented keys
    # ("placeholder_1") until max_tokens cut the call off and the client got none. A bare
    # `{"type": "object"}` stays a free-form dictionary. A call the model began itself
    # (`auto`, tool_call_start) stays as open as its schema: the model's own keys are kept.
    parameters = tool_format.prepare_parameters(constraint.tools, closed=True)
    lark = tool_format.lark(constraint.tools, constraint.parallel, parameters)
    # all the tools' schemas together: one compile
    size = check_schema(parameters, param="tools", size=schema_bytes(lark))
    return llguidance.LLMatcher.grammar_from_lark(lark), size


class GrammarState:
    """One sequence's position in its grammar.

    A Rust panic while computing a mask or consuming a token (pyo3's PanicException, a
    BaseException) ends this sequence with the error, as a grammar error does, instead of
    failing the whole step.
    """

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self._panic: str | None = None

    @property
    def error(self) -> str | None:
        if self._panic is not None:
            return self._panic
        return _short(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def finished(self) -> bool:
        """The grammar is complete: only an end-of-turn token may follow (or has)."""
        return self._panic is None and bool(self._matcher.is_stopped())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w:
        token 32·w + i)."""
        if self.error is not None:
            return  # the row stays all ones; the engine ends the sequence with the error
        v = bitmask[row]
        try:
            self._matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        except BaseException as exc:
            self._caught(exc)

    def feed(self, token_ids: Sequence[int]) -> bool:
        """Advance past tokens sampled before this state existed; False if the grammar
        refuses one of them (the state is then unusable)."""
        return all(self._matcher.consume_token(t) for t in token_ids)

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token (it was allowed by the mask)."""
        if self._panic is not None:
            return
        try:
            accepted = self._matcher.consume_token(token_id)
        except BaseException as exc:
            self._caught(exc)
            return
        if not accepted:
            log.warning("grammar refused token %d: %s", token_id, _short(self._matcher.get_error()))

    def _caught(self, exc: BaseException) -> None:
        if not is_rust_panic(exc):
            raise exc
        self._panic = f"the grammar engine failed: {one_line(str(exc))}"
        log.error("grammar: %s", self._panic)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe, cached by constraint.

    `stop_ids`: the tokens that may end the output once the grammar is complete (EOS and the
    template's end-of-turn tokens). `vocab_size`: the width of the model's logits.
    """

    def __init__(
        self,
        tokenizer: _TokenizerLike,
        *,
        stop_ids: Iterable[int],
        vocab_size: int,
        tool_format: ToolCallFormat,
    ) -> None:
        self.vocab_size = vocab_size
        self.tool_format = tool_format
        self._wrapper = _Wrapper(tokenizer, vocab_size)
        self._stops = sorted(set(stop_ids)) or [self._wrapper.eos_token_id]
        self._ll_tokenizer: Any = None  # llguidance's: built by the first compile
        self._ll_failed: ApiError | None = None
        self._ll_lock = threading.Lock()
        self.cache = GrammarCache()

    @property
    def tokenizer_built(self) -> bool:
        """Whether llguidance's tokenizer exists yet (the first compile builds it)."""
        return self._ll_tokenizer is not None

    def _tokenizer(self) -> Any:
        """llguidance's tokenizer of the vocabulary, built on first use (thread-safe, once).

        Why not at load: building it is Rust that holds the GIL throughout, ~1.1 s for Gemma
        3's 262,144 tokens and ~0.5 s for Qwen2.5's 151,936 on a 2-core Xeon (its token trie
        and the mask slices' regexes over every token), and a plain chat never needs it. So
        the first constrained request pays it, on the compile thread; a plain chat right
        after ready does not. ApiError (500, `grammar_unavailable`) if llguidance cannot take
        the vocabulary (a panic: the GGUF checks refuse the tokens known to cause one), then
        at once for every later request."""
        if self._ll_tokenizer is None:
            with self._ll_lock:
                if self._ll_failed is not None:
                    raise self._ll_failed
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = self._build_tokenizer()
        return self._ll_tokenizer

    def _build_tokenizer(self) -> Any:
        try:
            return llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(self._wrapper),
                n_vocab=self.vocab_size,
                eos_token=self._stops,
            )
        except BaseException as exc:
            if isinstance(exc, Exception) or is_rust_panic(exc):
                self._ll_failed = ApiError(
                    "structured output is not available for this model: the grammar engine "
                    f"cannot take its vocabulary ({one_line(str(exc))[:200]})",
                    code="grammar_unavailable",
                )
                log.error("grammar: %s", self._ll_failed)
                raise self._ll_failed from None
            raise

    def is_cached(self, constraint: Constraint) -> bool:
        return self.cache.get(constraint) is not None

    def compile(self, constraint: Constraint) -> GrammarState:
        """A fresh state for `constraint`; RequestError (400) naming what is wrong with it.

        A cache miss compiles on the calling thread: the service layer calls this first on
        a compile thread (`compile_threads`), so that the engine's later call is a hit.
        """
        template = self.cache.get(constraint)
        if template is None:
            template, weight = self._build(constraint)
            self.cache.put(constraint, template, weight, owner=constraint.owner)
        return GrammarState(template.deep_copy())

    def compile_lark(
        self, lark: str, *, scope: bytes | None = None, owner: str | None = None
    ) -> GrammarState:
        """A fresh state for a Lark grammar neuron wrote itself (an auto tool call's rest,
        `tool_call_start`); ValueError if llguidance refuses it. Cached like `compile`, and
        shared only within `scope` (the sequence's prefix-cache root, as `Constraint.scope`),
        charged to `owner` (its tenant, as `Constraint.owner`)."""
        key = ("lark", scope, lark)
        template = self.cache.get(key)
        if template is None:
            # the tools' schemas passed `prepare_parameters`' bounds as the grammar was written
            weight = (4 << 20) + 256 * len(lark)
            try:
                tokenizer = self._tokenizer()
            except ApiError as exc:  # the call goes on unconstrained (tool_call_start)
                raise ValueError(exc.message) from None
            try:
                matcher = llguidance.LLMatcher(
                    tokenizer,
                    llguidance.LLMatcher.grammar_from_lark(lark),
                    log_level=0,
                    limits=_LIMITS,
                )
            except BaseException as exc:  # a Rust panic too (a BaseException)
                if not isinstance(exc, Exception) and not is_rust_panic(exc):
                    raise
                raise ValueError(one_line(str(exc))) from None
            if matcher.is_error():
                raise ValueError(one_line(matcher.get_error()))
            template = matcher
            self.cache.put(key, template, weight, owner=owner)
        return GrammarState(template.deep_copy())

    def scoped(self, scope: bytes | None, owner: str | None = None) -> ScopedCompiler:
        """`compile_lark` for one scope and tenant, as `tool_call_start.begin_call_grammar`
        calls it."""
        return ScopedCompiler(self, scope, owner)

    def _build(self, constraint: Constraint) -> tuple[Any, int]:
        param = _param_of(constraint)
        field = "response_format.json_schema.schema" if constraint.kind == "json" else param
        with _as_schema_errors(field, param):
            grammar, size = _lark_of(constraint, self.tool_format)
            weight = size.estimated_bytes()
            self.cache.admit(weight, param=param)  # before the compile: refused costs nothing
        # after the bounds (a refused schema never builds it), and its own error (ApiError)
        tokenizer = self._tokenizer()
        with _as_schema_errors(field, param), HeapMeter() as meter:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
            if not matcher.is_error():
                self._first_mask(matcher)
        if matcher.is_error():
            raise RequestError(
                f"{field}: {one_line(matcher.get_error())}", param=param, code="invalid_schema"
            )
        # charged what it measurably holds, where more than the schema's estimate (issue 47)
        weight = max(weight, meter.grown)
        self.cache.admit(weight, param=param, measured=True)
        return matcher, weight

    def _first_mask(self, matcher: Any) -> None:
        """The first mask, on a copy: it builds the lexer that the cached matcher keeps
        (llguidance's memory grows here, not at the compile), so that the cache can measure
        it (grammar_cache.HeapMeter) and the engine's first step does not pay for it."""
        words = (self.vocab_size + 31) // 32
        GrammarState(matcher.deep_copy()).fill(torch.empty((1, words), dtype=torch.int32), 0)


class ScopedCompiler:
    """A `GrammarCompiler`'s Lark grammars of one scope (a sequence's prefix-cache root),
    charged to one tenant."""

    def __init__(self, compiler: GrammarCompiler, scope: bytes | None, owner: str | None) -> None:
        self._compiler = compiler
        self._scope = scope
        self._owner = owner

    def compile_lark(self, lark: str) -> GrammarState:
        return self._compiler.compile_lark(lark, scope=self._scope, owner=self._owner)


@contextmanager
def _as_schema_errors(field: str, param: str) -> Iterator[None]:
    """A schema's failure in llguidance as the 400 that names it (RequestErrors pass)."""
    try:
        yield
    except RequestError:
        raise
    except BaseException as exc:
        # pyo3's PanicException derives from BaseException (a Rust panic in the compiler:
        # 20 000 const keys did it); catch it here, where llguidance is called.
        if not isinstance(exc, Exception) and not is_rust_panic(exc):
            raise
        raise RequestError(
            f"{field}: invalid JSON schema: {one_line(str(exc))}",
            param=param,
            code="invalid_schema",
        ) from None


def is_rust_panic(exc: BaseException) -> bool:
    """`exc` is pyo3's PanicException (a Rust panic surfaced in Python), which is neither an
    Exception nor importable by a stable name."""
    return type(exc).__name__ == "PanicException"


def _short(error: str) -> str:
    """llguidance's message without its multi-line grammar dump."""
    return one_line(error)


def _gil_free_encode(tokenizer: _TokenizerLike) -> Any | None:
    """The HF tokenizers call that gives `Tokenizer.encode`'s ids (no special tokens added)
    without holding the GIL, where `tokenizer` is ours; None for any other tokenizer.

    Why (issue 47): llguidance calls the wrapper back, holding the GIL, to tokenize the text a
    grammar forces next, at a matcher's first mask. A 1,999-key `const` schema forces ~24 KB:
    `Tokenizer.encode` (HF's `encode`, which keeps the GIL) then took 20 ms on an idle core and
    ~0.16 s on a loaded one, on the compile thread, and every engine step waited for it.
    `encode_batch_fast` gives the same ids (no offsets) and releases the GIL while it runs.
    """
    if not isinstance(tokenizer, Tokenizer):
        return None
    return getattr(tokenizer.backend, "encode_batch_fast", None)


class _Wrapper:
    """The tokenizer as llguidance's TokenizerWrapper reads it."""

    def __init__(self, tokenizer: _TokenizerLike, vocab_size: int) -> None:
        tokens = list(tokenizer.token_bytes[:vocab_size])
        tokens += [b""] * (vocab_size - len(tokens))  # padded logits rows: never allowed text
        self.tokens = tokens
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer
        self._encode_without_gil = _gil_free_encode(tokenizer)
        # SentencePiece-style vocabularies put a space in front of the text they encode
        self._space_prefix = bool(getattr(tokenizer, "strip_leading_space", False))
        self._ids_of: dict[bytes, int] | None = None

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if self._encode_without_gil is not None:
            ids = self._encode_without_gil([text], add_special_tokens=False)[0].ids
        else:
            ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        if self._space_prefix and ids and not text.startswith(" "):
            ids = self._without_space_prefix(ids)
        return ids

    def _without_space_prefix(self, ids: list[int]) -> list[int]:
        """`ids` without the space SentencePiece put in front: llguidance tokenizes the bytes
        the grammar forces next (`{` must not come back as " {", which the grammar refuses:
        with a "▁" token allowed and "{" not, a tool call after `[` went wrong)."""
        head = self.tokens[ids[0]]
        if not head.startswith(b" "):
            return ids
        if head == b" ":
            return ids[1:]
        if self._ids_of is None:
            self._ids_of = {}
            for i, raw in enumerate(self.tokens):
                if raw and i not in self.special_token_ids:
                    self._ids_of.setdefault(raw, i)
        rest = self._ids_of.get(head[1:])
        return ids if rest is None else [rest, *ids[1:]]
