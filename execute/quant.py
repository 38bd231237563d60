"""GGML block layouts of the quant types the executor's kernels read, with numpy reference code.

Supported types (ids are ``gguf.GGMLQuantizationType`` values; this module does not import gguf):

========  ===  ======  =====  ==============================================================
name      id   bytes   wts    block layout (little-endian)
========  ===  ======  =====  ==============================================================
F32       0    4       1      float32
F16       1    2       1      float16
Q4_0      2    18      32     f16 d; u8 qs[16]: w[j] = d*((qs[j]&15)-8), w[j+16] = d*((qs[j]>>4)-8)
Q8_0      8    34      32     f16 d; i8 qs[32]: w[j] = d*qs[j]
Q4_K      12   144     256    f16 d, f16 dmin; u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min);
                              u8 qs[128]: 4 chunks of 64 weights, low nibbles then high nibbles;
                              w = d*sc[s]*q - dmin*m[s] for sub-block s = w_index // 32
Q6_K      14   210     256    u8 ql[128], u8 qh[64], i8 scales[16], f16 d;
                              w = d*scales[w_index // 16]*(q - 32), q 6-bit (4 low bits in ql,
                              2 high bits in qh, interleaved per 128-weight half)
BF16      30   2       1      bfloat16 (upper half of a float32)
MXFP4     39   17      32     u8 e (E8M0 exponent); u8 qs[16]: w[j] = K[qs[j]&15]*2^(e-128),
                              w[j+16] = K[qs[j]>>4]*2^(e-128), K = MXFP4_VALUES (E2M1 doubled);
                              17-byte blocks, so rows may start at odd addresses
========  ===  ======  =====  ==============================================================

``dequantize`` is the numpy reference used by tests and fallbacks; ``quantize`` produces valid
blocks of every type (round-to-nearest, not llama.cpp's searched scales) so tests can build
quantized weights for types gguf-py cannot quantize (Q4_K, Q6_K).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "QuantType",
    "QTYPES",
    "QTYPE_BY_NAME",
    "F32", "F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "BF16", "MXFP4",
    "MXFP4_VALUES",
    "quant_type",
    "row_bytes",
    "dequantize",
    "quantize",
    "F16_TO_F32",
]

F32, F16, Q4_0, Q8_0, Q4_K, Q6_K, BF16, MXFP4 = 0, 1, 2, 8, 12, 14, 30, 39
# MXFP4's 4-bit codes: E2M1 values doubled (so they are integers), sign in bit 3
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@dataclass(frozen=True)
class QuantType:
    """One GGML type: ``block_weights`` weights stored in ``block_bytes`` bytes."""

    name: str
    qtype: int
    block_weights: int
    block_bytes: int


QTYPES: dict[int, QuantType] = {
    F32: QuantType("F32", F32, 1, 4),
    F16: QuantType("F16", F16, 1, 2),
    Q4_0: QuantType("Q4_0", Q4_0, 32, 18),
    Q8_0: QuantType("Q8_0", Q8_0, 32, 34),
    Q4_K: QuantType("Q4_K", Q4_K, 256, 144),
    Q6_K: QuantType("Q6_K", Q6_K, 256, 210),
    BF16: QuantType("BF16", BF16, 1, 2),
    MXFP4: QuantType("MXFP4", MXFP4, 32, 17),
}
QTYPE_BY_NAME: dict[str, int] = {q.name: q.qtype for q in QTYPES.values()}

# float16 bit pattern -> float32, for kernels without a native half type (256 KiB)
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def quant_type(qtype: int, what: str = "tensor") -> QuantType:
    """The layout of ``qtype``; a ValueError naming ``what`` for an unsupported type."""
    try:
        return QTYPES[int(qtype)]
    except KeyError:
        names = ", ".join(q.name for q in QTYPES.values())
        raise ValueError(f"{what}: quant type {qtype} is not supported by the executor's kernels "
                         f"(supported: {names})") from None


def row_bytes(qtype: int, cols: int, what: str = "tensor") -> int:
    """Bytes of one row of ``cols`` weights; ``cols`` must be a whole number of blocks."""
    q = quant_type(qtype, what)
    if cols <= 0 or cols % q.block_weights:
        raise ValueError(f"{what}: {cols} columns is not a positive multiple of {q.name}'s "
                         f"block of {q.block_weights} weights")
    return cols // q.block_weights * q.block_bytes


def _blocks(data: np.ndarray, q: QuantType) -> np.ndarray:
    flat = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if flat.size % q.block_bytes:
        raise ValueError(f"{q.name}: {flat.size} bytes is not a whole number of {q.block_bytes}-byte blocks")
    return flat.reshape(-1, q.block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q4k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, 12) packed bytes -> (blocks, 8) 6-bit scales and mins."""
    sc = sc.astype(np.uint8)
    scale = np.empty((sc.shape[0], 8), np.uint8)
    mins = np.empty((sc.shape[0], 8), np.uint8)
    scale[:, :4] = sc[:, 0:4] & 63
    mins[:, :4] = sc[:, 4:8] & 63
    scale[:, 4:] = (sc[:, 8:12] & 15) | ((sc[:, 0:4] >> 6) << 4)
    mins[:, 4:] = (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)
    return scale, mins


def e8m0_scale(e: np.ndarray) -> np.ndarray:
    """MXFP4 block exponents (uint8) -> float32 2^(e - 128), exact (denormal for e < 2)."""
    return np.ldexp(np.float32(1.0), np.asarray(e, np.int32) - 128).astype(np.float32)


def dequantize(data: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """Raw blocks (any shape, ``rows * row_bytes`` bytes in all) -> float32 (rows, cols)."""
    q = quant_type(qtype)
    row_bytes(qtype, cols)
    b = _blocks(data, q)
    if qtype == F32:
        w = b.reshape(-1).view(np.float32)
    elif qtype == F16:
        w = b.reshape(-1).view(np.float16).astype(np.float32)
    elif qtype == BF16:
        w = (b.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif qtype == Q8_0:
        w = _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)
    elif qtype == Q4_0:
        qs = b[:, 2:]
        w = _f16(b[:, :2]) * (np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32) - 8)
    elif qtype == Q4_K:
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        scale, mins = _q4k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights
        nib = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
        w = (d * scale)[:, :, None] * nib - (dmin * mins)[:, :, None]
    elif qtype == Q6_K:
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        lo = np.concatenate([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        qv = (lo | (hi << 4)).astype(np.float32).reshape(-1, 16, 16) - 32
        w = (d * sc)[:, :, None] * qv
    elif qtype == MXFP4:
        qs = b[:, 1:]
        w = e8m0_scale(b[:, :1]) * MXFP4_VALUES[np.concatenate([qs & 15, qs >> 4], axis=1)]
    else:  # pragma: no cover - QTYPES and this chain list the same types
        raise AssertionError(qtype)
    return np.ascontiguousarray(w, dtype=np.float32).reshape(-1, cols)


def _round_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.rint(v), lo, hi)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float (rows, cols) -> raw blocks uint8 (rows, row_bytes): round-to-nearest reference."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize: expected a (rows, cols) array, got shape {x.shape}")
    q = quant_type(qtype)
    rows, cols = x.shape
    rb = row_bytes(qtype, cols)
    if qtype == F32:
        return np.ascontiguousarray(x).view(np.uint8).reshape(rows, rb)
    if qtype == F16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, rb)
    if qtype == BF16:
        u = x.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        return u.astype(np.uint16).view(np.uint8).reshape(rows, rb)
    blk = x.reshape(-1, q.block_weights)
    out = np.empty((blk.shape[0], q.block_bytes), np.uint8)
    if qtype == Q8_0:
        d = (np.abs(blk).max(axis=1) / 127).astype(np.float16)
        out[:, :2] = d.reshape(-1, 1).view(np.uint8)
        out[:, 2:] = _round_clip(_safe_div(blk, d.astype(np.float32)[:, None]), -127, 127).astype(np.int8).view(np.uint8)
    elif qtype == Q4_0:
        i = np.argmax(np.abs(blk), axis=1)
        d = (blk[np.arange(len(blk)), i] / -8).astype(np.float16)
        v = _round_clip(_safe_div(blk, d.astype(np.float32)[:, None]) + 8, 0, 15).astype(np.uint8)
        out[:, :2] = d.reshape(-1, 1).view(np.uint8)
        out[:, 2:] = v[:, :16] | (v[:, 16:] << 4)
    elif qtype == Q4_K:
        _quantize_q4k(blk, out)
    elif qtype == MXFP4:
        _quantize_mxfp4(blk, out)
    else:
        _quantize_q6k(blk, out)
    return out.reshape(rows, rb)


def _quantize_q4k(blk: np.ndarray, out: np.ndarray) -> None:
    sub = blk.reshape(-1, 8, 32)
    mn = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - mn) / 15
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (-mn.min(axis=1) / 63).astype(np.float16)
    sc = _round_clip(_safe_div(scale, d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = _round_clip(_safe_div(-mn, dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    off = dmin.astype(np.float32)[:, None] * m
    qv = _round_clip(_safe_div(sub + off[:, :, None], step[:, :, None]), 0, 15).astype(np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    qv = qv.reshape(-1, 4, 2, 32)
    out[:, 16:] = (qv[:, :, 0] | (qv[:, :, 1] << 4)).reshape(-1, 128)


def _quantize_q6k(blk: np.ndarray, out: np.ndarray) -> None:
    sub = blk.reshape(-1, 16, 16)
    i = np.argmax(np.abs(sub), axis=2)
    scale = np.take_along_axis(sub, i[:, :, None], axis=2)[:, :, 0] / -32
    d = (np.abs(scale).max(axis=1) / 127).astype(np.float16)
    sc = _round_clip(_safe_div(scale, d.astype(np.float32)[:, None]), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    qv = (_round_clip(_safe_div(sub, step[:, :, None]), -32, 31) + 32).astype(np.uint8)
    qv = qv.reshape(-1, 2, 4, 32)  # halves of 128, quarters of 32
    ql = np.concatenate([qv[:, :, 0] & 15 | (qv[:, :, 2] & 15) << 4,
                         qv[:, :, 1] & 15 | (qv[:, :, 3] & 15) << 4], axis=2)
    qh = (qv[:, :, 0] >> 4) | ((qv[:, :, 1] >> 4) << 2) | ((qv[:, :, 2] >> 4) << 4) | ((qv[:, :, 3] >> 4) << 6)
    out[:, :128] = ql.reshape(-1, 128)
    out[:, 128:192] = qh.reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.reshape(-1, 1).view(np.uint8)


def _quantize_mxfp4(blk: np.ndarray, out: np.ndarray, chunk: int = 4096) -> None:
    """gguf-py's scheme: e = floor(log2(max |w|)) + 125 (0 for an all-zero block, clipped to 0..254),
    then each weight's nearest code (the first in code order on a tie), ``chunk`` blocks at a time."""
    amax = np.abs(blk).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) + 125, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    d = e8m0_scale(e)
    out[:, 0] = e
    for a in range(0, len(blk), chunk):
        err = np.abs(d[a:a + chunk, None, None] * MXFP4_VALUES - blk[a:a + chunk, :, None])  # (blocks, 32, 16)
        code = np.argmin(err, axis=2).astype(np.uint8)
        out[a:a + chunk, 1:] = code[:, :16] | (code[:, 16:] << 4)
