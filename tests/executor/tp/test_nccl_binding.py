"""The NCCL binding, exercised for real against the nvidia-nccl-cu12 wheel (no GPU needed)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from neuron_trio.errors import CommError, NcclError
from neuron_trio.executor.tp import nccl_lib
from neuron_trio.executor.tp.nccl_comm import NcclCommunicator

pytestmark = pytest.mark.skipif(
    nccl_lib._wheel_library() is None, reason="needs the nvidia-nccl-cu12 wheel (extra `nccl`)"
)

ERROR_FRAGMENTS = {
    0: "no error",
    1: "cuda",
    2: "system",
    3: "internal",
    4: "invalid argument",
    5: "invalid usage",
    6: "remote",
    7: "in progress",
}


def _in_thread(fn, timeout: float = 60.0):
    """Run `fn` on a thread; fail (instead of hanging the suite) if it does not return."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="nccl-test")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s"
    return result


def test_loads_the_wheel_library_and_reads_its_version() -> None:
    lib = nccl_lib.load_nccl()
    assert lib is nccl_lib.load_nccl()  # cached, kept alive
    assert Path(lib.path).name.startswith("libnccl.so")
    assert lib.version == "2.32.3"
    assert lib.version_code == 23203
    assert nccl_lib.describe() == {"version": "2.32.3", "library": lib.path}
    assert nccl_lib.describe() == nccl_lib.describe()


def test_version_string() -> None:
    assert nccl_lib.version_string(23203) == "2.32.3"
    assert nccl_lib.version_string(21903) == "2.19.3"
    assert nccl_lib.version_string(2804) == "2.8.4"


@pytest.mark.parametrize("code", sorted(ERROR_FRAGMENTS))
def test_error_strings(code: int) -> None:
    text = nccl_lib.load_nccl().error_string(code)
    assert ERROR_FRAGMENTS[code] in text.lower()


def test_check_maps_nonzero_results_to_nccl_error() -> None:
    lib = nccl_lib.load_nccl()
    lib.check("ncclNothing", 0)
    with pytest.raises(NcclError) as info:
        lib.check("ncclSomething", 4)
    assert info.value.code == 4
    assert info.value.call == "ncclSomething"
    assert "invalid argument" in str(info.value)
    assert isinstance(info.value, CommError)


def test_environment_variable_wins_and_is_checked(tmp_path: Path) -> None:
    wheel = nccl_lib._wheel_library()
    assert wheel is not None
    assert nccl_lib.find_library({nccl_lib.ENV_VAR: wheel}) == (wheel, nccl_lib.ENV_VAR)
    with pytest.raises(FileNotFoundError, match=nccl_lib.ENV_VAR):
        nccl_lib.find_library({nccl_lib.ENV_VAR: str(tmp_path / "libnccl.so.2")})


def test_a_library_already_in_the_process_comes_before_the_wheel() -> None:
    lib = nccl_lib.load_nccl()
    path, source = nccl_lib.find_library({})
    assert source == "already loaded in this process"
    assert path == lib.path


def test_reads_proc_maps(tmp_path: Path) -> None:
    wheel = nccl_lib._wheel_library()
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {wheel}\n"
    )
    assert nccl_lib._mapped_in_process(str(maps)) == wheel
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert nccl_lib._mapped_in_process(str(maps)) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_init_fails_cleanly_without_a_gpu() -> None:
    lib = nccl_lib.load_nccl()
    result = _in_thread(lambda: lib.comm_init_all([0]))
    assert isinstance(result.get("error"), NcclError), result
    assert result["error"].code == 1

    result = _in_thread(lambda: NcclCommunicator.init_all([torch.device("cuda", 0)]))
    assert isinstance(result.get("error"), NcclError), result


def test_abort_and_destroy_of_a_null_comm_return() -> None:
    lib = nccl_lib.load_nccl()
    _in_thread(lambda: lib.comm_abort(lib.null_comm))
    _in_thread(lambda: lib.comm_destroy(lib.null_comm))
    with pytest.raises(NcclError) as info:
        lib.comm_async_error(lib.null_comm)
    assert info.value.code == 4


def test_init_needs_cuda_devices() -> None:
    with pytest.raises(CommError, match="CUDA"):
        NcclCommunicator.init_all([torch.device("cpu")])


def test_describe_says_why_when_no_library_loads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(nccl_lib, "_library", None)
    monkeypatch.setenv(nccl_lib.ENV_VAR, str(tmp_path / "missing" / "libnccl.so.2"))
    status = nccl_lib.describe()
    assert set(status) == {"error"}
    assert "no such file" in str(status["error"])
    with pytest.raises(NcclError):
        nccl_lib.load_nccl()


def test_a_file_that_is_not_nccl_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"not a shared object")
    monkeypatch.setattr(nccl_lib, "_library", None)
    monkeypatch.setenv(nccl_lib.ENV_VAR, str(bogus))
    assert "error" in nccl_lib.describe()
