"""cffi builder for the NCCL binding: out-of-line ABI mode, no headers, no compiler.

`python ffi/nccl_build.py` regenerates `neuron_trio/executor/tp/_nccl_cffi.py`. That generated
module is committed (tests/executor/tp/test_nccl_cffi_module.py regenerates it into a temporary
folder and checks it is byte-identical), so installing neuron needs no build step: ABI mode
writes a plain Python file, and `nccl.h` (which includes `cuda_runtime.h`) is never read.

Only the calls neuron makes are declared. Enums are declared `int` (what they are in the C
ABI): `ncclRedOp_t` cannot be pasted from the header, and `ncclResult_t`/`ncclDataType_t`
stay consistent with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

MODULE_NAME = "neuron_trio.executor.tp._nccl_cffi"
REPO_ROOT = Path(__file__).resolve().parent.parent
MODULE_PATH = REPO_ROOT / "neuron_trio" / "executor" / "tp" / "_nccl_cffi.py"

CDEF = """
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef struct ncclComm *ncclComm_t;

ncclResult_t ncclGetVersion(int *version);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclCommInitAll(ncclComm_t *comm, int ndev, const int *devlist);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           void *stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
"""


def make_ffi() -> FFI:
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE_NAME, None)  # None: out-of-line ABI mode (no C compiler)
    return ffi


def generate(path: Path) -> Path:
    """Write the generated module to `path` (a .py file); return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    make_ffi().emit_python_code(str(path))
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else MODULE_PATH
    print(generate(out))
