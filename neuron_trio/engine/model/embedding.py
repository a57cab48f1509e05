"""The token embedding kept as the file stores it: rows dequantised when looked up.

A step looks up one row per token, so the table need not be float32 in memory: a 151,936 x
896 table is 545 MB in float32 and 94 MB as the file's Q5_0 blocks. The rows a step needs
are dequantised with the same code (`quant.dequantize`), so the values are bit for bit the
float32 table's. Used under "auto" on the CPU when the output head does not share the table
(a tied head reads the whole table every step, so there it stays float32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from neuron_trio.engine.gguf import quant
from neuron_trio.engine.model.load.layer_parts import LayerParts, expect, int_field


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
