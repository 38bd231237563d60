"""CPU row kernels of Q8_0 and MXFP4, eight 32-weight blocks at a time.

A row is read in runs of 8 blocks (256 weights) whose 8 scales arrive as one float32 vector
(Q8_0's float16 d by ``cpu_kq.f16x8``, MXFP4's E8M0 exponents by ``e8m0x8``) times the 8
activation scales. MXFP4: the 8 weight vectors go to the dots in registers behind one branch on
the instruction-set path (``cpu_kq.dots``), the 8 integer dots are summed across lanes as
integers in one vector, converted once and multiplied by the factors (``cpu_kq.acc_dots``), where
one block at a time took a conversion, a broadcast FMA and a scalar scale each; its offset comes
off once per 8 blocks as a vector product with the activations' block sums. Q8_0 does the same
on the vnni path; off it, it dots its signed bytes with the activations' int16 form (256 q1 + q2,
written by the quantizer for Q8_0 layers: ``dot_i16``) block by block, each dot's factor a lane
of that vector, in two FMA chains (on the dev VM's Zen 4 faster than the vnni path too: 1.18x one
thread; not yet measured on the H200 host's cores). A row's last nb % 8 blocks are read one by one. Arguments as
``execute.cpu_experts``' dots.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_kq import (_halves, _i16_lanes, _is_tuple_of, acc_dots, dot_i16, dots, f16x8, fadd, fmul, idot, lane, load_f32x8,
                     sdot, sdots)
from .cpu_simd import (F32x8, I32x8, I8x32, VF, _I32, _addr_args, _ptr, fma_cvt, hsum, load_f16, load_f32, load_i8x32, load_nib32,
                       load_u8, lut16, xor80, zero_f32)

__all__ = ["e8m0x8", "e8m0", "dots_i16", "sdots_any", "dot_q8_0", "dot_mxfp4"]


@intrinsic
def dots_i16(typingctx, q, x, a):
    """dots' 8 integer dots against the activations' int16 form (x its address, a in int16 units,
    the dots at a + 32 k): per k the 32 weight bytes (signed, or unsigned <= 127) of q as in dots
    (an address or a tuple of 8 I8x32), dot_i16's lanes (their sum is the dot)."""
    if not (isinstance(x, types.Integer) and isinstance(a, types.Integer)
            and (isinstance(q, types.Integer) or _is_tuple_of(q, I8x32, 8))):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        x, a = (context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], sig.args[1:]))
        res = []
        for k in range(8):
            if isinstance(sig.args[0], types.UniTuple):
                halves = _halves(builder, builder.extract_value(args[0], k))
            else:
                qa = context.cast(builder, args[0], sig.args[0], types.int64)
                halves = _halves(builder, None, builder.add(qa, ir.Constant(i64, 32 * k)))
            xa = builder.add(x, builder.mul(builder.add(a, ir.Constant(i64, 32 * k)), ir.Constant(i64, 2)))
            res.append(_i16_lanes(builder, halves, xa))
        return context.make_tuple(builder, sig.return_type, res)
    return types.UniTuple(I32x8, 8)(q, x, a), codegen


@njit(inline="always")
def sdots_any(isa, q, xq, a, l2):
    """sdots (signed weight bytes), but off vnni with two activation levels against their int16
    form (from byte 2 l2 + 64 of xq: dots_i16, two multiplies per 32 weights where |w| and x sign(w)
    per level take four, and no signs); for acc_dots (the lanes' layout differs from sdots')."""
    if isa != 0 and l2:
        return dots_i16(q, xq + 2 * l2 + 64, a)
    return sdots(isa, q, xq, a, l2)


@intrinsic
def e8m0x8(typingctx, base, off, stride):
    """The E8M0 exponent bytes e at base + off + stride k, k < 8, as float32 2^(e - 128), exact
    (e < 2: the denormals 2^-127, 2^-126 from their bits)."""
    if not (_addr_args(base, off) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        a = builder.ptrtoint(_ptr(context, builder, sig, args[:2], ir.IntType(8)), i64)
        st = context.cast(builder, args[2], sig.args[2], types.int64)
        u = None  # the 8 bytes packed in a 64-bit register (scalar ports), then widened in a vector
        for k in range(8):
            p = builder.inttoptr(builder.add(a, builder.mul(st, ir.Constant(i64, k))), ir.PointerType(ir.IntType(8)))
            e = builder.zext(builder.load(p, align=1), i64)
            e = builder.shl(e, ir.Constant(i64, 8 * k)) if k else e
            u = e if u is None else builder.or_(u, e)
        e = builder.zext(builder.bitcast(u, ir.VectorType(ir.IntType(8), 8)), ir.VectorType(_I32, 8))
        return builder.bitcast(_pow2(builder, e), VF)
    return F32x8(base, off, stride), codegen


def _pow2(builder, e):
    """The float32 bits of 2^(e - 128) for i32 e (or a vector of them) in 0..255: exponent field
    e - 1, or for e < 2 the denormal 2^21 << e (in units of 2^-149)."""
    def c(x):
        return ir.Constant(e.type, [x] * e.type.count if isinstance(e.type, ir.VectorType) else x)
    norm = builder.shl(builder.sub(e, c(1)), c(23))
    return builder.select(builder.icmp_unsigned("<", e, c(2)), builder.shl(c(0x00200000), e), norm)


@intrinsic
def e8m0(typingctx, e):
    """One E8M0 exponent (an integer 0..255) as float32 2^(e - 128), exact (e8m0x8's lane)."""
    if not isinstance(e, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(_pow2(builder, context.cast(builder, args[0], sig.args[0], types.int32)), ir.FloatType())
    return types.float32(e), codegen


@njit(inline="always", fastmath=True)
def dot_q8_0(w, o, nb, xq, xo, xd, xs, xb, l2, isa):
    """Q8_0 (34-byte blocks: f16 d, i8 qs[32]): w = d q. On the vnni path q + 128 as unsigned bytes
    (dots, 8 blocks staged), the 128 off through the sums xs. On the others, with two activation
    levels (l2 > 0), q dotted with their int16 form 256 q1 + q2 (from byte 2 l2 + 64 of xq, see
    cpu_experts._quantize: dot_i16, two multiplies per 32 weights where the levels took four),
    block by block, each dot's factor a lane of the 8 blocks' vector, in two FMA chains; with one
    level the signed bytes (sdot: vpmaddubsw's int16 pair sums would overflow on q + 128)."""
    acc = zero_f32()
    acc1 = zero_f32()
    cor = zero_f32()
    if l2 and isa != 0:
        x16 = xq + 2 * l2 + 64
        for b8 in range(nb // 8):
            p = o + 272 * b8
            f = fmul(f16x8(w, p, 34), load_f32x8(xd, xb + 8 * b8))
            a = xo + 256 * b8
            for k in range(0, 8, 2):
                acc = fma_cvt(acc, dot_i16(w, p + 2 + 34 * k, x16, a + 32 * k), lane(f, k))
                acc1 = fma_cvt(acc1, dot_i16(w, p + 36 + 34 * k, x16, a + 32 * k + 32), lane(f, k + 1))
        for b in range(nb - nb % 8, nb):
            p = o + 34 * b
            acc = fma_cvt(acc, dot_i16(w, p + 2, x16, xo + 32 * b), load_f16(w, p) * load_f32(xd, xb + b))
        return hsum(fadd(acc, acc1))
    for b8 in range(nb // 8):
        p = o + 272 * b8
        dv = f16x8(w, p, 34)
        blk = xb + 8 * b8
        f = fmul(dv, load_f32x8(xd, blk))
        if isa == 0:
            q = (xor80(load_i8x32(w, p + 2)), xor80(load_i8x32(w, p + 36)), xor80(load_i8x32(w, p + 70)),
                 xor80(load_i8x32(w, p + 104)), xor80(load_i8x32(w, p + 138)), xor80(load_i8x32(w, p + 172)),
                 xor80(load_i8x32(w, p + 206)), xor80(load_i8x32(w, p + 240)))
            acc = acc_dots(acc, dots(isa, q, xq, xo + 256 * b8, l2), f)
            cor = fadd(cor, fmul(dv, load_f32x8(xs, blk)))
        else:  # block by block, the factors lanes of f, two FMA chains
            a = xo + 256 * b8
            for k in range(0, 8, 2):
                acc = fma_cvt(acc, sdot(load_i8x32(w, p + 2 + 34 * k), xq, a + 32 * k, l2, isa), lane(f, k))
                acc1 = fma_cvt(acc1, sdot(load_i8x32(w, p + 36 + 34 * k), xq, a + 32 * k + 32, l2, isa), lane(f, k + 1))
    corr = np.float32(0.0)
    for b in range(nb - nb % 8, nb):
        p = o + 34 * b
        d = load_f16(w, p)
        if isa == 0:
            v = idot(xor80(load_i8x32(w, p + 2)), xq, xo + 32 * b, l2, isa)
            corr += d * load_f32(xs, xb + b)
        else:
            v = sdot(load_i8x32(w, p + 2), xq, xo + 32 * b, l2, isa)
        acc = fma_cvt(acc, v, d * load_f32(xd, xb + b))
    return hsum(fadd(acc, acc1)) - np.float32(128.0) * (hsum(cor) + corr)


@njit(inline="always")
def _mx(w, p, table):
    """An MXFP4 block's 32 codes at p + 1 (Q4_0's nibble order) as value + 12 (unsigned bytes)."""
    return lut16(load_nib32(w, p + 1), table)


@njit(inline="always", fastmath=True)
def dot_mxfp4(w, o, nb, xq, xo, xd, xs, xb, l2, table, isa):
    """MXFP4 (17-byte blocks: u8 e, u8 qs[16] of 4-bit codes): w = 2^(e - 128) value(code), the
    values + 12 from ``table`` (0..24: unsigned bytes on every path), the 12 off through the sums."""
    acc = zero_f32()
    cor = zero_f32()
    for b8 in range(nb // 8):
        p = o + 136 * b8
        dv = e8m0x8(w, p, 17)
        blk = xb + 8 * b8
        q = (_mx(w, p, table), _mx(w, p + 17, table), _mx(w, p + 34, table), _mx(w, p + 51, table),
             _mx(w, p + 68, table), _mx(w, p + 85, table), _mx(w, p + 102, table), _mx(w, p + 119, table))
        acc = acc_dots(acc, dots(isa, q, xq, xo + 256 * b8, l2), fmul(dv, load_f32x8(xd, blk)))
        cor = fadd(cor, fmul(dv, load_f32x8(xs, blk)))
    corr = np.float32(0.0)
    for b in range(nb - nb % 8, nb):
        p = o + 17 * b
        d = e8m0(load_u8(w, p))
        acc = fma_cvt(acc, idot(_mx(w, p, table), xq, xo + 32 * b, l2, isa), d * load_f32(xd, xb + b))
        corr += d * load_f32(xs, xb + b)
    return hsum(acc) - np.float32(12.0) * (hsum(cor) + corr)
