"""CPU row kernels of the lattice i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): integer dots.

Per 32 weights each type stores grid indices (IQ2_*: 4, 8 weights each; IQ3_*: 8, 4 weights
each), 32 signs and one or two scales (see ``quant``'s layout table). The grid values are
unsigned bytes <= 62: a group's 32 grid bytes are gathered by its indices and its signs applied
to them as 64 +- grid (``sign_off``: unsigned 2..126, so the avx2 path's int16 pair sums stay
exact), the 64 taken off through the activation sums. A block's 8 groups are staged on the stack
and dotted behind one branch on the instruction-set path (``cpu_kq.dots``, both activation
levels); IQ2_XS, IQ2_S and IQ1_* scale each 16 weights (``acc_dots16``).

``IQ_TABLES`` (KSIGNS, then each grid as bytes) sits at ``cpu_experts``' code tables; the kernels
take its address.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_kq import (acc_dots, acc_dots16, block_scratch, dots, dup_hi, dup_lo, fadd, fmul, load_f32x8, load_u32, load_u64,
                     nibbles8, store_i8x32, u8_f32x8, zip_hi, zip_lo)
from .cpu_simd import I8x32, hsum, load_f16, load_u8, store_f32, zero_f32
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
def sign_off(typingctx, q, bits):
    """64 + q (byte j) negated where bit j of ``bits`` is set: signed grid bytes (|q| <= 62) as
    unsigned 2..126, for an unsigned x signed dot (the 64 comes off through the activation sums)."""
    if q != I8x32 or not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        b = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), ir.IntType(32))
        neg = builder.bitcast(b, ir.VectorType(ir.IntType(1), 32))
        v32 = ir.VectorType(ir.IntType(8), 32)
        c64 = ir.Constant(v32, [64] * 32)
        return builder.select(neg, builder.sub(c64, args[0]), builder.add(c64, args[0]))
    return I8x32(q, bits), codegen


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


@njit(inline="always")
def _xxs(table, w, p, g, three):
    """Group g of an IQ2_XXS/IQ3_XXS block at byte p: its weights as sign_off bytes and its scale
    (0.5 + the u32's top 4 bits) / 4 (IQ2_XXS) or / 2 (IQ3_XXS), to multiply d by."""
    if three:
        q = gather4x8(table + _G3, w, p + 2 + 8 * g)
        sb = _u32(w, p + 66 + 4 * g)
        return sign_off(q, _signs(table, sb)), (np.float32(0.5) + np.float32(sb >> 28)) * np.float32(0.5)
    q = gather8x4(table + _G2, w, p + 2 + 8 * g)
    sb = _u32(w, p + 6 + 8 * g)
    return sign_off(q, _signs(table, sb)), (np.float32(0.5) + np.float32(sb >> 28)) * np.float32(0.25)


@njit(inline="always", fastmath=True)
def dot_iq_xxs(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table, three):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations (see cpu_experts._quantize):
    IQ2_XXS (three False; 66-byte blocks: f16 d, per group u32 grid indices, u32 signs + scale) or
    IQ3_XXS (98-byte blocks: f16 d, u8 qs[64], u32 signs + scale per group); ``table``:
    IQ_TABLES' address. A block's 8 dots behind one branch on the path (cpu_simd.dots)."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
    bs = 98 if three else 66
    for b in range(nb // 8):
        p = o + bs * b
        for g in range(8):
            q, sg = _xxs(table, w, p, g, three)
            store_i8x32(buf, 32 * g, q)
            store_f32(buf + 256, g, sg)
        f = fmul(load_f32x8(buf + 256, 0), load_f16(w, p))
        blk = xb + 8 * b
        acc = acc_dots(acc, dots(isa, buf, xq, xo + 256 * b, l2), fmul(f, load_f32x8(xd, blk)))
        cor = fadd(cor, fmul(f, load_f32x8(xs, blk)))
    return hsum(acc) - np.float32(64.0) * hsum(cor)


@njit(inline="always")
def _idx9(w, p, j):
    """IQ2_XS: entry j's u16 at w + p: grid index (low 9 bits), KSIGNS index (high 7)."""
    return np.int64(load_u8(w, p + 2 * j)) | (np.int64(load_u8(w, p + 2 * j + 1)) << 8)


@njit(inline="always")
def _grp_s(table, w, p, g, kind):
    """Group g's weights as sign_off bytes: IQ2_XS (kind 0), IQ2_S (1), IQ3_S (2)."""
    if kind == 2:
        qh = np.int64(load_u8(w, p + 66 + g))
        i = p + 2 + 8 * g
        q = gather4x8_at(table + _G3S, load_u8(w, i) | ((qh & 1) << 8), load_u8(w, i + 1) | ((qh & 2) << 7),
                         load_u8(w, i + 2) | ((qh & 4) << 6), load_u8(w, i + 3) | ((qh & 8) << 5),
                         load_u8(w, i + 4) | ((qh & 16) << 4), load_u8(w, i + 5) | ((qh & 32) << 3),
                         load_u8(w, i + 6) | ((qh & 64) << 2), load_u8(w, i + 7) | ((qh & 128) << 1))
        return sign_off(q, _u32(w, p + 74 + 4 * g))
    if kind == 0:
        i = p + 2 + 8 * g
        e0, e1, e2, e3 = _idx9(w, i, 0), _idx9(w, i, 1), _idx9(w, i, 2), _idx9(w, i, 3)
        q = gather8x4_at(table + _G2XS, e0 & 511, e1 & 511, e2 & 511, e3 & 511)
        bits = (np.int64(load_u8(table, _KS + (e0 >> 9))) | (np.int64(load_u8(table, _KS + (e1 >> 9))) << 8)
                | (np.int64(load_u8(table, _KS + (e2 >> 9))) << 16) | (np.int64(load_u8(table, _KS + (e3 >> 9))) << 24))
        return sign_off(q, bits)
    qh = np.int64(load_u8(w, p + 66 + g))
    i = p + 2 + 4 * g
    q = gather8x4_at(table + _G2S, load_u8(w, i) | ((qh & 3) << 8), load_u8(w, i + 1) | ((qh & 12) << 6),
                     load_u8(w, i + 2) | ((qh & 48) << 4), load_u8(w, i + 3) | ((qh & 192) << 2))
    return sign_off(q, _u32(w, p + 34 + 4 * g))


@njit(inline="always", fastmath=True)
def dot_iq_s(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table, kind):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: kind 0 IQ2_XS (74-byte
    blocks: f16 d, u16 qs[32], u8 scales[8]), 1 IQ2_S (82: f16 d, u8 qs[32], u8 signs[32], u8
    qh[8], u8 scales[8]), 2 IQ3_S (110: f16 d, u8 qs[64], u8 qh[8], u8 signs[32], u8 scales[4]);
    ``table``: IQ_TABLES' address. IQ2_XS/IQ2_S scale each 16 weights (d (0.5 + nibble) / 4, low
    nibble first), IQ3_S each 32 (d (1 + 2 nibble))."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
    bs = 74 if kind == 0 else 82 if kind == 1 else 110
    for b in range(nb // 8):
        p = o + bs * b
        d = load_f16(w, p)
        for g in range(8):
            store_i8x32(buf, 32 * g, _grp_s(table, w, p, g, kind))
        v = dots(isa, buf, xq, xo + 256 * b, l2)
        blk = xb + 8 * b
        xdv = load_f32x8(xd, blk)
        if kind == 2:
            f = fmul(fadd(fmul(u8_f32x8(nibbles8(load_u32(w, p + 106))), np.float32(2.0)), np.float32(1.0)), d)
            acc = acc_dots(acc, v, fmul(f, xdv))
            cor = fadd(cor, fmul(f, load_f32x8(xs, blk)))
        else:
            sc = load_u64(w, p + 66 if kind == 0 else p + 74)
            dq = d * np.float32(0.25)
            lo = fmul(fadd(u8_f32x8(sc & 0x0F0F0F0F0F0F0F0F), np.float32(0.5)), dq)
            hi = fmul(fadd(u8_f32x8((sc >> 4) & 0x0F0F0F0F0F0F0F0F), np.float32(0.5)), dq)
            f0, f1 = zip_lo(lo, hi), zip_hi(lo, hi)  # per 16 weights: groups 0-3, 4-7
            acc = acc_dots16(acc, v, fmul(f0, dup_lo(xdv)), fmul(f1, dup_hi(xdv)))
            cor = fadd(cor, fadd(fmul(f0, load_f32x8(xs16, 2 * blk)), fmul(f1, load_f32x8(xs16, 2 * blk + 8))))
    return hsum(acc) - np.float32(64.0) * hsum(cor)


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


@njit(inline="always")
def _grp1(t, w, p, g, m):
    """IQ1_S (m False) / IQ1_M group g: its bytes u = 8 g + 9 + 8 delta from the tables at t, and
    its scale(s) as odd integers (IQ1_S: one; IQ1_M: weights 0-15, 16-31)."""
    if m:
        n0, n1 = np.int64(load_u8(w, p + 32 + 2 * g)), np.int64(load_u8(w, p + 33 + 2 * g))
        k0, k1, k2, k3 = n0 & 15, n0 >> 4, n1 & 15, n1 >> 4
        i = p + 4 * g
        q = gather8x4_at(t, load_u8(w, i) | ((k0 & 7) << 8) | (0 if k0 & 8 else _G1_PLUS),
                         load_u8(w, i + 1) | ((k1 & 7) << 8) | (0 if k1 & 8 else _G1_PLUS),
                         load_u8(w, i + 2) | ((k2 & 7) << 8) | (0 if k2 & 8 else _G1_PLUS),
                         load_u8(w, i + 3) | ((k3 & 7) << 8) | (0 if k3 & 8 else _G1_PLUS))
        sw = _u16(w, p + 48 + 2 * (g // 2)) >> (6 * (g % 2))  # 3-bit scales of weights 0-15, 16-31
        return q, np.float32(2 * (sw & 7) + 1), np.float32(2 * ((sw >> 3) & 7) + 1)
    qh = _u16(w, p + 34 + 2 * g)
    plus = 0 if qh & 0x8000 else _G1_PLUS
    i = p + 2 + 4 * g
    q = gather8x4_at(t, load_u8(w, i) | ((qh & 7) << 8) | plus, load_u8(w, i + 1) | (((qh >> 3) & 7) << 8) | plus,
                     load_u8(w, i + 2) | (((qh >> 6) & 7) << 8) | plus, load_u8(w, i + 3) | (((qh >> 9) & 7) << 8) | plus)
    s = np.float32(2 * ((qh >> 12) & 7) + 1)
    return q, s, s


@njit(inline="always", fastmath=True)
def dot_iq1(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, table, m):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: IQ1_S (m False; 50-byte
    blocks: f16 d, u8 qs[32], u16 qh[8]) or IQ1_M (56: u8 qs[32], u8 qh[16] a nibble per 8
    weights, u16 scales[4] with d in their top nibbles). w = dl (g + delta), g in {-1, 0, 1} and
    delta +-1/8, so 8 w / dl = u - 9 with u = 8 g + 9 + 8 delta in 0..18 (the tables): per 16
    weights, dl / 8 (u . x - 9 sum x). ``table``: IQ_TABLES' address."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
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
            q, s0, s1 = _grp1(t, w, p, g, m)
            store_i8x32(buf, 32 * g, q)
            store_f32(buf + 256, 2 * g, s0)
            store_f32(buf + 256, 2 * g + 1, s1)
        v = dots(isa, buf, xq, xo + 256 * b, l2)
        dq = d * np.float32(0.125)
        f0 = fmul(load_f32x8(buf + 256, 0), dq)  # per 16 weights
        f1 = fmul(load_f32x8(buf + 256, 8), dq)
        blk = xb + 8 * b
        xdv = load_f32x8(xd, blk)
        acc = acc_dots16(acc, v, fmul(f0, dup_lo(xdv)), fmul(f1, dup_hi(xdv)))
        cor = fadd(cor, fadd(fmul(f0, load_f32x8(xs16, 2 * blk)), fmul(f1, load_f32x8(xs16, 2 * blk + 8))))
    return hsum(acc) - np.float32(9.0) * hsum(cor)
