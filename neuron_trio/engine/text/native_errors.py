"""Foreign failures of the native libraries behind loading, translated once into our own.

The tokenizer (Hugging Face `tokenizers`) and the grammar engine (`llguidance`) are Rust
behind pyo3. A Rust panic reaches Python as `pyo3_runtime.PanicException`, which derives from
`BaseException`, not `Exception`: nothing that catches `Exception` stops it, and one such panic
on a hostile vocabulary (a merge of two control tokens; a token over 1024 bytes) ended the
daemon with exit 1. `tokenizers` also reports a bad vocabulary as a bare `Exception`.

So the loading code's edges (`Tokenizer.from_metadata`, `warm_up`, and the model actor's load)
turn a panic into ModelFileError: a 422 at run time, exit 69 for a default model, and the
other models unaffected. Anything else that is not an `Exception` (KeyboardInterrupt,
SystemExit, trio's Cancelled) passes through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from neuron_trio.errors import ModelFileError

# pyo3 creates the class at run time in a module of this name; there is nothing to import.
_PANIC_MODULE, _PANIC_NAME = "pyo3_runtime", "PanicException"
_MAX_DETAIL_CHARS = 200


def is_native_panic(exc: BaseException) -> bool:
    """Whether `exc` is a Rust panic raised through pyo3 (any pyo3 library's)."""
    return any(
        cls.__name__ == _PANIC_NAME and cls.__module__ == _PANIC_MODULE for cls in type(exc).__mro__
    )


def panic_detail(exc: BaseException) -> str:
    """The panic's message, on one line and short (it may quote the file's bytes)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= _MAX_DETAIL_CHARS else text[: _MAX_DETAIL_CHARS - 3] + "..."


@contextmanager
def panics_as_model_file_errors(what: str) -> Iterator[None]:
    """Raise ModelFileError ("`what`: a native library panicked: ...") for a Rust panic in
    the block; everything else propagates unchanged."""
    try:
        yield
    except BaseException as exc:
        if is_native_panic(exc):
            raise ModelFileError(
                f"{what}: a native library panicked on this file: {panic_detail(exc)}"
            ) from None
        raise
