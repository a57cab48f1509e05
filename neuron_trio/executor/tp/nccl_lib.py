"""NCCL through cffi (out-of-line ABI mode): finding the library, loading it, mapping errors.

Resolution order (the first that exists wins):

1. `NEURON_NCCL_LIBRARY` (a path to `libnccl.so*`; set but unusable is an error, no fallback);
2. a libnccl already mapped into this process (torch's CUDA build loads one): a second copy
   from another path would be an independent library whose handles must never mix;
3. the `nvidia-nccl-cu*` wheel (`nvidia/nccl/lib/libnccl.so.2`, the optional extra `nccl`);
4. the system's (`ctypes.util.find_library("nccl")`, i.e. ldconfig).

`load_nccl()` loads once per process and keeps the library object alive in a module global
(cffi unloads a library whose object is collected). Loading needs neither a GPU nor CUDA
headers; on a machine without a GPU, communicator init fails cleanly with `NcclError`.

cffi releases the GIL during every C call, so a blocked NCCL call on a worker thread never
stops the event loop; but init, abort and destroy may block for ever, so they must never be
called on an event loop thread (the service calls them through `trio.to_thread` with a
limiter of their own).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_trio.errors import NcclError

ENV_VAR = "NEURON_NCCL_LIBRARY"
_MAPS_RE = re.compile(r"(/\S*/libnccl\.so(?:\.\d+)*)$")

# ncclDataType_t values (nccl.h), keyed by torch dtype name so this module needs no torch.
DTYPES = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "int64": 4,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
SUM = 0  # ncclRedOp_t ncclSum
SUCCESS = 0

_lock = threading.Lock()
_library: NcclLibrary | None = None


def _mapped_in_process(maps: str = "/proc/self/maps") -> str | None:
    """The path of a libnccl already loaded into this process, if any."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                match = _MAPS_RE.search(line.rstrip("\n"))
                if match and os.path.exists(match[1]):
                    return match[1]
    except OSError:
        return None
    return None


def _wheel_library() -> str | None:
    """`nvidia/nccl/lib/libnccl.so.2` from the nvidia-nccl-cu* wheel, if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return str(candidate)
    return None


def find_library(environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(path or soname, how it was found), by the resolution order above.

    Raises FileNotFoundError naming every place looked at.
    """
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_VAR, "").strip()
    if explicit:
        if not os.path.exists(explicit):
            raise FileNotFoundError(f"{ENV_VAR}={explicit}: no such file")
        return explicit, ENV_VAR
    if loaded := _mapped_in_process():
        return loaded, "already loaded in this process"
    if wheel := _wheel_library():
        return wheel, "nvidia-nccl wheel"
    if system := ctypes.util.find_library("nccl"):
        return system, "system (ldconfig)"
    raise FileNotFoundError(
        f"no NCCL library: {ENV_VAR} unset, none loaded in this process, no nvidia-nccl-cu* "
        "wheel (pip install 'neuron_trio[nccl]'), none known to ldconfig"
    )


def version_string(code: int) -> str:
    """23203 -> "2.32.3" (NCCL >= 2.9 encodes major*10000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"  # NCCL < 2.9


@dataclass
class NcclLibrary:
    """One loaded libnccl: the cffi `ffi` and `lib`, where it came from, its version."""

    ffi: Any
    lib: Any
    path: str
    source: str
    version_code: int

    @property
    def version(self) -> str:
        return version_string(self.version_code)

    @property
    def null_comm(self) -> Any:
        return self.ffi.NULL

    def error_string(self, code: int) -> str:
        text = self.lib.ncclGetErrorString(code)
        return self.ffi.string(text).decode("utf-8", "replace") if text else f"code {code}"

    def last_error(self, comm: Any = None) -> str:
        """NCCL's last error text (one process-wide buffer: racy across communicators)."""
        text = self.lib.ncclGetLastError(self.ffi.NULL if comm is None else comm)
        return self.ffi.string(text).decode("utf-8", "replace") if text else ""

    def check(self, call: str, rc: int, comm: Any = None) -> None:
        """Raise NcclError for every non-zero ncclResult_t `rc` returned by `call`."""
        if rc != SUCCESS:
            raise NcclError(call, int(rc), self.error_string(rc), self.last_error(comm))

    def describe(self) -> dict[str, object]:
        return {"version": self.version, "library": self.path}

    # Thin wrappers: each checks its result. All may block; none belongs on an event loop.

    def comm_init_all(self, device_ordinals: list[int]) -> list[Any]:
        """One communicator per CUDA device ordinal, all driven by this process."""
        n = len(device_ordinals)
        comms = self.ffi.new("ncclComm_t[]", n)
        devlist = self.ffi.new("int[]", device_ordinals)
        self.check("ncclCommInitAll", self.lib.ncclCommInitAll(comms, n, devlist))
        return [comms[i] for i in range(n)]

    def all_reduce(
        self, ptr: int, count: int, dtype: str, comm: Any, stream: int, *, op: int = SUM
    ) -> None:
        """In-place all-reduce of `count` elements at device address `ptr`."""
        buf = self.ffi.cast("void *", ptr)
        rc = self.lib.ncclAllReduce(
            buf, buf, count, DTYPES[dtype], op, comm, self.ffi.cast("void *", stream)
        )
        self.check("ncclAllReduce", rc, comm)

    def group_start(self) -> None:
        self.check("ncclGroupStart", self.lib.ncclGroupStart())

    def group_end(self) -> None:
        self.check("ncclGroupEnd", self.lib.ncclGroupEnd())

    def comm_async_error(self, comm: Any) -> int:
        """The communicator's asynchronous ncclResult_t (0: none, 7: still in progress)."""
        result = self.ffi.new("ncclResult_t *")
        self.check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(comm, result), comm)
        return int(result[0])

    def comm_destroy(self, comm: Any) -> None:
        self.check("ncclCommDestroy", self.lib.ncclCommDestroy(comm))

    def comm_abort(self, comm: Any) -> None:
        self.check("ncclCommAbort", self.lib.ncclCommAbort(comm))


def open_library(path: str, source: str = "explicit") -> NcclLibrary:
    """dlopen `path` with the generated binding; raises OSError if it cannot be loaded."""
    from neuron_trio.executor.tp._nccl_cffi import ffi

    lib = ffi.dlopen(path)
    version = ffi.new("int *")
    rc = lib.ncclGetVersion(version)
    library = NcclLibrary(ffi=ffi, lib=lib, path=path, source=source, version_code=0)
    library.check("ncclGetVersion", rc)
    library.version_code = int(version[0])
    return library


def load_nccl() -> NcclLibrary:
    """The process's NCCL library, loaded on first use and kept alive.

    Raises NcclError (a CommError) if none can be found or loaded; the message says why.
    """
    global _library
    with _lock:
        if _library is None:
            try:
                path, source = find_library()
                _library = open_library(path, source)
            except (OSError, ImportError) as exc:
                raise NcclError("load_nccl", -1, "library unavailable", str(exc)) from exc
        return _library


def describe() -> dict[str, object]:
    """`{"version", "library"}`, or `{"error": why}`: never raises."""
    try:
        return load_nccl().describe()
    except NcclError as exc:
        return {"error": exc.last_error or str(exc)}
    except Exception as exc:  # a broken library must not break `neuron gpus`
        return {"error": f"{type(exc).__name__}: {exc}"}
