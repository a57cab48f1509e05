"""A GGUF file: metadata as plain Python values, its `LlamaConfig` (engine.gguf.families), tensors
memory-mapped.

The header is parsed here directly (a few hundred thousand vocabulary strings take a fraction
of a second this way, against seconds through `gguf.GGUFReader`). The file is mapped
copy-on-write, so each tensor's bytes are a zero-copy torch view of the page cache, and the
only copy made is the dequantised result.

llama.cpp's converter stores the Q and K projections of Llama models permuted for its RoPE,
which rotates adjacent pairs; `weight()` undoes that, and splits phi3's fused projections, so
every caller sees the logical (Hugging Face) layout, in which RoPE rotates the two halves of
each head.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuron_trio.engine.gguf import checks as gguf_checks
from neuron_trio.engine.gguf import families, header_memo, quant
from neuron_trio.engine.gguf.llama_config import LlamaConfig
from neuron_trio.errors import ModelFileError, ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_ARCHITECTURES = families.SUPPORTED_ARCHITECTURES
expected_tensor_names = families.expected_tensor_names

# GGUF metadata value types → struct format (scalars), and numpy dtypes (numeric arrays).
_T_STRING, _T_ARRAY = 8, 9
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALAR_FMT |= {11: "<q", 12: "<d"}
_NP_DTYPE: dict[int, Any] = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file. `shape` is in torch order: `[out, in]` for weights."""

    name: str
    qtype: int  # ggml type number (quant.QType when supported)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


class _Cursor:
    """Reads little-endian GGUF header values from a buffer."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise ModelFileError(f"{self.path}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > self.size - self.pos:
            raise ModelFileError(f"{self.path}: truncated GGUF header")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _T_STRING:
            return self.string()
        if vtype == _T_ARRAY:
            sub, count = self.scalar("<I"), self.scalar("<Q")
            gguf_checks.check_array(self.path, sub, count, depth + 1, self.pos, self.size)
            if sub == _T_STRING:
                return [self.string() for _ in range(count)]
            if sub in _NP_DTYPE:
                dtype = np.dtype(_NP_DTYPE[sub]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(sub, depth + 1) for _ in range(count)]  # arrays of arrays
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """One GGUF file, parsed and memory-mapped. Close it (or use `with`) to unmap.

    `metadata` holds every key/value as plain Python values (str, int, float, bool, lists);
    `config` is the Llama shape (UnsupportedModelError for any other architecture or for a
    tensor type we cannot dequantise, naming it). Tensors stay on disk until asked for.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                # ACCESS_COPY: writable views for torch.frombuffer without touching the file;
                # pages are shared with the page cache until written (we never write).
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                identity = header_memo.file_identity(str(self.path), f.fileno())
        except ValueError as e:  # an empty file cannot be mapped
            raise ModelFileError(f"{self.path} is not a GGUF file: {e}") from e
        except OSError as e:
            raise ModelLoadError(f"cannot open model file {self.path}: {e}") from e
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._fused_cache: tuple[str, torch.Tensor] | None = None
        self.data_start = 0
        parsed = header_memo.MEMO.lookup(identity, self._mmap)
        if parsed is not None:  # this very file was parsed and checked moments ago
            self.metadata, self.tensors = dict(parsed.metadata), dict(parsed.tensors)
            self.data_start, self.config = parsed.data_start, parsed.config
            return
        # ...or at an earlier start: its stored header (the vocabulary's checks passed for these
        # very bytes then; the cheap ones below run again)
        stored = header_memo.STORE.load(identity, self._mmap)
        restored = stored is not None and self._restore(*stored)
        try:
            if not restored:
                self._parse()
            gguf_checks.check_shape_metadata(self.path, self.metadata, len(self.tensors))
            if not restored:
                embedding = self.tensors.get("token_embd.weight")
                gguf_checks.check_vocabulary(
                    self.path, self.metadata, embedding.shape[0] if embedding else None
                )
            try:
                self.config = self._make_config()
            except (ArithmeticError, ValueError, TypeError) as e:
                # A metadata value the checks above do not know: still the file's fault.
                raise ModelFileError(
                    f"{self.path}: inconsistent metadata ({type(e).__name__}: {e})"
                ) from None
            shapes = {name: info.shape for name, info in self.tensors.items()}
            gguf_checks.check_llama_shapes(self.path, self.config, shapes)
        except BaseException:
            self.close()
            raise
        header_memo.MEMO.store(
            identity,
            self._mmap,
            header_memo.ParsedHeader(
                dict(self.metadata), dict(self.tensors), self.data_start, self.config
            ),
        )
        if not restored:
            rows = [
                [t.name, t.qtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors.values()
            ]
            header_memo.STORE.save(identity, self._mmap, self.metadata, rows, self.data_start)

    def _restore(self, metadata: dict[str, Any], rows: list[list[Any]], data_start: int) -> bool:
        """Take a stored header (header_memo.STORE); False if its tensor rows are not what
        `_parse` writes (then the file is parsed instead)."""
        tensors: dict[str, TensorInfo] = {}
        for row in rows:
            if not isinstance(row, list) or len(row) != 5:
                return False
            name, qtype, shape, offset, nbytes = row
            if not (isinstance(name, str) and isinstance(shape, list)):
                return False
            if not all(isinstance(v, int) for v in (qtype, offset, nbytes, *shape)):
                return False
            if offset + nbytes > len(self._mmap):
                return False
            tensors[name] = TensorInfo(name, qtype, tuple(shape), offset, nbytes)
        self.metadata, self.tensors, self.data_start = metadata, tensors, data_start
        return True

    # ---- header ------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mmap, self.path)
        if self._mmap[:4] != GGUF_MAGIC:
            raise ModelFileError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        gguf_checks.check_header_counts(self.path, n_tensors, n_kv, cur.pos, cur.size)
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
            gguf_checks.check_header_size(self.path, cur.pos)
        infos: dict[str, tuple[int, tuple[int, ...], int]] = {}
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            gguf_checks.check_tensor_dims_count(self.path, name, n_dims)
            dims = [cur.scalar("<Q") for _ in range(n_dims)]  # ggml order: innermost first
            gguf_checks.check_tensor_info(self.path, name, dims, infos)
            qtype, rel = cur.scalar("<I"), cur.scalar("<Q")
            infos[name] = (qtype, tuple(reversed(dims)), rel)
            gguf_checks.check_header_size(self.path, cur.pos)
        align = gguf_checks.check_alignment(
            self.path, self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        )
        data_start = (cur.pos + align - 1) // align * align
        self.data_start = data_start  # the header's bytes (metadata, tensor table, padding)
        for name, (qtype, shape, rel) in infos.items():
            n = int(np.prod(shape)) if shape else 1
            nbytes = quant.raw_nbytes(quant.QType(qtype), n) if qtype in quant.SUPPORTED else 0
            self.tensors[name] = TensorInfo(name, qtype, shape, data_start + rel, nbytes)
            if data_start + rel + nbytes > len(self._mmap):
                raise ModelFileError(f"{self.path}: tensor {name} lies past the end of the file")

    def _make_config(self) -> LlamaConfig:
        for info in self.tensors.values():
            if info.qtype not in quant.SUPPORTED:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {info.name} has type {quant.qtype_name(info.qtype)}, "
                    f"which is not supported (supported: "
                    f"{', '.join(sorted(t.name for t in quant.SUPPORTED))})"
                )
        shapes = {name: info.shape for name, info in self.tensors.items()}
        return families.config_from_metadata(
            self.metadata, shapes, lambda name: self.dequantize(name).tolist(), str(self.path)
        )

    # ---- tensors -----------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self.tensors)

    def header_bytes(self) -> bytes:
        """The header as stored (metadata, tensor table, padding): a copy, for digests."""
        return self._mmap[: self.data_start]

    def tail_bytes(self, n: int) -> bytes:
        """The file's last `n` bytes (at most its size): a copy, for digests."""
        return self._mmap[max(0, len(self._mmap) - n) :]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 view of the mapping (no copy; do not write to it)."""
        info = self.tensors[name]
        return torch.frombuffer(
            self._mmap, dtype=torch.uint8, count=info.nbytes, offset=info.offset
        )

    def dequantize(self, name: str) -> torch.Tensor:
        """The tensor as stored (Q/K still permuted), as a new float32 tensor (torch order)."""
        info = self.tensors[name]
        return quant.dequantize(self.raw(name), quant.QType(info.qtype), info.shape)

    def weight(self, name: str) -> torch.Tensor:
        """The tensor in its logical layout: float32, Q and K projections un-permuted (for the
        architectures llama.cpp permutes), phi3's fused tensors split: `blk.N.attn_q/k/v` are
        row ranges of `attn_qkv`, `blk.N.ffn_gate/up` the two halves of its `ffn_up`."""
        fused = self._fused_part(name)
        if fused is not None:
            return fused
        w = self.dequantize(name)
        if self.config.arch not in families.PERMUTED_QK:
            return w
        if name.endswith(".attn_q.weight"):
            return unpermute_qk(w, self.config.n_heads)
        if name.endswith(".attn_k.weight"):
            return unpermute_qk(w, self.config.n_kv_heads)
        return w

    def storage_name(self, name: str) -> str:
        """The tensor in the file that holds logical tensor `name` (see `weight`)."""
        source = self._fused_source(name)
        return source[0] if source else name

    def is_fused_part(self, name: str) -> bool:
        """True when logical tensor `name` is some rows of a fused tensor (Phi-3's attn_qkv,
        its ffn_up holding gate and up), which may even carry `name` itself."""
        return self._fused_source(name) is not None

    def _fused_source(self, name: str) -> tuple[str, int, int] | None:
        """(fused tensor, first row, rows) when `name` is a part of a fused tensor."""
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
            return None
        c, prefix, part = self.config, f"blk.{parts[1]}.", parts[2]
        if part in ("attn_q", "attn_k", "attn_v") and name not in self.tensors:
            q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            start, rows = {"attn_q": (0, q), "attn_k": (q, kv), "attn_v": (q + kv, kv)}[part]
            return prefix + "attn_qkv.weight", start, rows
        if part in ("ffn_gate", "ffn_up") and prefix + "ffn_gate.weight" not in self.tensors:
            up = self.tensors.get(prefix + "ffn_up.weight")
            if up is not None and up.shape[0] == 2 * c.ffn_dim:
                return prefix + "ffn_up.weight", (0 if part == "ffn_gate" else c.ffn_dim), c.ffn_dim
        return None

    def _fused_part(self, name: str) -> torch.Tensor | None:
        source = self._fused_source(name)
        if source is None:
            return None
        fused, start, rows = source
        if self._fused_cache is None or self._fused_cache[0] != fused:
            self._fused_cache = (fused, self.dequantize(fused))  # the parts are asked in a row
        return self._fused_cache[1].narrow(0, start, rows).clone()

    def close(self) -> None:
        """Unmap the file. Tensors already dequantised stay valid (they are copies)."""
        self._fused_cache = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a raw() view is still alive; the mapping goes with it

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: per head, interleaved pairs → two halves.

    `w` is `[n_heads * head_dim, in]`; row (h, i, j) of the stored layout `[h, hd/2, 2]`
    moves to (h, j, i) of the logical layout `[h, 2, hd/2]`.
    """
    out_f, in_f = w.shape
    hd = out_f // n_heads
    return w.reshape(n_heads, hd // 2, 2, in_f).transpose(1, 2).reshape(out_f, in_f).contiguous()


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's permutation (the inverse of `unpermute_qk`), for writing test files."""
    out_f, in_f = w.shape
    hd = out_f // n_heads
    return w.reshape(n_heads, 2, hd // 2, in_f).transpose(1, 2).reshape(out_f, in_f).contiguous()
