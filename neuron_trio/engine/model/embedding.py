"""The token embedding kept as the file stores it: rows dequantised when looked up.

A step looks up one row per token, so the table need not be float32 in memory: a 151,936 x
896 table is 545 MB in float32 and 94 MB as the file's Q5_0 blocks. The rows a step needs
are dequantised with the same code (`quant.dequantize`), so the values are bit for bit the
float32 table's. Used under "auto" on the CPU: `QuantizedEmbedding` holds the blocks (a tied
head's exact pass reads them too), `FileEmbedding` (an untied head) not even those: it reads
each step's rows from the model file (`FileRows`), so the 89 MiB of Qwen2.5 0.5B's Q5_0 table
stay out of the process's memory (the page cache keeps the rows in use) for a few
microseconds a step.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.model.load.layer_parts import LayerParts, expect, int_field
from neuron_trio.errors import ModelFileError


class QuantizedEmbedding(nn.Module):
    """Embedding lookup over the GGUF blocks `rows` (`[vocab, bytes per row]`, uint8, a copy:
    the model file may be replaced while the model runs). `forward(ids)` → float32 `[N, dim]`."""

    rows: torch.Tensor

    def __init__(self, rows: torch.Tensor, qtype: quant.QType, dim: int) -> None:
        super().__init__()
        self.register_buffer("rows", rows)
        self.qtype = int(qtype)
        self.dim = dim

    def layer_parts(self) -> LayerParts:
        """What the weight cache keeps of it (module_codec.py)."""
        return LayerParts({"rows": self.rows}, {"qtype": self.qtype, "dim": self.dim})

    @classmethod
    def from_parts(cls, parts: LayerParts, kernel: Any = None) -> QuantizedEmbedding:
        rows, dim = parts.tensors["rows"], int_field(parts.fields, "dim")
        if rows is None or rows.dim() != 2 or dim <= 0:
            raise ValueError("rows: not [vocab, bytes per row], or no dim")
        kind = quant.QType(int_field(parts.fields, "qtype"))
        expect(rows, "rows", torch.uint8, (int(rows.shape[0]), quant.raw_nbytes(kind, dim)))
        return cls(rows, kind, dim)

    @property
    def num_embeddings(self) -> int:
        return int(self.rows.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        raw = self.rows.index_select(0, ids)  # [N, bytes per row]
        return quant.dequantize(raw, quant.QType(self.qtype), (ids.numel(), self.dim))


class FileRows:
    """`rows` rows of `row_bytes` at `offset` in the file at `path`, read when asked for
    (`os.pread`), never held. The file stays open (a file replaced by a rename is still the
    one read); a file changed in place since (another size or mtime, as the weight cache's
    key counts a change) or cut short is a ModelFileError at the next read, never rows of
    another file."""

    def __init__(self, path: str | Path, offset: int, rows: int, row_bytes: int) -> None:
        self.path, self.offset, self.rows, self.row_bytes = Path(path), offset, rows, row_bytes
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._fd)  # a model unloaded closes its file
        self._identity = self._stat()
        if offset < 0 or offset + rows * row_bytes > self._identity[0]:
            raise ModelFileError(f"{self.path}: {rows} rows at byte {offset} pass its end")

    def _stat(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (any shape of int64 ids) as `[ids.numel(), row_bytes]` uint8,
        each read straight into its place (no gather after: torch's index_select of uint8
        rows took 7 ms for 512 of Qwen2.5's, the reads 0.7 ms)."""
        if self._stat() != self._identity:
            raise ModelFileError(f"{self.path} changed on disk since it was loaded: reload it")
        wanted = ids.reshape(-1).tolist()
        if wanted and not 0 <= min(wanted) <= max(wanted) < self.rows:
            raise IndexError(f"row ids outside 0..{self.rows - 1}")
        size = self.row_bytes
        out = torch.empty(len(wanted), size, dtype=torch.uint8)
        view: memoryview = out.view(-1).numpy().data  # filled in place: no bytes a row
        for i, row in enumerate(wanted):
            into = view[i * size : (i + 1) * size]
            if os.preadv(self._fd, [into], self.offset + row * size) != size:
                raise ModelFileError(f"{self.path} was cut short since it was loaded: reload it")
        return out


class FileEmbedding(nn.Module):
    """Embedding lookup over a GGUF table's blocks read from the file at each step
    (`FileRows`): `forward(ids)` → float32 `[N, dim]`, QuantizedEmbedding's values."""

    def __init__(self, rows: FileRows, qtype: quant.QType, dim: int) -> None:
        super().__init__()
        self.rows = rows
        self.qtype = int(qtype)
        self.dim = dim

    @property
    def num_embeddings(self) -> int:
        return self.rows.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raw = self.rows.take(ids)
        return quant.dequantize(raw, quant.QType(self.qtype), (raw.shape[0], self.dim))
