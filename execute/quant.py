"""GGML block layouts with numpy reference code: every common GGUF type, and which the kernels read.

Ids are ``gguf.GGMLQuantizationType`` values (this module does not import gguf). ``LAYOUTS``
holds every type below; ``QTYPES`` the ones both expert paths (CPU pool and GPU arena) read;
``CPU_QTYPES`` the CPU pool's (a superset); ``GPU_EXPERT_QTYPES`` those the GPU expert path reads
as stored (``QTYPES`` by the arena's kernels, the rest by gpu_quant's); ``GPU_DENSE_QTYPES`` those
the GPU's fused dense path reads as stored. Little-endian; "lo/hi nibbles"
means byte j's low nibble is weight j and its high nibble weight j + 16 (of a 32-weight group).

========  ===  =====  ===  =================================================================
name      id   bytes  wts  block layout
========  ===  =====  ===  =================================================================
F32       0    4      1    float32
F16       1    2      1    float16
Q4_0      2    18     32   f16 d; u8 qs[16] lo/hi nibbles q: w = d*(q-8)
Q4_1      3    20     32   f16 d, f16 m; u8 qs[16] lo/hi nibbles q: w = d*q + m
Q5_0      6    22     32   f16 d; u32 qh; u8 qs[16]: q = nibble | bit j of qh << 4, w = d*(q-16)
Q5_1      7    24     32   f16 d, f16 m; u32 qh; u8 qs[16]: q as Q5_0, w = d*q + m
Q8_0      8    34     32   f16 d; i8 qs[32]: w = d*q
Q2_K      10   84     256  u8 scales[16] (lo 4 bits scale, hi 4 bits min, per 16 weights);
                           u8 qs[64]; f16 d, f16 dmin. Weight 128h + 32s + j: q = qs[32h+j] >> 2s & 3,
                           w = d*sc*q - dmin*m (sub-block = weight // 16)
Q3_K      11   110    256  u8 hmask[32]; u8 qs[64] (Q2_K's order); u8 scales[12] (16 x 6 bits);
                           f16 d. q = low 2 bits - 4 unless bit (i // 32) of hmask[i % 32] is set;
                           w = d*(sc-32)*q
Q4_K      12   144    256  f16 d, f16 dmin; u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min);
                           u8 qs[128]: 4 chunks of 64 weights, low nibbles then high nibbles;
                           w = d*sc[s]*q - dmin*m[s] for sub-block s = weight // 32
Q5_K      13   176    256  f16 d, f16 dmin; u8 scales[12] (as Q4_K); u8 qh[32]; u8 qs[128] (Q4_K's
                           nibbles); 5th bit of weight 32s + j: bit s of qh[j]; w as Q4_K
Q6_K      14   210    256  u8 ql[128], u8 qh[64], i8 scales[16], f16 d;
                           w = d*scales[w_index // 16]*(q - 32), q 6-bit (4 low bits in ql,
                           2 high bits in qh, interleaved per 128-weight half)
IQ2_XXS   16   66     256  f16 d; per 32 weights u32 a (4 grid indices, 8 weights each), u32 b:
                           signs (4 x 7 bits, KSIGNS), scale b >> 28: w = d*(0.5+s)/4*grid*sign
IQ2_XS    17   74     256  f16 d; u16 qs[32]: grid index q & 511, signs KSIGNS[q >> 9]; u8
                           scales[8], a nibble per 16 weights: w = d*(0.5+s)/4*grid*sign
IQ3_XXS   18   98     256  f16 d; u8 qs[64] (grid indices, 4 weights each); u32 per 32 weights:
                           signs as IQ2_XXS, scale >> 28: w = d*(0.5+s)/2*grid*sign
IQ1_S     19   50     256  f16 d; u8 qs[32]; u16 qh[8] per 32 weights: 3 index bits per 8 weights,
                           scale bits 12-14, delta sign bit 15: w = d*(2s+1)*(grid +- 1/8)
IQ4_NL    20   18     32   f16 d; u8 qs[16] lo/hi nibbles q: w = d*IQ4_NL_VALUES[q]
IQ3_S     21   110    256  f16 d; u8 qs[64]; u8 qh[8] (9th index bit); u8 signs[32] (a bit per
                           weight); u8 scales[4] (a nibble per 32 weights): w = d*(1+2s)*grid*sign
IQ2_S     22   82     256  f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8] (2 more index bits per 8
                           weights); u8 scales[8] (a nibble per 16): w = d*(0.5+s)/4*grid*sign
IQ4_XS    23   136    256  f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] (16 per 32 weights,
                           lo/hi nibbles): 6-bit s per 32, w = d*(s-32)*IQ4_NL_VALUES[q]
IQ1_M     29   56     256  u8 qs[32]; u8 qh[16] (a nibble per 8 weights: 3 index bits, delta
                           sign); u16 scales[4]: 3-bit scale per 16 weights, f16 d in the top
                           nibbles: w = d*(2s+1)*(grid +- 1/8)
BF16      30   2      1    bfloat16 (upper half of a float32)
MXFP4     39   17     32   u8 e (E8M0 exponent); u8 qs[16]: w[j] = K[qs[j]&15]*2^(e-128),
                           w[j+16] = K[qs[j]>>4]*2^(e-128), K = MXFP4_VALUES (E2M1 doubled);
                           17-byte blocks, so rows may start at odd addresses
========  ===  =====  ===  =================================================================

``dequantize`` is the numpy reference used by tests and fallbacks, for every type (the i-quants
in ``execute.quant_iq``); ``quantize`` produces valid blocks of the types the kernels read
(round-to-nearest, not llama.cpp's searched scales); ``random_blocks`` fills blocks of any type
with random bytes and valid scales, for kernel tests and benchmarks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "QuantType",
    "QTYPES",
    "CPU_QTYPES",
    "GPU_DENSE_QTYPES",
    "GPU_EXPERT_QTYPES",
    "LAYOUTS",
    "QTYPE_BY_NAME",
    "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "BF16", "MXFP4",
    "MXFP4_VALUES",
    "quant_type",
    "row_bytes",
    "dequantize",
    "quantize",
    "random_blocks",
    "F16_TO_F32",
]

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29
BF16, MXFP4 = 30, 39
# MXFP4's 4-bit codes: E2M1 values doubled (so they are integers), sign in bit 3
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


@dataclass(frozen=True)
class QuantType:
    """One GGML type: ``block_weights`` weights stored in ``block_bytes`` bytes."""

    name: str
    qtype: int
    block_weights: int
    block_bytes: int


LAYOUTS: dict[int, QuantType] = {q.qtype: q for q in (
    QuantType("F32", F32, 1, 4), QuantType("F16", F16, 1, 2), QuantType("Q4_0", Q4_0, 32, 18),
    QuantType("Q4_1", Q4_1, 32, 20), QuantType("Q5_0", Q5_0, 32, 22), QuantType("Q5_1", Q5_1, 32, 24),
    QuantType("Q8_0", Q8_0, 32, 34), QuantType("Q2_K", Q2_K, 256, 84), QuantType("Q3_K", Q3_K, 256, 110),
    QuantType("Q4_K", Q4_K, 256, 144), QuantType("Q5_K", Q5_K, 256, 176), QuantType("Q6_K", Q6_K, 256, 210),
    QuantType("IQ2_XXS", IQ2_XXS, 256, 66), QuantType("IQ2_XS", IQ2_XS, 256, 74),
    QuantType("IQ3_XXS", IQ3_XXS, 256, 98), QuantType("IQ1_S", IQ1_S, 256, 50),
    QuantType("IQ4_NL", IQ4_NL, 32, 18), QuantType("IQ3_S", IQ3_S, 256, 110), QuantType("IQ2_S", IQ2_S, 256, 82),
    QuantType("IQ4_XS", IQ4_XS, 256, 136), QuantType("IQ1_M", IQ1_M, 256, 56), QuantType("BF16", BF16, 1, 2),
    QuantType("MXFP4", MXFP4, 32, 17))}
# the types both expert paths read (CPU pool and GPU arena), the CPU pool's, and the GPU fused dense path's
QTYPES: dict[int, QuantType] = {t: LAYOUTS[t] for t in (F32, F16, Q4_0, Q8_0, Q4_K, Q6_K, BF16, MXFP4)}
CPU_QTYPES: dict[int, QuantType] = {**QTYPES, **{t: LAYOUTS[t] for t in (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL,
                                                                          IQ4_XS, IQ2_XXS, IQ3_XXS, IQ2_XS, IQ2_S,
                                                                          IQ3_S, IQ1_S, IQ1_M)}}
GPU_DENSE_QTYPES = (F32, F16, BF16, Q8_0)
# expert types the GPU expert path reads as stored: QTYPES by the arena's kernels, every other layout
# by gpu_quant's; a CPU type left out here is dequantized to F16 at load for runs that may use the GPU
GPU_EXPERT_QTYPES = frozenset(LAYOUTS)
QTYPE_BY_NAME: dict[str, int] = {q.name: q.qtype for q in LAYOUTS.values()}

# float16 bit pattern -> float32, for kernels without a native half type (256 KiB)
F16_TO_F32 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)


def quant_type(qtype: int, what: str = "tensor", types: dict | None = None) -> QuantType:
    """The layout of ``qtype`` if it is in ``types`` (default ``QTYPES``: what the kernels read);
    else a ValueError naming ``what`` and the supported types."""
    types = QTYPES if types is None else types
    if int(qtype) in types:
        return LAYOUTS[int(qtype)]
    names = ", ".join(LAYOUTS[t].name for t in types)
    name = LAYOUTS[int(qtype)].name if int(qtype) in LAYOUTS else f"type {qtype}"
    raise ValueError(f"{what}: quant type {qtype} ({name}) is not supported here (supported: {names})")


def row_bytes(qtype: int, cols: int, what: str = "tensor", types: dict | None = None) -> int:
    """Bytes of one row of ``cols`` weights; ``cols`` must be a whole number of blocks; ``types``
    as in ``quant_type``."""
    q = quant_type(qtype, what, types)
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


def _bits(b: np.ndarray, shifts, mask: int) -> np.ndarray:
    """(n, k) unsigned ints -> (n, len(shifts), k): (b >> shift) & mask, one row per shift."""
    return (b[:, None, :] >> np.asarray(shifts, b.dtype)[None, :, None]) & b.dtype.type(mask)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16 k) bytes -> (n, 32 k) lo/hi nibbles per 16-byte group (weights j and j + 16)."""
    g = qs.reshape(qs.shape[0], -1, 16)
    return np.concatenate([g & 15, g >> 4], axis=2).reshape(qs.shape[0], -1)


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


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of Q5_0/Q5_1's u32 -> (n, 32) fifth bits (16 per weight value), bit j = weight j."""
    return ((qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _k_low2(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K's (n, 64) bytes -> (n, 256) 2-bit values: weight 128h + 32s + j is bits 2s of byte 32h + j."""
    return _bits(qs.reshape(-1, 32), (0, 2, 4, 6), 3).reshape(qs.shape[0], 256)


def _q3k_scales(sc: np.ndarray) -> np.ndarray:
    """(n, 12) bytes -> (n, 16) 6-bit scales minus 32: low nibbles of bytes 0-7 (then high), top 2
    bits from bytes 8-11 (2 bits per scale, scale k at bits 2 (k // 4) of byte 8 + k % 4)."""
    lo = _bits(sc[:, :8], (0, 4), 15).reshape(-1, 16)
    hi = _bits(sc[:, 8:12], (0, 2, 4, 6), 3).reshape(-1, 16)
    return (lo | (hi << 4)).astype(np.float32) - 32


def _dequantize_blocks(b: np.ndarray, qtype: int) -> np.ndarray:
    """(n, block_bytes) blocks -> (n, block_weights) float32 (every type but the i-quants)."""
    if qtype == F32:
        return b.reshape(-1).view(np.float32)
    if qtype == F16:
        return b.reshape(-1).view(np.float16).astype(np.float32)
    if qtype == BF16:
        return (b.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if qtype == Q8_0:
        return _f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)
    if qtype == Q4_0:
        return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)
    if qtype == Q4_1:
        return _f16(b[:, :2]) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b[:, 2:4])
    if qtype == Q5_0:
        return _f16(b[:, :2]) * ((_nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])).astype(np.float32) - 16)
    if qtype == Q5_1:
        return _f16(b[:, :2]) * (_nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])).astype(np.float32) + _f16(b[:, 2:4])
    if qtype == Q2_K:
        sc = b[:, :16]
        dl = (_f16(b[:, 80:82]) * (sc & 15).astype(np.float32))[:, :, None]
        ml = (_f16(b[:, 82:84]) * (sc >> 4).astype(np.float32))[:, :, None]
        return (dl * _k_low2(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32) - ml).reshape(-1, 256)
    if qtype == Q3_K:
        hbit = _bits(b[:, :32], range(8), 1).reshape(-1, 256)
        q = _k_low2(b[:, 32:96]).astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
        dl = (_f16(b[:, 108:110]) * _q3k_scales(b[:, 96:108]))[:, :, None]
        return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        scale, mins = _q4k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 32) if qtype == Q4_K else b[:, 48:].reshape(-1, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
        if qtype == Q5_K:
            q = q | (_bits(b[:, 16:48], range(8), 1) << 4)
        return ((d * scale)[:, :, None] * q.astype(np.float32) - (dmin * mins)[:, :, None]).reshape(-1, 256)
    if qtype == Q6_K:
        ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[:, 208:210])
        lo = np.concatenate([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        qv = (lo | (hi << 4)).astype(np.float32).reshape(-1, 16, 16) - 32
        return ((d * sc)[:, :, None] * qv).reshape(-1, 256)
    if qtype == MXFP4:
        return e8m0_scale(b[:, :1]) * MXFP4_VALUES[_nibbles(b[:, 1:])]
    from . import quant_iq

    return quant_iq.dequantize_blocks(b, qtype)


_DEQUANT_WEIGHTS = 1 << 19  # weights per piece of a large dequantize


def dequantize(data: np.ndarray, qtype: int, cols: int) -> np.ndarray:
    """Raw blocks of any type in ``LAYOUTS`` (any shape, ``rows * row_bytes`` bytes in all) ->
    float32 (rows, cols)."""
    q = quant_type(qtype, "dequantize", LAYOUTS)
    row_bytes(qtype, cols, "dequantize", LAYOUTS)
    b = _blocks(data, q)
    step = max(1, _DEQUANT_WEIGHTS // q.block_weights)
    if qtype in (F32, F16, BF16) or len(b) <= step:
        w = _dequantize_blocks(b, int(qtype))
        return np.ascontiguousarray(w, dtype=np.float32).reshape(-1, cols)
    # in pieces of ~2 MB of output, whose temporaries stay in the caches (the same values)
    out = np.empty((len(b), q.block_weights), np.float32)
    for i in range(0, len(b), step):
        j = min(i + step, len(b))
        if qtype == Q8_0:  # d * q straight into the output
            np.multiply(_f16(b[i:j, :2]), b[i:j, 2:].view(np.int8), out=out[i:j])
        else:
            out[i:j] = _dequantize_blocks(b[i:j], int(qtype)).reshape(j - i, -1)
    return out.reshape(-1, cols)


# byte offsets of each type's f16 scale fields, for random_blocks (IQ1_M's d is split, MXFP4 has an exponent)
_F16_FIELDS = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q2_K: (80, 82), Q3_K: (108,),
               Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,), IQ2_XXS: (0,), IQ2_XS: (0,), IQ3_XXS: (0,), IQ1_S: (0,),
               IQ4_NL: (0,), IQ3_S: (0,), IQ2_S: (0,), IQ4_XS: (0,)}


def random_blocks(rng: np.random.Generator, qtype: int, rows: int, cols: int, scale: float = 0.01) -> np.ndarray:
    """uint8 (rows, row_bytes) of any type: random bytes with every f16 scale set to a random
    value of magnitude ~``scale`` (so weights are finite; float types: N(0, scale) weights)."""
    q = quant_type(qtype, "random_blocks", LAYOUTS)
    rb = row_bytes(qtype, cols, "random_blocks", LAYOUTS)
    if q.block_weights == 1:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale), qtype)
    data = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
    b = data.reshape(-1, q.block_bytes)
    d = (scale * rng.uniform(0.5, 1.5, (len(b), 1))).astype(np.float16)
    for off in _F16_FIELDS.get(qtype, ()):
        b[:, off:off + 2] = d.view(np.uint8)
    if qtype == IQ1_M:  # d's 16 bits in the top nibbles of the four u16 scales
        sc = b[:, 48:56].copy().view(np.uint16)
        nib = (d.view(np.uint16) >> np.arange(0, 16, 4, dtype=np.uint16)) & 15
        b[:, 48:56] = ((sc & 0x0FFF) | (nib << 12)).view(np.uint8)
    if qtype == MXFP4:
        b[:, 0] = np.uint8(round(np.log2(scale / 4)) + 128)
    return data


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
