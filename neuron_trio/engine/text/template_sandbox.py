"""jinja2's sandbox, bounded: a chat template may not stall, exhaust memory or freeze the node.

A chat template is code from the model file. jinja2's `ImmutableSandboxedEnvironment` stops it
from touching anything but not from costing anything, and three kinds of cost got through:

- time: `{% for a in range(99999) %}{% for b in range(99999) %}` renders for hours. Every
  render runs under `run_with_deadline` (an asynchronous exception raised in the rendering
  thread at the deadline), on a worker thread, never the event loop.
- one C call: `'x' * 4294967296` or `10 ** 60000000` is a single call that no trace function
  interrupts (100 s, and with a constant jinja2 folds it at compile time). So the operators
  and functions that can make a value far larger than their inputs (`*`, `**`, `+`, `%`, `~`,
  string methods and filters that take a width or a count, `join`, `replace`, `tojson`'s
  indent) check the size of their result before computing it (`MAX_VALUE_CHARS`); jinja2
  does not fold an intercepted operator at compile time, so none runs at load.
- memory over many steps: every value an operation, filter or method call produces is
  charged to the render's budget (`MAX_RENDER_CHARS`), so a loop that builds a 1 GiB string
  a message is stopped at the budget, not at the host's memory.

Exceeding any bound raises TemplateLimitError (a 500 for that request alone; a load failure
when it happens at load or in warm-up). Measured on a 2-core machine, SmolLM2's template and
a 3-message chat: 0.12 ms a render with every bound, the deadline and the control-token guard
(`ChatTemplate.render`), against 0.034 ms in plain jinja2's sandbox; a chat of 1,000 messages
stays in the milliseconds.
"""

from __future__ import annotations

import ctypes
import heapq
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import jinja2
import jinja2.nodes
import jinja2.runtime
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

from neuron_trio.errors import ApiError

T = TypeVar("T")

# The largest string or list one operation may produce (characters or items). A prompt is at
# most context x 64 characters (service/requests/prompt_intake.py): 4 MiB covers a 64k context.
MAX_VALUE_CHARS = 4 << 20
# Everything one render produces, summed over its operations (the render's memory bound).
MAX_RENDER_CHARS = 64 << 20
# A template's source: real chat templates are 1-20 KB; compiling a huge one is slow itself.
MAX_TEMPLATE_CHARS = 256 << 10
# Integers: 2^65536 is far beyond any template's arithmetic; `10 ** 60000000` is not.
MAX_INT_BITS = 1 << 16
# Widths and precisions in format specs ("%10d", "{:>10}"), and arguments such as center(w).
MAX_FORMAT_WIDTH = 10_000
MAX_JSON_INDENT = 64
MAX_LIPSUM_PARAGRAPHS = 100

_SIZED = (str, list, tuple)
# str methods whose result grows with a numeric argument: the argument is the result's width.
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})
_FORMAT_NUMBER = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class TemplateLimitError(ApiError):
    """Raised by a chat template's render if it ran past its deadline or would exceed a size
    or memory bound: the template is at fault, not the request (500, for that request only)."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages", code="chat_template_limit")


class _PastDeadline(BaseException):  # not an Exception: no `except Exception` eats it
    """Raised inside a render's thread by the deadline watcher (an asynchronous exception)."""


class _Deadline:
    """One `run_with_deadline` call: its thread, its deadline, and a token that the worker
    (finished in time) or the watcher (time is up) claims first; exactly one of them wins."""

    __slots__ = ("_token", "deadline", "thread_id")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.thread_id = threading.get_ident()
        self._token = [True]

    def claim(self) -> bool:
        try:
            self._token.pop()  # atomic under the GIL: the second caller gets IndexError
        except IndexError:
            return False
        return True

    def __lt__(self, other: _Deadline) -> bool:
        return self.deadline < other.deadline


class _DeadlineWatcher:
    """One daemon thread for the process: at each deadline it claims the call and raises
    _PastDeadline in its thread (`PyThreadState_SetAsyncExc`: delivered at the thread's next
    bytecode boundary, as KeyboardInterrupt is)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Deadline] = []
        self._thread: threading.Thread | None = None

    def add(self, entry: _Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="neuron-template-deadlines", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and self._heap[0].deadline <= now:
                    entry = heapq.heappop(self._heap)
                    if entry.claim():
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(entry.thread_id), ctypes.py_object(_PastDeadline)
                        )
                timeout = self._heap[0].deadline - now if self._heap else None
                self._cond.wait(timeout)


_watcher = _DeadlineWatcher()
_ABSORB_LIMIT_S = 1.0  # how long a finished call waits for the watcher's exception to land


def run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """`fn()` on this thread, raising TimeoutError once it has run `seconds`.

    The deadline is an asynchronous exception raised in this thread by one watcher thread and
    delivered at its next bytecode boundary: it costs nothing until it fires (a trace function
    did the same at ~8x a render's time: 0.9 ms against 0.11 ms for SmolLM2's template and a
    3-message chat). A single long C call is not interrupted: the size bounds keep every C
    call short. `fn` must not catch BaseException.
    """
    entry = _Deadline(time.monotonic() + seconds)
    _watcher.add(entry)
    try:
        try:
            result = fn()
        except _PastDeadline:
            raise
        except BaseException:
            _finish(entry)
            raise
        _finish(entry)
        return result
    except _PastDeadline:
        raise TimeoutError(f"still running after {seconds:g} s") from None


def _finish(entry: _Deadline) -> None:
    """Claim the call; if the watcher claimed it first, its exception is on its way: let it
    land here (inside run_with_deadline), never in the caller's code."""
    if entry.claim():
        return
    absorb_until = time.monotonic() + _ABSORB_LIMIT_S
    while time.monotonic() < absorb_until:
        time.sleep(0.0001)


class _Budget(threading.local):
    """What the render on this thread has produced so far (renders run on worker threads)."""

    active: bool = False  # outside a render (jinja2 folding a filter at compile time): no sum
    used: int = 0
    limit: int = MAX_RENDER_CHARS


_budget = _Budget()


@contextmanager
def render_budget(limit: int = MAX_RENDER_CHARS) -> Iterator[None]:
    """Charge the renders in the block to a fresh budget of `limit` characters."""
    saved = (_budget.active, _budget.used, _budget.limit)
    _budget.active, _budget.used, _budget.limit = True, 0, limit
    try:
        yield
    finally:
        _budget.active, _budget.used, _budget.limit = saved


def _refuse(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"the model's chat template exceeded a limit: {what}")


def _check_size(size: int, what: str) -> None:
    """Refuse a value of `size` characters (or items) before it is made."""
    if size > MAX_VALUE_CHARS:
        raise _refuse(f"{what} would make a value of {size} characters (at most {MAX_VALUE_CHARS})")


def _charge_size(size: int, what: str) -> None:
    """Account for a value of `size` characters (or items), made or about to be."""
    _check_size(size, what)
    if not _budget.active:
        return
    _budget.used += size
    if _budget.used > _budget.limit:
        raise _refuse(f"the render made more than {_budget.limit} characters in all")


def _charge(value: T, what: str) -> T:
    if isinstance(value, _SIZED):
        _charge_size(len(value), what)
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _refuse(f"{what} made an integer of more than {MAX_INT_BITS} bits")
    return value


def _check_int_product(a: int, b: int, what: str) -> None:
    if a.bit_length() + b.bit_length() > MAX_INT_BITS:
        raise _refuse(f"{what} would make an integer of more than {MAX_INT_BITS} bits")


def _repeat_count(n: Any) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before computing it, a result that would be too large."""
    what = f"the operator {operator!r}"
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            count = _repeat_count(n)
            if isinstance(seq, _SIZED) and count is not None:
                _check_size(len(seq) * max(count, 0), what)
                return
        if isinstance(left, int) and isinstance(right, int):
            _check_int_product(left, right, what)
    elif operator == "**":
        big = isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
        if big and (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
            raise _refuse(f"{what} would make an integer of more than {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, _SIZED) and isinstance(right, _SIZED):
            _check_size(len(left) + len(right), what)
    elif operator == "%" and isinstance(left, str):
        for width, precision in _PERCENT_SPEC.findall(left):
            _check_widths([width, precision], what)


def _check_widths(numbers: Iterable[str], what: str) -> None:
    for number in numbers:
        if number == "*":
            raise _refuse(f"{what} takes a width from its arguments ('*'), which is not allowed")
        if number and int(number) > MAX_FORMAT_WIDTH:
            raise _refuse(f"{what} asks for a width of {number} (at most {MAX_FORMAT_WIDTH})")


def _check_format_string(fmt: str, what: str) -> None:
    """str.format's specs: every number in them is a width or precision; nested fields
    ("{:{w}}") take them from the arguments, so they are refused."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format will raise the same error itself
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:
            raise _refuse(f"{what} takes a width from its arguments, which is not allowed")
        _check_widths(_FORMAT_NUMBER.findall(spec), what)


def _check_call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a str method call whose result would be too large, before making it (`join` is
    checked by the caller, which must materialise its argument once)."""
    owner = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if not isinstance(owner, str):
        return
    what = f"str.{name}"
    if name in _WIDTH_METHODS and args and isinstance(args[0], int):
        _check_size(max(args[0], len(owner)), what)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check_size(len(owner) + owner.count("\t") * max(tab, 0), what)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        _check_size(_replaced_size(owner, args[0], args[1]), what)
    elif name in ("format", "format_map"):
        _check_format_string(owner, what)


def _replaced_size(text: str, old: str, new: str) -> int:
    occurrences = len(text) + 1 if not old else text.count(old)
    return len(text) + occurrences * (len(new) - len(old))


def _joined_size(items: list[Any], separator: str) -> int:
    return sum(len(x) if isinstance(x, str) else 16 for x in items) + len(separator) * max(
        len(items) - 1, 0
    )


def bounded_concat(values: Iterable[Any]) -> str:
    """`"".join` that stops once the pieces exceed a value's bound (template output, macro
    bodies, `{% set %}` blocks)."""
    pieces: list[str] = []
    size = 0
    for value in values:
        piece = value if isinstance(value, str) else str(value)
        size += len(piece)
        if size > MAX_VALUE_CHARS:
            _check_size(size, "the template's output")
        pieces.append(piece)
    _charge_size(size, "the template's output")
    return "".join(pieces)


_CONTEXTS = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a jinja2 filter) with its result charged, and its size predicted first where one
    call could make a result far larger than its input."""

    @wraps(fn)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        what = f"the filter {name!r}"
        first = next((i for i, a in enumerate(args) if not isinstance(a, _CONTEXTS)), len(args))
        values = list(args[first:])
        if name in ("center", "indent") and values:
            text = str(values[0])
            width = kwargs.get("width", values[1] if len(values) > 1 else 80)
            lines = text.count("\n") + 1 if name == "indent" else 1
            if isinstance(width, str):
                width = len(width)
            if isinstance(width, int):
                _check_size(len(text) + max(width, 0) * lines, what)
        elif name == "replace" and len(values) >= 3:
            text, old, new = (str(v) for v in values[:3])
            _check_size(_replaced_size(text, old, new), what)
        elif name == "join" and values and isinstance(values[0], Iterable):
            items = list(values[0])  # materialised once, then joined from this list
            values[0] = items
            separator = kwargs.get("d", values[1] if len(values) > 1 else "")
            _check_size(_joined_size(items, str(separator)), what)
            args = (*args[:first], *values)
        elif name == "format" and values and isinstance(values[0], str):
            for width, precision in _PERCENT_SPEC.findall(values[0]):
                _check_widths([width, precision], what)
        return _charge(fn(*args, **kwargs), what)

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to the environment's bounded join (jinja2 calls `str_join` directly)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded_str_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandboxEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every way to make a large value bounded (see the module
    docstring). Renders must run inside `render_budget()`; compile with `compile_template`."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(bounded_concat)  # type: ignore[assignment]

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        lipsum = self.globals.get("lipsum")
        if callable(lipsum):

            def bounded_lipsum(n: int = 5, *args: Any, **kwargs: Any) -> Any:
                return lipsum(min(int(n), MAX_LIPSUM_PARAGRAPHS), *args, **kwargs)

            self.globals["lipsum"] = bounded_lipsum

    def set_filter(self, name: str, fn: Callable[..., Any]) -> None:
        """Add or replace a filter, bounded like the built-in ones."""
        self.filters[name] = _bounded_filter(name, fn)

    def call_binop(
        self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any
    ) -> Any:
        _check_binop(operator, left, right)
        return _charge(
            super().call_binop(context, operator, left, right), f"the operator {operator!r}"
        )

    def call(
        __self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any
    ) -> Any:
        target = getattr(__obj, "__wrapped__", __obj)  # str.format: the sandbox's wrapper
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str) and getattr(target, "__name__", "") == "join" and args:
            items = list(args[0])  # materialised once, then joined from this list
            _check_size(_joined_size(items, owner), "str.join")
            args = (items, *args[1:])
        else:
            _check_call(target, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _charge(result, f"the call of {getattr(target, '__name__', 'a function')}")

    def bounded_str_join(self, values: Iterable[Any]) -> str:
        pieces = [v if isinstance(v, str) else str(v) for v in values]
        _charge_size(sum(len(p) for p in pieces), "the operator '~'")
        return "".join(pieces)

    def compile_template(self, source: str) -> jinja2.Template:
        """The compiled template; TemplateLimitError if `source` is too long, jinja2's
        TemplateError if it does not compile (also for nesting deep enough to recurse)."""
        if len(source) > MAX_TEMPLATE_CHARS:
            raise _refuse(f"its source is {len(source)} characters (at most {MAX_TEMPLATE_CHARS})")
        try:
            return self.from_string(source)
        except (RecursionError, MemoryError) as exc:
            raise jinja2.TemplateError(f"{type(exc).__name__} while compiling") from None
