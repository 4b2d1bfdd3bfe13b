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


def _ascending(q: Affine) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases of a 4-bit weight with every scale positive: MLX gives a
    group whose largest magnitude is positive a negative scale (w = s * q + b, b the
    group's maximum); s * q + b = -s * (15 - q) + (b + 15 * s) turns it around exactly."""
    codes = unpack_codes(q.weight, 4).reshape(*q.scales.shape, q.group_size)
    flip = q.scales < 0
    codes = np.where(flip[..., None], 15 - codes, codes)
    biases = np.where(flip, q.biases + 15 * q.scales, q.biases)
    return codes.reshape(*codes.shape[:-2], -1), np.abs(q.scales), biases


def q4_k_fits(scales: np.ndarray, biases: np.ndarray, group_size: int) -> bool:
    """Whether Q4_K holds a 4-bit weight with these groups: rows of whole 256-blocks
    and, with every scale made positive, no group whose lowest level is above zero
    (Q4_K subtracts its mins)."""
    if group_size % 32 or scales.shape[-1] * group_size % 256:
        return False
    return bool(np.all(np.where(scales < 0, biases + 15 * scales, biases) <= 0))


def q4_k_blocks(q: Affine) -> np.ndarray:
    """ggml Q4_K bytes (..., in / 256 * 144): MLX's 4-bit codes kept, each 32-weight
    sub-block's scale and min stored as 6-bit multiples of the 256-block's f16 `d` and
    `dmin` (llama.cpp's block_q4_K layout). Not exact like Q4_1: rounding the scales to
    6 bits moves a weight by ~1% of the group's step, against the codes' own rounding of
    up to half a step; llama.cpp has repacked AVX2/AVX-512 kernels for Q4_K, none for
    Q4_1 (here 1.5-2.5x the decode and prefill)."""
    codes, scales, biases = _ascending(q)
    per_group = q.group_size // 32
    sub_scales = np.repeat(scales, per_group, axis=-1).reshape(-1, 8)
    sub_mins = np.repeat(-biases, per_group, axis=-1).reshape(-1, 8)
    sub_codes = codes.reshape(-1, 8, 32).astype(np.float32)
    d = (sub_scales.max(axis=-1) / 63).astype(np.float16)
    dmin = (sub_mins.max(axis=-1) / 63).astype(np.float16)
    sc, mn = _six_bit_pair(sub_codes, sub_scales, sub_mins, d.astype(np.float32), dmin.astype(np.float32))
    packed = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    packed[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    # Each 64 weights: the first 32 in the low nibbles of 32 bytes, the next 32 high.
    chunks = codes.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, qs], axis=-1)
    return out.reshape(*codes.shape[:-1], -1)


def _six_bit_pair(
    codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, d: np.ndarray, dmin: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's 6-bit scale and min multiples: of the floor and ceiling of each,
    the pair nearest the sub-block's own weights (its codes are fixed)."""
    d, dmin = d[:, None], dmin[:, None]
    safe_d, safe_dmin = np.where(d == 0, 1, d), np.where(dmin == 0, 1, dmin)
    best_error = np.full(scales.shape, np.inf, dtype=np.float32)
    best_sc = np.zeros(scales.shape, dtype=np.uint8)
    best_mn = np.zeros(scales.shape, dtype=np.uint8)
    for sc_round in (np.floor, np.ceil):
        sc = np.clip(sc_round(scales / safe_d), 0, 63)
        for mn_round in (np.floor, np.ceil):
            mn = np.clip(mn_round(mins / safe_dmin), 0, 63)
            # w - w' = q * (s - d * sc) - (m - dmin * mn), summed squared over the codes.
            error = ((codes * (scales - d * sc)[..., None] - (mins - dmin * mn)[..., None]) ** 2).sum(axis=-1)
            better = error < best_error
            best_error = np.where(better, error, best_error)
            best_sc = np.where(better, sc.astype(np.uint8), best_sc)
            best_mn = np.where(better, mn.astype(np.uint8), best_mn)
    return best_sc, best_mn


def ggml_quantized(q: Affine, exact_q4: bool = False) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The ggml type for an MLX affine weight, and its bytes: 4-bit as Q4_K where it
    fits (unless `exact_q4`), else Q4_1; 8-bit as Q8_0."""
    if q.bits == 4 and not exact_q4 and q4_k_fits(q.scales, q.biases, q.group_size):
        return q4_k_blocks(q), GGMLQuantizationType.Q4_K
    if q.bits == 4 and q.group_size % 32 == 0:
        return q4_1_blocks(q), GGMLQuantizationType.Q4_1
    if q.bits == 8:
        values = dequantize_affine(q)
        return quantize(values.reshape(-1, values.shape[-1]), GGMLQuantizationType.Q8_0).reshape(
            *values.shape[:-1], -1
        ), GGMLQuantizationType.Q8_0
    raise ValueError(f"MLX affine {q.bits}-bit, groups of {q.group_size}: no ggml type holds it")
