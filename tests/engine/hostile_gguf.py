"""Write GGUF files byte by byte, lies included (any helper may import this).

`gguf.GGUFWriter` refuses to write what these tests need: counts larger than the file,
arrays nested thousands deep, zero heads. `raw_gguf` writes exactly what it is given.
"""

from __future__ import annotations

import struct
from pathlib import Path

T_UINT32, T_FLOAT32, T_STRING, T_ARRAY, T_UINT64 = 4, 6, 8, 9, 10
F32 = 0


def enc_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One key/value pair; `payload` is the value's bytes as GGUF stores them."""
    return enc_string(key) + struct.pack("<I", vtype) + payload


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, T_UINT32, struct.pack("<I", value))


def kv_f32(key: str, value: float) -> bytes:
    return kv(key, T_FLOAT32, struct.pack("<f", value))


def kv_str(key: str, value: str) -> bytes:
    return kv(key, T_STRING, enc_string(value))


def tensor_info(
    name: str, dims_torch_order: tuple[int, ...], offset: int, qtype: int = F32
) -> bytes:
    dims = tuple(reversed(dims_torch_order))  # GGUF stores the innermost dimension first
    out = enc_string(name) + struct.pack("<I", len(dims))
    out += b"".join(struct.pack("<Q", d) for d in dims)
    return out + struct.pack("<IQ", qtype, offset)


def raw_gguf(
    path: Path,
    kvs: list[bytes],
    tensors: list[tuple[str, tuple[int, ...]]] = (),  # type: ignore[assignment]
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    tail: bytes = b"",
) -> Path:
    """A GGUF v3 file: header counts (given, or the true ones), the pairs, F32 tensor infos
    with zero-filled data laid out one after another (32-byte aligned), then `tail`."""
    infos, offset = [], 0
    for name, shape in tensors:
        infos.append(tensor_info(name, shape, offset))
        n = 1
        for d in shape:
            n *= d
        offset += (n * 4 + 31) // 32 * 32
    head = b"GGUF" + struct.pack(
        "<IQQ",
        3,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % 32 if tensors else 0
    path.write_bytes(body + b"\0" * pad + b"\0" * offset + tail)
    return path


def llama_kvs(
    *,
    blocks: int = 1,
    dim: int = 8,
    heads: int = 2,
    kv_heads: int = 1,
    ffn: int = 16,
    extra: dict[str, int | float] | None = None,
) -> list[bytes]:
    """The metadata of a tiny llama (no tokenizer: the GGUF reader does not need one)."""
    kvs = [
        kv_str("general.architecture", "llama"),
        kv_u32("llama.block_count", blocks),
        kv_u32("llama.embedding_length", dim),
        kv_u32("llama.attention.head_count", heads),
        kv_u32("llama.attention.head_count_kv", kv_heads),
        kv_u32("llama.feed_forward_length", ffn),
    ]
    kvs += [kv_u32(k, v) if isinstance(v, int) else kv_f32(k, v) for k, v in (extra or {}).items()]
    return kvs


def llama_tensors(
    *,
    blocks: int = 1,
    dim: int = 8,
    heads: int = 2,
    kv_heads: int = 1,
    ffn: int = 16,
    vocab: int = 16,
) -> list[tuple[str, tuple[int, ...]]]:
    hd = dim // heads
    out: list[tuple[str, tuple[int, ...]]] = [
        ("token_embd.weight", (vocab, dim)),
        ("output_norm.weight", (dim,)),
    ]
    for i in range(blocks):
        out += [
            (f"blk.{i}.attn_norm.weight", (dim,)),
            (f"blk.{i}.attn_q.weight", (heads * hd, dim)),
            (f"blk.{i}.attn_k.weight", (kv_heads * hd, dim)),
            (f"blk.{i}.attn_v.weight", (kv_heads * hd, dim)),
            (f"blk.{i}.attn_output.weight", (dim, heads * hd)),
            (f"blk.{i}.ffn_norm.weight", (dim,)),
            (f"blk.{i}.ffn_gate.weight", (ffn, dim)),
            (f"blk.{i}.ffn_up.weight", (ffn, dim)),
            (f"blk.{i}.ffn_down.weight", (dim, ffn)),
        ]
    return out
