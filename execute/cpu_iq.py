"""CPU row kernels of the lattice i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): integer dots.

Per 32 weights each type stores grid indices (IQ2_*: 4, 8 weights each; IQ3_*: 8, 4 weights
each), 32 signs and one or two scales (see ``quant``'s layout table). The grid values are
unsigned bytes <= 62, so a group's dot is grid . (x with the signs applied): one gather of the
32 grid bytes, the signs as a 32-bit mask negating activation bytes (which avoid -128), and the
same integer dot as every other type (``cpu_simd.dpbusd_isa``: exact on the avx2 path too, the
weight bytes being <= 127), per activation level. IQ2_XS and IQ2_S scale each 16 weights: lanes
0-3 and 4-7 of the dot take their own scale (``fma_cvt2``).

``IQ_TABLES`` (KSIGNS, then each grid as bytes) sits at ``cpu_experts``' code tables; the kernels
take its address.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_simd import (I8x32, comb256, dpbusd_isa, fma_cvt, fma_cvt2, hsum, load_f16, load_f32, load_i8x32, load_u8,
                       zero_f32, zero_i32)
from .iq_grids import KSIGNS, grid

__all__ = ["IQ_TABLES", "dot_iq_xxs", "dot_iq_s", "dot_iq1"]

# byte offsets in IQ_TABLES: KSIGNS, then the grids as bytes: IQ2_XXS (256 x 8), IQ3_XXS (256 x 4),
# IQ2_XS (512 x 8), IQ2_S (1024 x 8), IQ3_S (512 x 4)
_KS, _G2 = 0, 128
_G3 = _G2 + 256 * 8
_G2XS = _G3 + 256 * 4
_G2S = _G2XS + 512 * 8
_G3S = _G2S + 1024 * 8
_G1 = _G3S + 512 * 4  # IQ1_S/IQ1_M: 8 g + 8 (delta -1/8), then 8 g + 10 (delta +1/8), 2048 x 8 each
_G1_PLUS = 2048  # entries from _G1 to the +1/8 table
IQ_TABLES = np.concatenate([KSIGNS] + [grid(n).astype(np.uint8).reshape(-1)
                                       for n in ("IQ2_XXS", "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ3_S")]
                           + [(8 * grid("IQ1_S") + k).astype(np.uint8).reshape(-1) for k in (8, 10)])
assert IQ_TABLES.size == _G1 + 2 * 2048 * 8


def _gather(k: int, width: int):
    """An intrinsic (table, w, p) -> I8x32: the ``k`` entries of ``width`` bytes of the table at
    address ``table`` indexed by the k bytes at address w + p, side by side."""
    lane = ir.IntType(8 * width)
    vec = ir.VectorType(lane, k)

    @intrinsic
    def gather(typingctx, table, w, p):
        if not all(isinstance(a, types.Integer) for a in (table, w, p)):
            return None

        def codegen(context, builder, sig, args):
            t, wa, pa = (context.cast(builder, a, s, types.int64) for a, s in zip(args, sig.args))
            i64 = ir.IntType(64)
            base = builder.add(wa, pa)
            v = ir.Constant(vec, ir.Undefined)
            for j in range(k):
                idx = builder.load(builder.inttoptr(builder.add(base, ir.Constant(i64, j)), ir.PointerType(ir.IntType(8))))
                off = builder.mul(builder.zext(idx, i64), ir.Constant(i64, width))
                e = builder.load(builder.inttoptr(builder.add(t, off), ir.PointerType(lane)), align=1)
                v = builder.insert_element(v, e, ir.Constant(ir.IntType(32), j))
            return builder.bitcast(v, ir.VectorType(ir.IntType(8), 32))
        return I8x32(table, w, p), codegen
    return gather


gather8x4 = _gather(4, 8)  # IQ2_XXS: four 8-byte grid entries
gather4x8 = _gather(8, 4)  # IQ3_XXS: eight 4-byte grid entries


def _gather_at(k: int, width: int):
    """An intrinsic (table, i_0, .., i_{k-1}) -> I8x32: entries i_j (``width`` bytes each) of the
    table at address ``table``, side by side."""
    lane = ir.IntType(8 * width)
    vec = ir.VectorType(lane, k)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        t = context.cast(builder, args[0], sig.args[0], types.int64)
        v = ir.Constant(vec, ir.Undefined)
        for j in range(k):
            off = builder.mul(context.cast(builder, args[1 + j], sig.args[1 + j], types.int64), ir.Constant(i64, width))
            e = builder.load(builder.inttoptr(builder.add(t, off), ir.PointerType(lane)), align=1)
            v = builder.insert_element(v, e, ir.Constant(ir.IntType(32), j))
        return builder.bitcast(v, ir.VectorType(ir.IntType(8), 32))

    def typer(args):
        return I8x32(*args) if len(args) == k + 1 and all(isinstance(a, types.Integer) for a in args) else None

    if k == 4:
        @intrinsic
        def gather(typingctx, table, i0, i1, i2, i3):
            sig = typer((table, i0, i1, i2, i3))
            return None if sig is None else (sig, codegen)
    else:
        @intrinsic
        def gather(typingctx, table, i0, i1, i2, i3, i4, i5, i6, i7):
            sig = typer((table, i0, i1, i2, i3, i4, i5, i6, i7))
            return None if sig is None else (sig, codegen)
    return gather


gather8x4_at = _gather_at(4, 8)  # IQ2_XS, IQ2_S: four 8-byte entries of computed index
gather4x8_at = _gather_at(8, 4)  # IQ3_S: eight 4-byte entries


@intrinsic
def neg_where(typingctx, x, bits):
    """x with byte j negated where bit j of ``bits`` is set (x must avoid -128)."""
    if x != I8x32 or not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        v32 = ir.VectorType(i32, 32)
        b = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), i32)
        s = builder.insert_element(ir.Constant(v32, ir.Undefined), b, ir.Constant(i32, 0))
        s = builder.shuffle_vector(s, s, ir.Constant(v32, [0] * 32))
        hit = builder.icmp_unsigned("!=", builder.and_(s, ir.Constant(v32, [1 << j for j in range(32)])),
                                    ir.Constant(v32, None))
        zero = ir.Constant(ir.VectorType(ir.IntType(8), 32), None)
        return builder.select(hit, builder.sub(zero, args[0]), args[0])
    return I8x32(x, bits), codegen


@njit(inline="always")
def _signs(table, b):
    """The 32 sign bits of a group from its u32 ``b`` (four 7-bit KSIGNS indices)."""
    return (np.int64(load_u8(table, _KS + (b & 127))) | (np.int64(load_u8(table, _KS + ((b >> 7) & 127))) << 8)
            | (np.int64(load_u8(table, _KS + ((b >> 14) & 127))) << 16)
            | (np.int64(load_u8(table, _KS + ((b >> 21) & 127))) << 24))


@njit(inline="always")
def _u32(w, p):
    return (np.int64(load_u8(w, p)) | (np.int64(load_u8(w, p + 1)) << 8) | (np.int64(load_u8(w, p + 2)) << 16)
            | (np.int64(load_u8(w, p + 3)) << 24))


@njit(inline="always", fastmath=True)
def dot_iq_xxs(w, o, nb, xq, xo, xd, xb, l2, isa, table, three):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations (see cpu_experts._quantize):
    IQ2_XXS (three False; 66-byte blocks: f16 d, per group u32 grid indices, u32 signs + scale) or
    IQ3_XXS (98-byte blocks: f16 d, u8 qs[64], u32 signs + scale per group); ``table``:
    IQ_TABLES' address."""
    acc = zero_f32()
    bs = 98 if three else 66
    for b in range(nb // 8):
        p = o + bs * b
        d = load_f16(w, p)
        for g in range(8):
            if three:
                q = gather4x8(table + _G3, w, p + 2 + 8 * g)
                sb = _u32(w, p + 66 + 4 * g)
                db = d * (np.float32(0.5) + np.float32(sb >> 28)) * np.float32(0.5)
            else:
                q = gather8x4(table + _G2, w, p + 2 + 8 * g)
                sb = _u32(w, p + 6 + 8 * g)
                db = d * (np.float32(0.5) + np.float32(sb >> 28)) * np.float32(0.25)
            bits = _signs(table, sb)
            a = xo + 256 * b + 32 * g
            v = dpbusd_isa(isa, zero_i32(), q, neg_where(load_i8x32(xq, a), bits))
            if l2:
                v = comb256(v, dpbusd_isa(isa, zero_i32(), q, neg_where(load_i8x32(xq, a + l2), bits)))
            acc = fma_cvt(acc, v, db * load_f32(xd, xb + 8 * b + g))
    return hsum(acc)



@njit(inline="always")
def _dot32(q, xq, a, l2, bits, isa):
    """The group's integer dot per lane: grid bytes q . activations at byte a (both levels) with
    the signs ``bits`` applied."""
    v = dpbusd_isa(isa, zero_i32(), q, neg_where(load_i8x32(xq, a), bits))
    if l2:
        v = comb256(v, dpbusd_isa(isa, zero_i32(), q, neg_where(load_i8x32(xq, a + l2), bits)))
    return v


@njit(inline="always")
def _idx9(w, p, j):
    """IQ2_XS: entry j's u16 at w + p: grid index (low 9 bits), KSIGNS index (high 7)."""
    return np.int64(load_u8(w, p + 2 * j)) | (np.int64(load_u8(w, p + 2 * j + 1)) << 8)


@njit(inline="always", fastmath=True)
def dot_iq_s(w, o, nb, xq, xo, xd, xb, l2, isa, table, kind):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: kind 0 IQ2_XS (74-byte
    blocks: f16 d, u16 qs[32], u8 scales[8]), 1 IQ2_S (82: f16 d, u8 qs[32], u8 signs[32], u8
    qh[8], u8 scales[8]), 2 IQ3_S (110: f16 d, u8 qs[64], u8 qh[8], u8 signs[32], u8 scales[4]);
    ``table``: IQ_TABLES' address."""
    acc = zero_f32()
    bs = 74 if kind == 0 else 82 if kind == 1 else 110
    for b in range(nb // 8):
        p = o + bs * b
        d = load_f16(w, p)
        for g in range(8):
            a = xo + 256 * b + 32 * g
            x = load_f32(xd, xb + 8 * b + g)
            if kind == 2:
                qh = np.int64(load_u8(w, p + 66 + g))
                i = p + 2 + 8 * g
                q = gather4x8_at(table + _G3S, load_u8(w, i) | ((qh & 1) << 8), load_u8(w, i + 1) | ((qh & 2) << 7),
                                 load_u8(w, i + 2) | ((qh & 4) << 6), load_u8(w, i + 3) | ((qh & 8) << 5),
                                 load_u8(w, i + 4) | ((qh & 16) << 4), load_u8(w, i + 5) | ((qh & 32) << 3),
                                 load_u8(w, i + 6) | ((qh & 64) << 2), load_u8(w, i + 7) | ((qh & 128) << 1))
                sc = (np.int64(load_u8(w, p + 106 + g // 2)) >> (4 * (g % 2))) & 15
                v = _dot32(q, xq, a, l2, _u32(w, p + 74 + 4 * g), isa)
                acc = fma_cvt(acc, v, d * np.float32(1 + 2 * sc) * x)
                continue
            if kind == 0:
                i = p + 2 + 8 * g
                e0, e1, e2, e3 = _idx9(w, i, 0), _idx9(w, i, 1), _idx9(w, i, 2), _idx9(w, i, 3)
                q = gather8x4_at(table + _G2XS, e0 & 511, e1 & 511, e2 & 511, e3 & 511)
                bits = (np.int64(load_u8(table, _KS + (e0 >> 9))) | (np.int64(load_u8(table, _KS + (e1 >> 9))) << 8)
                        | (np.int64(load_u8(table, _KS + (e2 >> 9))) << 16)
                        | (np.int64(load_u8(table, _KS + (e3 >> 9))) << 24))
                sc = np.int64(load_u8(w, p + 66 + g))
            else:
                qh = np.int64(load_u8(w, p + 66 + g))
                i = p + 2 + 4 * g
                q = gather8x4_at(table + _G2S, load_u8(w, i) | ((qh & 3) << 8), load_u8(w, i + 1) | ((qh & 12) << 6),
                                 load_u8(w, i + 2) | ((qh & 48) << 4), load_u8(w, i + 3) | ((qh & 192) << 2))
                bits = _u32(w, p + 34 + 4 * g)
                sc = np.int64(load_u8(w, p + 74 + g))
            v = _dot32(q, xq, a, l2, bits, isa)
            acc = fma_cvt2(acc, v, d * (np.float32(0.5) + np.float32(sc & 15)) * np.float32(0.25) * x,
                           d * (np.float32(0.5) + np.float32(sc >> 4)) * np.float32(0.25) * x)
    return hsum(acc)


@njit(inline="always")
def _u16(w, p):
    return np.int64(load_u8(w, p)) | (np.int64(load_u8(w, p + 1)) << 8)


@njit(inline="always", fastmath=True)
def _f16_bits(h):
    """float16 bit pattern (an int) -> float32 (finite patterns; IQ1_M's scattered d)."""
    e = (h >> 10) & 31
    m = np.float32(h & 1023)
    v = m * np.float32(2.0 ** -24) if e == 0 else (np.float32(1024.0) + m) * np.float32(2.0) ** np.float32(e - 25)
    return -v if h & 0x8000 else v


@njit(inline="always", fastmath=True)
def dot_iq1(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table, m):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: IQ1_S (m False; 50-byte
    blocks: f16 d, u8 qs[32], u16 qh[8]) or IQ1_M (56: u8 qs[32], u8 qh[16] a nibble per 8
    weights, u16 scales[4] with d in their top nibbles). w = dl (g + delta), g in {-1, 0, 1} and
    delta +-1/8, so 8 w / dl = u - 9 with u = 8 g + 9 + 8 delta in 0..18 (the tables): per 16 or
    32 weights, dl / 8 (u . x - 9 sum x). ``table``: IQ_TABLES' address."""
    acc = zero_f32()
    corr = np.float32(0.0)
    t = table + _G1
    for b in range(nb // 8):
        if m:
            p = o + 56 * b
            sc0, sc1, sc2, sc3 = _u16(w, p + 48), _u16(w, p + 50), _u16(w, p + 52), _u16(w, p + 54)
            d = _f16_bits((sc0 >> 12) | ((sc1 >> 12) << 4) | ((sc2 >> 12) << 8) | ((sc3 >> 12) << 12))
        else:
            p = o + 50 * b
            d = load_f16(w, p)
        for g in range(8):
            a = xo + 256 * b + 32 * g
            blk = xb + 8 * b + g
            x = load_f32(xd, blk)
            if m:
                n0, n1 = np.int64(load_u8(w, p + 32 + 2 * g)), np.int64(load_u8(w, p + 33 + 2 * g))
                k0, k1, k2, k3 = n0 & 15, n0 >> 4, n1 & 15, n1 >> 4
                i = p + 4 * g
                q = gather8x4_at(t, load_u8(w, i) | ((k0 & 7) << 8) | (0 if k0 & 8 else _G1_PLUS),
                                 load_u8(w, i + 1) | ((k1 & 7) << 8) | (0 if k1 & 8 else _G1_PLUS),
                                 load_u8(w, i + 2) | ((k2 & 7) << 8) | (0 if k2 & 8 else _G1_PLUS),
                                 load_u8(w, i + 3) | ((k3 & 7) << 8) | (0 if k3 & 8 else _G1_PLUS))
                sw = _u16(w, p + 48 + 2 * (g // 2)) >> (6 * (g % 2))  # 3-bit scales of weights 0-15, 16-31
                d0 = d * np.float32(2 * (sw & 7) + 1)
                d1 = d * np.float32(2 * ((sw >> 3) & 7) + 1)
                v = dpbusd_isa(isa, zero_i32(), q, load_i8x32(xq, a))
                if l2:
                    v = comb256(v, dpbusd_isa(isa, zero_i32(), q, load_i8x32(xq, a + l2)))
                acc = fma_cvt2(acc, v, d0 * np.float32(0.125) * x, d1 * np.float32(0.125) * x)
                corr -= np.float32(1.125) * (d0 * load_f32(xs16, 2 * blk) + d1 * load_f32(xs16, 2 * blk + 1))
                continue
            qh = _u16(w, p + 34 + 2 * g)
            plus = 0 if qh & 0x8000 else _G1_PLUS
            i = p + 2 + 4 * g
            q = gather8x4_at(t, load_u8(w, i) | ((qh & 7) << 8) | plus, load_u8(w, i + 1) | (((qh >> 3) & 7) << 8) | plus,
                             load_u8(w, i + 2) | (((qh >> 6) & 7) << 8) | plus,
                             load_u8(w, i + 3) | (((qh >> 9) & 7) << 8) | plus)
            dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
            v = dpbusd_isa(isa, zero_i32(), q, load_i8x32(xq, a))
            if l2:
                v = comb256(v, dpbusd_isa(isa, zero_i32(), q, load_i8x32(xq, a + l2)))
            acc = fma_cvt(acc, v, dl * np.float32(0.125) * x)
            corr -= np.float32(1.125) * dl * load_f32(xs, blk)
    return hsum(acc) + corr
