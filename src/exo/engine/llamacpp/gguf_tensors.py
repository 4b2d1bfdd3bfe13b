"""Checkpoint tensors as ggml wants them, with numpy alone: a safetensors reader (bf16
included, which numpy has no dtype for) and MLX's affine quantization turned into ggml
blocks.

MLX affine quantization stores, per Linear (or Embedding), `weight` (uint32, element i
of each word at bits `bits * i`), and per group of `group_size` inputs a `scales` and a
`biases` row: w = scale * q + bias. ggml's Q4_1 is the same formula over blocks of 32
(d = scale, m = bias, both f16; byte j holds element j low and j + 16 high), so a 4-bit
group of any multiple of 32 is one or more Q4_1 blocks with the group's scale and bias:
the codes are moved, never requantized. The scales become f16: exact for bf16 and f16
scales inside f16's normal range (magnitude 2**-14 to 65504); `f16_inexact` counts the
ones that are not. 8-bit affine has no ggml twin (Q8_0 is symmetric, d * q): it is
dequantized and quantized again to Q8_0."""

import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quantize

_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),  # raw bits; as_float32 widens them
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
}


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor, read lazily from its file's memory map."""

    dtype: str  # safetensors' name: F32, BF16, U32, ...
    shape: tuple[int, ...]
    _buffer: mmap.mmap
    _start: int
    _end: int

    def raw(self) -> np.ndarray:
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=self._end - self._start, offset=self._start)
        return data.view(_DTYPES[self.dtype]).reshape(self.shape)

    def as_float32(self) -> np.ndarray:
        data = self.raw()
        if self.dtype == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32)


def read_safetensors(paths: list[Path]) -> dict[str, Tensor]:
    """Every tensor of these files by name (the files stay mapped while a tensor lives)."""
    tensors: dict[str, Tensor] = {}
    for path in paths:
        with path.open("rb") as file:
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        header_len = int.from_bytes(buffer[:8], "little")
        header = json.loads(buffer[8 : 8 + header_len])
        base = 8 + header_len
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ValueError(
                    f"{path.name}: tensor {name} has dtype {entry['dtype']}, which the converter does not read"
                )
            start, end = entry["data_offsets"]
            tensors[name] = Tensor(entry["dtype"], tuple(entry["shape"]), buffer, base + start, base + end)
    return tensors


@dataclass(frozen=True)
class Affine:
    """An MLX affine-quantized weight: packed codes, and a scale and bias per group."""

    weight: np.ndarray  # uint32 (..., in * bits / 32)
    scales: np.ndarray  # float32 (..., in / group_size), exactly the checkpoint's values
    biases: np.ndarray
    bits: int
    group_size: int


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's uint32 words to one uint8 code per element (element i of a word at bits * i)."""
    if bits == 8:
        return packed.view(np.uint8).reshape(*packed.shape[:-1], -1)
    if bits == 4:
        octets = packed.view(np.uint8)
        codes = np.stack([octets & 0x0F, octets >> 4], axis=-1)
        return codes.reshape(*packed.shape[:-1], -1)
    raise ValueError(f"{bits}-bit MLX quantization has no ggml mapping here")


def dequantize_affine(q: Affine) -> np.ndarray:
    codes = unpack_codes(q.weight, q.bits).astype(np.float32)
    grouped = codes.reshape(*q.scales.shape, q.group_size)
    return (grouped * q.scales[..., None] + q.biases[..., None]).reshape(codes.shape)


def f16_inexact(values: np.ndarray) -> int:
    """How many of these float32 values change when stored as f16."""
    return int(np.count_nonzero(values.astype(np.float16).astype(np.float32) != values))


def q4_1_blocks(q: Affine) -> np.ndarray:
    """ggml Q4_1 bytes (..., in / 32 * 20) holding exactly MLX's 4-bit codes, scales, biases."""
    if q.bits != 4 or q.group_size % 32:
        raise ValueError(f"affine {q.bits}-bit groups of {q.group_size} are not Q4_1 blocks")
    codes = unpack_codes(q.weight, 4)
    blocks = codes.reshape(*codes.shape[:-1], -1, 32)
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)
    per_group = q.group_size // 32
    d = np.repeat(q.scales, per_group, axis=-1).astype(np.float16)[..., None].view(np.uint8)
    m = np.repeat(q.biases, per_group, axis=-1).astype(np.float16)[..., None].view(np.uint8)
    out = np.concatenate([d, m, packed], axis=-1)
    return out.reshape(*codes.shape[:-1], -1)


def ggml_quantized(q: Affine) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The ggml type closest to an MLX affine weight, and its bytes."""
    if q.bits == 4 and q.group_size % 32 == 0:
        return q4_1_blocks(q), GGMLQuantizationType.Q4_1
    if q.bits == 8:
        values = dequantize_affine(q)
        return quantize(values.reshape(-1, values.shape[-1]), GGMLQuantizationType.Q8_0).reshape(
            *values.shape[:-1], -1
        ), GGMLQuantizationType.Q8_0
    raise ValueError(f"MLX affine {q.bits}-bit, groups of {q.group_size}: no ggml type holds it")
