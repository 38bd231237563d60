"""numpy dequantization of the i-quants (IQ1_S .. IQ4_XS): reference code for tests and fallbacks.

Block layouts: the table in ``execute.quant``; grids, sign table and levels: ``execute.iq_grids``.
Every function takes ``(n, block_bytes)`` uint8 blocks and returns ``(n, 256)`` float32 weights
(IQ4_NL: ``(n, 32)``), computed in the order gguf-py computes them (a float32 scale per group,
then times the grid value and the sign).
"""
from __future__ import annotations

import numpy as np

from . import iq_grids as G

__all__ = ["dequantize_blocks"]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # (n, 1)


def _u(b: np.ndarray, dtype) -> np.ndarray:
    """Little-endian unsigned ints from whole rows of bytes (a copy: fields may be unaligned)."""
    return np.ascontiguousarray(b).view(dtype)


def _sign_bits(signs: np.ndarray) -> np.ndarray:
    """(n, k) sign bytes -> (n, 8 k) float32 +-1 (bit i of byte j: weight 8 j + i negative)."""
    bits = np.unpackbits(signs, axis=1, bitorder="little")
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def _ksigns(idx: np.ndarray) -> np.ndarray:
    """7-bit KSIGNS indices (any shape) -> (..., 8) float32 +-1."""
    flat = G.KSIGNS[idx.reshape(-1)].reshape(-1, 1)
    return _sign_bits(flat).reshape(*idx.shape, 8)


def _scaled(db: np.ndarray, grid: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """db (n, groups) x grid values x signs (n, groups, per group) -> (n, 256)."""
    return (db[:, :, None] * grid * signs).reshape(db.shape[0], -1)


def _iq2_xxs(b):
    d = _f16(b[:, :2])
    q = _u(b[:, 2:66], np.uint32).reshape(-1, 8, 2)  # per 32 weights: grid bytes, signs + scale
    db = d * (np.float32(0.5) + (q[:, :, 1] >> 28).astype(np.float32)) * np.float32(0.25)
    signs = _ksigns((q[:, :, 1, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127)  # (n, 8, 4, 8)
    grid = G.grid("IQ2_XXS")[q[:, :, 0].copy().view(np.uint8).reshape(-1, 8, 4)]  # (n, 8, 4, 8)
    return _scaled(db, grid.reshape(-1, 8, 32), signs.reshape(-1, 8, 32))


def _iq2_xs(b):
    d = _f16(b[:, :2])
    q = _u(b[:, 2:66], np.uint16)  # (n, 32): 8 weights each
    sc = np.stack([b[:, 66:74] & 15, b[:, 66:74] >> 4], axis=2).reshape(-1, 16)
    db = d * (np.float32(0.5) + sc.astype(np.float32)) * np.float32(0.25)
    grid = G.grid("IQ2_XS")[q & 511].reshape(-1, 16, 16)
    return _scaled(db, grid, _ksigns(q >> 9).reshape(-1, 16, 16))


def _iq2_s(b):
    d = _f16(b[:, :2])
    qh = ((b[:, 66:74, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1, 32).astype(np.uint16)
    idx = b[:, 2:34].astype(np.uint16) | (qh << 8)
    sc = np.stack([b[:, 74:82] & 15, b[:, 74:82] >> 4], axis=2).reshape(-1, 16)
    db = d * (np.float32(0.5) + sc.astype(np.float32)) * np.float32(0.25)
    grid = G.grid("IQ2_S")[idx].reshape(-1, 16, 16)
    return _scaled(db, grid, _sign_bits(b[:, 34:66]).reshape(-1, 16, 16))


def _iq3_xxs(b):
    d = _f16(b[:, :2])
    s = _u(b[:, 66:98], np.uint32)  # (n, 8): per 32 weights
    db = d * (np.float32(0.5) + (s >> 28).astype(np.float32)) * np.float32(0.5)
    signs = _ksigns((s[:, :, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127)
    grid = G.grid("IQ3_XXS")[b[:, 2:66]].reshape(-1, 8, 32)
    return _scaled(db, grid, signs.reshape(-1, 8, 32))


def _iq3_s(b):
    d = _f16(b[:, :2])
    qh = np.unpackbits(b[:, 66:74], axis=1, bitorder="little").astype(np.uint16)
    idx = b[:, 2:66].astype(np.uint16) | (qh << 8)
    sc = np.stack([b[:, 106:110] & 15, b[:, 106:110] >> 4], axis=2).reshape(-1, 8)
    db = d * (1 + 2 * sc.astype(np.float32))
    grid = G.grid("IQ3_S")[idx].reshape(-1, 8, 32)
    return _scaled(db, grid, _sign_bits(b[:, 74:106]).reshape(-1, 8, 32))


def _iq1_s(b):
    d = _f16(b[:, :2])
    qh = _u(b[:, 34:50], np.uint16)  # (n, 8): per 32 weights
    dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
    delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125))
    idx = b[:, 2:34].astype(np.uint16) | (((qh[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7) << 8).reshape(-1, 32)
    grid = G.grid("IQ1_S")[idx].reshape(-1, 8, 32)
    return (dl[:, :, None] * (grid + delta[:, :, None])).reshape(-1, 256)


def _iq1_m(b):
    sc = _u(b[:, 48:56], np.uint16)  # (n, 4)
    dbits = (sc >> 12) << np.array([0, 4, 8, 12], np.uint16)
    d = np.bitwise_or.reduce(dbits, axis=1).view(np.float16).astype(np.float32)[:, None]
    s3 = ((sc[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(-1, 16)  # per 16 weights
    dl = d * (2 * s3 + 1).astype(np.float32)
    nib = np.stack([b[:, 32:48] & 15, b[:, 32:48] >> 4], axis=2).reshape(-1, 32)  # per 8 weights
    idx = b[:, :32].astype(np.uint16) | ((nib & 7).astype(np.uint16) << 8)
    delta = np.where(nib & 8, np.float32(-0.125), np.float32(0.125))
    grid = G.grid("IQ1_M")[idx] + delta[:, :, None]  # (n, 32, 8)
    return (dl[:, :, None] * grid.reshape(-1, 16, 16)).reshape(-1, 256)


def _iq4_nl(b):
    qs = b[:, 2:18]
    q = np.concatenate([qs & 15, qs >> 4], axis=1)
    return _f16(b[:, :2]) * G.IQ4_NL_VALUES[q].astype(np.float32)


def _iq4_xs(b):
    d = _f16(b[:, :2])
    sh = _u(b[:, 2:4], np.uint16)  # (n, 1)
    lo = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
    hi = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
    dl = d * ((lo | (hi << 4)).astype(np.float32) - 32)
    qs = b[:, 8:136].reshape(-1, 8, 16)
    q = np.concatenate([qs & 15, qs >> 4], axis=2)  # (n, 8, 32)
    return (dl[:, :, None] * G.IQ4_NL_VALUES[q].astype(np.float32)).reshape(-1, 256)


_BY_TYPE = {16: _iq2_xxs, 17: _iq2_xs, 18: _iq3_xxs, 19: _iq1_s, 20: _iq4_nl, 21: _iq3_s, 22: _iq2_s, 23: _iq4_xs,
            29: _iq1_m}


def dequantize_blocks(b: np.ndarray, qtype: int) -> np.ndarray:
    """(n, block_bytes) uint8 blocks of i-quant ``qtype`` -> (n, block_weights) float32."""
    return _BY_TYPE[qtype](b)
