"""CPU row kernels of the lattice i-quants IQ2_XXS and IQ3_XXS, with integer dots.

Per 32 weights both types store grid indices (IQ2_XXS: 4 bytes, 8 weights each; IQ3_XXS: 8
bytes, 4 weights each) and one u32 whose four 7-bit fields index ``KSIGNS`` (eight signs each)
and whose top nibble s scales the group: w = d (0.5 + s) / 4 (IQ3_XXS: / 2) * grid * sign. The
grid values are unsigned bytes <= 62, so a group's dot is grid . (x with the signs applied): one
gather of the 32 grid bytes, the signs as a 32-bit mask negating activation bytes (which avoid
-128), and the same integer dot as every other type (``cpu_simd.dpbusd_isa``: exact on the avx2
path too, the weight bytes being <= 127), per activation level.

``IQ_TABLES`` (KSIGNS, then each grid as bytes) sits at ``cpu_experts``' code tables; the kernels
take its address.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_simd import I8x32, comb256, dpbusd_isa, fma_cvt, hsum, load_f16, load_f32, load_i8x32, load_u8, zero_f32, zero_i32
from .iq_grids import KSIGNS, grid

__all__ = ["IQ_TABLES", "dot_iq_xxs"]

_KS, _G2 = 0, 128  # byte offsets in IQ_TABLES: KSIGNS, IQ2_XXS's grid (256 x 8), IQ3_XXS's (256 x 4)
_G3 = _G2 + 256 * 8
IQ_TABLES = np.concatenate([KSIGNS, grid("IQ2_XXS").astype(np.uint8).reshape(-1),
                            grid("IQ3_XXS").astype(np.uint8).reshape(-1)])
assert IQ_TABLES.size == _G3 + 256 * 4


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

