"""A GGUF file's projections requantised to another type by the `gguf` package's own
quantizers (numpy ports of llama.cpp's reference ones), for fidelity tests and
bench/bench_fidelity.py: the same model in each type neuron accepts, without llama.cpp.

The projections (`blk.N.*.weight`, 2-D) are dequantised and quantised to the target type,
as llama.cpp's `llama_model_quantize` with `allow_requantize` does; the embedding and the
norms stay as the source stores them. gguf 0.19 quantises Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
(`QUANTIZABLE`); its K-quants and IQ4 quantizers are not implemented (NotImplementedError),
so IQ4_NL is made by `quantize_iq4_nl` here.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import quants

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
# IQ4_NL's 16 levels (ggml's kvalues_iq4nl)
_IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def quantize_iq4_nl(w: np.ndarray) -> np.ndarray:
    """float32 `[rows, cols]` → IQ4_NL blocks `[rows, cols / 32 · 18]`, as llama.cpp's
    reference quantizer does it without its search over nearby scales: the block's value of
    largest magnitude on level -127, each value on its nearest level, then the scale that
    fits those levels best (least squares). gguf 0.19 has no IQ4_NL quantizer."""
    rows = w.shape[0]
    x = w.reshape(-1, 32).astype(np.float32)
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)  # signed
    d = np.where(extreme != 0, extreme / -127.0, 1.0).astype(np.float32)
    idx = np.abs(x[:, :, None] / d[:, :, None] - _IQ4_LEVELS).argmin(axis=2)
    levels = _IQ4_LEVELS[idx]
    fit = (x * levels).sum(1, keepdims=True) / np.maximum(
        (levels * levels).sum(1, keepdims=True), 1
    )
    d = np.where(extreme != 0, fit, 0.0).astype(np.float16)
    nibbles = (idx[:, :16] | (idx[:, 16:] << 4)).astype(np.uint8)
    return np.concatenate((d.view(np.uint8).reshape(-1, 2), nibbles), axis=1).reshape(rows, -1)


def _is_projection(tensor: gguf.ReaderTensor) -> bool:
    return (
        tensor.name.startswith("blk.")
        and tensor.name.endswith(".weight")
        and (len(tensor.shape) == 2 and int(tensor.shape[1]) > 1)
    )


def requantize(source: Path, target: Path, qtype_name: str) -> Path:
    """Write `target`: `source` with its projections in `qtype_name` (one of QUANTIZABLE)."""
    if qtype_name not in QUANTIZABLE:
        raise ValueError(f"gguf cannot quantise {qtype_name}; one of {', '.join(QUANTIZABLE)}")
    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(target, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    datas: list[np.ndarray] = []
    for tensor in reader.tensors:
        data, ttype = np.asarray(tensor.data), tensor.tensor_type
        if _is_projection(tensor) and ttype != qtype:
            shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order [out, in]
            dense = quants.dequantize(data, ttype).reshape(shape).astype(np.float32)
            if qtype == gguf.GGMLQuantizationType.IQ4_NL:
                data = quantize_iq4_nl(dense)
            else:
                data = quants.quantize(dense, qtype)
            ttype = qtype
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, ttype)
        datas.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data)
    writer.close()
    return target
