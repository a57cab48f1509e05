"""Targeted fixes to hypercorn 0.18's trio server and HTTP/2 protocol, applied by `serve_http`.

Each fix is its own `Fix` (the table `FIXES` below): a number and title, a shape check
(does hypercorn still have the methods, parameters and names the fix was written against?)
and the patches it installs, each built from the method it replaces (_hypercorn_h2.py: fixes
1, 2, 6, 7; _hypercorn_floods.py: 3; _hypercorn_tcp.py: 4, 5, 8; _hypercorn_shape.py: the
checks). What a fix repairs is its `fix_N_patches` docstring. `apply_hypercorn_fixes`
checks every shape before it installs anything; if one does not match, it raises
`HypercornFixError` (a `ConfigError`: the daemon refuses to serve with exit 78, naming the
version and the fix), so a node never serves without its HTTP/2 hardening. pyproject.toml
pins hypercorn to the minor the fixes were verified against.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata

from neuron_trio.errors import ConfigError
from neuron_trio.http.wire import _hypercorn_floods as floods
from neuron_trio.http.wire import _hypercorn_h2 as h2_fixes
from neuron_trio.http.wire import _hypercorn_tcp as tcp
from neuron_trio.http.wire._hypercorn_shape import Fix

__all__ = ["FIXES", "Fix", "HypercornFixError", "apply_hypercorn_fixes", "hypercorn_version"]

_APPLIED = False


class HypercornFixError(ConfigError):
    """Raised by `apply_hypercorn_fixes` if a fix's shape check fails on the installed
    hypercorn: the daemon exits 78 rather than serve without that fix."""


def hypercorn_version() -> str:
    try:
        return metadata.version("hypercorn")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "(unknown version)"


# In the order they are installed: a later fix wraps what an earlier one installed (fix 3's
# event handler wraps fix 2's; fix 7 wraps what fixes 3 and 6 add).
FIXES: tuple[Fix, ...] = (
    Fix(1, "END_STREAM before close", h2_fixes.fix_1_shape, h2_fixes.fix_1_patches),
    Fix(2, "DATA for an ended stream", h2_fixes.fix_2_shape, h2_fixes.fix_2_patches),
    Fix(3, "floods as rates", floods.fix_3_shape, floods.fix_3_patches),
    Fix(4, "a connection table", tcp.fix_4_shape, tcp.fix_4_patches),
    Fix(5, "a connection the client closed is closed at once", tcp.fix_5_shape, tcp.fix_5_patches),
    Fix(
        6, "one write for what the streams have ready", h2_fixes.fix_6_shape, h2_fixes.fix_6_patches
    ),
    Fix(7, "WINDOW_UPDATEs earned", h2_fixes.fix_7_shape, h2_fixes.fix_7_patches, requires=(3, 6)),
    Fix(8, "no error answer to a peer that has gone", tcp.fix_8_shape, tcp.fix_8_patches),
)


def shape_problems() -> Iterator[tuple[Fix, str]]:
    """Each fix whose shape check fails on the installed hypercorn (or that lacks a fix it
    wraps), with what differs."""
    numbers = {fix.number for fix in FIXES}
    for fix in FIXES:
        missing = [n for n in fix.requires if n not in numbers]
        problem = f"it needs fix {missing[0]}" if missing else fix.shape()
        if problem is not None:
            yield fix, problem


def apply_hypercorn_fixes() -> None:
    """Install every fix once (idempotent); raise HypercornFixError, installing nothing, if
    any fix's shape check fails."""
    global _APPLIED
    if _APPLIED:
        return
    for fix, problem in shape_problems():
        raise HypercornFixError(
            f"hypercorn {hypercorn_version()}: fix {fix.number} ({fix.title}) does not apply: "
            f"{problem}; neuron's HTTP/2 fixes are written for hypercorn 0.18, "
            "refusing to serve without them"
        )
    for fix in FIXES:
        fix.install()
    _APPLIED = True
