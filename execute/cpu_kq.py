"""CPU row kernels of the K-quants (Q2_K .. Q6_K): the block scales decoded per 256 weights in vectors.

Each 256-weight block stores 8 or 16 small integer scales (and Q2_K, Q4_K, Q5_K as many mins)
packed into a few bytes. The kernels read those bytes as one or two 64-bit words, spread them
into one scale per byte with shifts and masks, and turn 8 of them at a time into a float32
vector multiplied by the 8 activation blocks' scales and the block's ``d``: one vector of the
float factors of the block's eight 32-weight integer dots. The dots are the common ones
(``_idot``: unsigned weight bytes against the int8 activations, both levels); each is converted
and accumulated with its lane of that vector (``lane``; Q2_K, Q3_K, Q6_K scale each 16 weights:
two lanes, ``fma_cvt2``). Mins and offsets come off once per block as a vector product with the
activations' block sums. Also here: the float32 vector operations that work needs, and the
integer dots shared with ``execute.cpu_experts``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_simd import (F32x8, I32x8, VF, _I8, _I32, _F32, _addr_args, _ptr, _splat, dpbusd_isa, fma_cvt, fma_cvt2,
                       hsum, load_f16, load_i8x32, load_nib32, lut16, nib_hi, nib_lo, sign_abs, vand, vor, vshl, vshr, zero_f32, zero_i32)

__all__ = ["idot", "sdot", "dot_q4_k", "dot_q6_k", "dot_q2_3k", "dot_iq4_xs", "load_u32", "load_u64", "load_f32x8", "u8_f32x8",
           "i8_f32x8", "fmul", "fadd", "lane", "dup_lo", "dup_hi"]


@intrinsic
def load_f32x8(typingctx, base, i):
    """Elements i .. i + 7 of the float32 array at address ``base``."""
    if not _addr_args(base, i):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), ir.PointerType(_F32))
        q = builder.bitcast(builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]), ir.PointerType(VF))
        return builder.load(q, align=4)
    return F32x8(base, i), codegen


@intrinsic
def load_u64(typingctx, base, off):
    """The 8 bytes at base + off (any alignment) as an int64 (little-endian)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig, args, ir.IntType(64)), align=1)
    return types.int64(base, off), codegen


@intrinsic
def load_u32(typingctx, base, off):
    """The 4 bytes at base + off (any alignment) as an int64 (zero-extended)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.load(_ptr(context, builder, sig, args, _I32), align=1), ir.IntType(64))
    return types.int64(base, off), codegen


@intrinsic
def shl8(typingctx, v):
    """v * 256 per int32 lane."""
    if v != I32x8:
        return None
    return I32x8(v), lambda context, builder, sig, args: builder.shl(args[0], ir.Constant(args[0].type, [8] * 8))


def _bytes_f32(signed: bool):
    def make(typingctx, u):
        if not isinstance(u, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            b = builder.bitcast(context.cast(builder, args[0], sig.args[0], types.int64), ir.VectorType(_I8, 8))
            return (builder.sitofp if signed else builder.uitofp)(b, VF)
        return F32x8(u), codegen
    return make


u8_f32x8 = intrinsic(_bytes_f32(False))
u8_f32x8.__doc__ = "The 8 bytes of an int64 (byte j: lane j) as unsigned values, float32."
i8_f32x8 = intrinsic(_bytes_f32(True))
i8_f32x8.__doc__ = "The 8 bytes of an int64 as signed values, float32."


def _fbinop(name):
    def make(typingctx, a, b):
        if a != F32x8 or not (b == F32x8 or isinstance(b, (types.Float, types.Integer))):
            return None

        def codegen(context, builder, sig, args):
            rhs = args[1] if sig.args[1] == F32x8 else _splat(builder, context.cast(builder, args[1], sig.args[1],
                                                                                    types.float32), VF)
            return getattr(builder, name)(args[0], rhs, flags=("fast",))
        return F32x8(a, b), codegen
    return make


fmul = intrinsic(_fbinop("fmul"))
fmul.__doc__ = "a * b lane by lane (b: a vector or a scalar, broadcast)."
fadd = intrinsic(_fbinop("fadd"))
fadd.__doc__ = "a + b lane by lane (b: a vector or a scalar, broadcast)."


@intrinsic
def lane(typingctx, v, k):
    """Lane k of v (float32)."""
    if v != F32x8 or not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
    return types.float32(v, k), codegen


def _dup(half: int):
    def make(typingctx, v):
        if v != F32x8:
            return None

        def codegen(context, builder, sig, args):
            idx = [4 * half + j // 2 for j in range(8)]
            return builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, 8), idx))
        return F32x8(v), codegen
    return make


dup_lo = intrinsic(_dup(0))
dup_lo.__doc__ = "[v0, v0, v1, v1, v2, v2, v3, v3] (a scale per 32 values against scales per 16)."
dup_hi = intrinsic(_dup(1))
dup_hi.__doc__ = "[v4, v4, v5, v5, v6, v6, v7, v7]."


@njit(inline="always")
def idot(q, xq, a, l2, isa):
    """Per-lane integer dot of unsigned weight bytes q (<= 127 for the avx2 path) with the
    activation block at byte a of xq: 256 q.x1 + q.x2 with two levels (|lane| <= 4 * 255 * 127 *
    257 < 2^31)."""
    v = dpbusd_isa(isa, zero_i32(), q, load_i8x32(xq, a))
    if l2:  # 256 v + q.x2, the shift before the second dot (one add fewer than two dots and comb256)
        v = dpbusd_isa(isa, shl8(v), q, load_i8x32(xq, a + l2))
    return v


@njit(inline="always")
def sdot(q, xq, a, l2, isa):
    """idot for signed weight bytes q (|q| <= 128): |q| . x sign(q) per level (activations avoid -128)."""
    aq, s1 = sign_abs(q, load_i8x32(xq, a))
    v = dpbusd_isa(isa, zero_i32(), aq, s1)
    if l2:
        _, s2 = sign_abs(q, load_i8x32(xq, a + l2))
        v = dpbusd_isa(isa, shl8(v), aq, s2)
    return v


_M2, _M4, _M6 = 0x03030303, 0x0F0F0F0F, 0x3F3F3F3F
_M4X8 = 0x0F0F0F0F0F0F0F0F


@njit(inline="always")
def _bit_to(h, k, to):
    """Bytewise bit k of h moved to bit ``to`` (others cleared); k and ``to`` fold to constants."""
    if k < to:
        return vand(vshl(h, to - k), 1 << to)
    if k > to:
        return vand(vshr(h, k - to), 1 << to)
    return vand(h, 1 << to)


@njit(inline="always", fastmath=True)
def dot_q4_k(w, o, nb, xq, xo, xd, xs, xb, l2, isa, five):
    """Q4_K (five False; 144-byte blocks: f16 d, f16 dmin, u8 scales[12], u8 qs[128]) and Q5_K
    (five; 176 bytes: u8 qh[32] after the scales, bit s of qh[j] the fifth bit of weight 32 s + j).
    The 12 scale bytes as three words lo, mid, hi: sub-block s < 4 has scale lo_s & 63 and min
    mid_s & 63; s >= 4 has scale hi_t & 15 | (lo_t >> 6) << 4 and min hi_t >> 4 | (mid_t >> 6) << 4
    (t = s - 4, x_t byte t of word x); w = d scale q - dmin min."""
    acc0 = zero_f32()  # even and odd sub-blocks: two chains of FMAs
    acc1 = zero_f32()
    cor = zero_f32()
    bs, qo = (176, 48) if five else (144, 16)
    for b in range(nb // 8):
        p = o + bs * b
        lo, mid, hi = load_u32(w, p + 4), load_u32(w, p + 8), load_u32(w, p + 12)
        sc = (lo & _M6) | (((hi & _M4) | (((lo >> 6) & _M2) << 4)) << 32)
        mn = (mid & _M6) | ((((hi >> 4) & _M4) | (((mid >> 6) & _M2) << 4)) << 32)
        blk = xb + 8 * b
        f = fmul(fmul(u8_f32x8(sc), load_f32x8(xd, blk)), load_f16(w, p))  # the 8 dots' float factors
        cor = fadd(cor, fmul(fmul(u8_f32x8(mn), load_f32x8(xs, blk)), load_f16(w, p + 2)))
        h = load_i8x32(w, p + 16)  # Q5_K's fifth bits (Q4_K: unused)
        for c in range(4):  # 32 bytes: low nibbles are sub-block 2c, high nibbles 2c + 1
            q = load_i8x32(w, p + qo + 32 * c)
            q0, q1 = nib_lo(q), nib_hi(q)
            if five:
                q0 = vor(q0, _bit_to(h, 2 * c, 4))
                q1 = vor(q1, _bit_to(h, 2 * c + 1, 4))
            a = xo + 256 * b + 64 * c
            acc0 = fma_cvt(acc0, idot(q0, xq, a, l2, isa), lane(f, 2 * c))
            acc1 = fma_cvt(acc1, idot(q1, xq, a + 32, l2, isa), lane(f, 2 * c + 1))
    return hsum(fadd(acc0, acc1)) - hsum(cor)


@njit(inline="always", fastmath=True)
def _q6_half(acc0, acc1, w, p, hh, f, xq, a, l2, isa):
    """128 weights of a Q6_K block (half hh): 32-weight groups g = 0..3, q = ql nibble | 2 qh
    bits << 4; f: the factors of the half's 8 scales (two per group)."""
    ql0 = load_i8x32(w, p + 64 * hh)
    ql1 = load_i8x32(w, p + 64 * hh + 32)
    qh = load_i8x32(w, p + 128 + 32 * hh)
    acc0 = fma_cvt2(acc0, idot(vor(nib_lo(ql0), vshl(vand(qh, 3), 4)), xq, a, l2, isa), lane(f, 0), lane(f, 1))
    acc1 = fma_cvt2(acc1, idot(vor(nib_lo(ql1), vshl(vand(qh, 12), 2)), xq, a + 32, l2, isa), lane(f, 2), lane(f, 3))
    acc0 = fma_cvt2(acc0, idot(vor(nib_hi(ql0), vand(qh, 48)), xq, a + 64, l2, isa), lane(f, 4), lane(f, 5))
    acc1 = fma_cvt2(acc1, idot(vor(nib_hi(ql1), vand(vshr(qh, 2), 48)), xq, a + 96, l2, isa), lane(f, 6), lane(f, 7))
    return acc0, acc1


@njit(inline="always", fastmath=True)
def dot_q6_k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa):
    """Q6_K (210-byte blocks: u8 ql[128], u8 qh[64], i8 scales[16] per 16 weights, f16 d):
    w = d scale (q - 32), the 32 off through the 16-value activation sums."""
    acc0 = zero_f32()
    acc1 = zero_f32()
    cor = zero_f32()
    for b in range(nb // 8):
        p = o + 210 * b
        s0, s1 = i8_f32x8(load_u64(w, p + 192)), i8_f32x8(load_u64(w, p + 200))
        blk = xb + 8 * b
        xdv = fmul(load_f32x8(xd, blk), load_f16(w, p + 208))
        cor = fadd(cor, fmul(fadd(fmul(s0, load_f32x8(xs16, 2 * blk)), fmul(s1, load_f32x8(xs16, 2 * blk + 8))),
                             load_f16(w, p + 208)))
        a = xo + 256 * b
        acc0, acc1 = _q6_half(acc0, acc1, w, p, 0, fmul(s0, dup_lo(xdv)), xq, a, l2, isa)
        acc0, acc1 = _q6_half(acc0, acc1, w, p, 1, fmul(s1, dup_hi(xdv)), xq, a + 128, l2, isa)
    return hsum(fadd(acc0, acc1)) - np.float32(32.0) * hsum(cor)


@njit(inline="always", fastmath=True)
def _q23_half(acc0, acc1, w, p, h, f, xq, a, l2, isa, three):
    """128 weights of a Q2_K/Q3_K block (half h): 2 low bits at bits 2 s of qs[32 h + j] (Q3_K:
    the third at bit 4 h + s of hmask[j]); f: the half's 8 scale factors."""
    qv = load_i8x32(w, p + (32 if three else 16) + 32 * h)
    hm = load_i8x32(w, p)
    for t in range(2):  # 32-weight groups s = 2t (into acc0) and 2t + 1 (acc1)
        s = 2 * t
        q0, q1 = vand(vshr(qv, 2 * s), 3), vand(vshr(qv, 2 * s + 2), 3)
        if three:
            q0 = vor(q0, _bit_to(hm, 4 * h + s, 2))
            q1 = vor(q1, _bit_to(hm, 4 * h + s + 1, 2))
        acc0 = fma_cvt2(acc0, idot(q0, xq, a + 32 * s, l2, isa), lane(f, 2 * s), lane(f, 2 * s + 1))
        acc1 = fma_cvt2(acc1, idot(q1, xq, a + 32 * s + 32, l2, isa), lane(f, 2 * s + 2), lane(f, 2 * s + 3))
    return acc0, acc1


@njit(inline="always", fastmath=True)
def dot_q2_3k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, three):
    """Q2_K (three False; 84-byte blocks: u8 scales[16] (scale | min << 4), u8 qs[64], f16 d,
    f16 dmin; w = d scale q - dmin min) and Q3_K (110: u8 hmask[32], u8 qs[64], u8 scales[12], f16
    d; w = d (scale - 32) (q - 4), q - 4 when the third bit is clear). Q3_K's 6-bit scale k: low 4
    bits in byte k % 8 of the first 8 (high nibble for k >= 8), top 2 bits at bits 2 (k // 4) of
    byte 8 + k % 4."""
    acc0 = zero_f32()
    acc1 = zero_f32()
    cor = zero_f32()
    for b in range(nb // 8):
        if three:
            p = o + 110 * b
            d = load_f16(w, p + 108)
            dmin = np.float32(4.0) * d
            lo, hi = load_u64(w, p + 96), load_u32(w, p + 104)
            h0 = (hi & _M2) | (((hi >> 2) & _M2) << 32)
            h1 = ((hi >> 4) & _M2) | (((hi >> 6) & _M2) << 32)
            s0 = fadd(u8_f32x8((lo & _M4X8) | (h0 << 4)), np.float32(-32.0))
            s1 = fadd(u8_f32x8(((lo >> 4) & _M4X8) | (h1 << 4)), np.float32(-32.0))
            m0, m1 = s0, s1
        else:
            p = o + 84 * b
            d = load_f16(w, p + 80)
            dmin = load_f16(w, p + 82)
            c0, c1 = load_u64(w, p), load_u64(w, p + 8)
            s0, s1 = u8_f32x8(c0 & _M4X8), u8_f32x8(c1 & _M4X8)
            m0, m1 = u8_f32x8((c0 >> 4) & _M4X8), u8_f32x8((c1 >> 4) & _M4X8)
        blk = xb + 8 * b
        xdv = fmul(load_f32x8(xd, blk), d)
        cor = fadd(cor, fmul(fadd(fmul(m0, load_f32x8(xs16, 2 * blk)), fmul(m1, load_f32x8(xs16, 2 * blk + 8))), dmin))
        a = xo + 256 * b
        acc0, acc1 = _q23_half(acc0, acc1, w, p, 0, fmul(s0, dup_lo(xdv)), xq, a, l2, isa, three)
        acc0, acc1 = _q23_half(acc0, acc1, w, p, 1, fmul(s1, dup_hi(xdv)), xq, a + 128, l2, isa, three)
    return hsum(fadd(acc0, acc1)) - hsum(cor)


@njit(inline="always")
def _iq4xs_scales(w, p):
    """IQ4_XS's 8 six-bit scales (unsigned, one a byte) of the block at byte p: low nibble s of the
    4 bytes scales_l at p + 4 (byte s // 2, high nibble for odd s), top 2 bits at bits 2 s of the
    u16 scales_h at p + 2."""
    x = load_u32(w, p + 4)
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF  # byte i -> byte 2 i
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    lo = (x & 0x000F000F000F000F) | ((x << 4) & 0x0F000F000F000F00)  # nibble s -> byte s
    y = load_u32(w, p + 2) & 0xFFFF
    y = (y & 0xFF) | ((y & 0xFF00) << 24)  # 2-bit group s -> byte s (bits 0-1)
    y = (y & 0x0000000F0000000F) | ((y & 0x000000F0000000F0) << 12)
    y = (y & 0x0003000300030003) | ((y & 0x000C000C000C000C) << 6)
    return lo | (y << 4)


@njit(inline="always", fastmath=True)
def dot_iq4_xs(w, o, nb, xq, xo, xd, xb, l2, isa, table):
    """IQ4_XS (136-byte blocks: f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]; 32-weight
    sub-block s: 16 bytes of codes, low nibbles weights 0-15): w = d (scale - 32) level(code), the
    levels signed bytes by lut16 from the 16 at ``table``."""
    acc0 = zero_f32()
    acc1 = zero_f32()
    for b in range(nb // 8):
        p = o + 136 * b
        f = fmul(fmul(fadd(u8_f32x8(_iq4xs_scales(w, p)), np.float32(-32.0)), load_f32x8(xd, xb + 8 * b)),
                 load_f16(w, p))
        a = xo + 256 * b
        for t in range(4):
            v0 = sdot(lut16(load_nib32(w, p + 8 + 32 * t), table), xq, a + 64 * t, l2, isa)
            v1 = sdot(lut16(load_nib32(w, p + 24 + 32 * t), table), xq, a + 64 * t + 32, l2, isa)
            acc0 = fma_cvt(acc0, v0, lane(f, 2 * t))
            acc1 = fma_cvt(acc1, v1, lane(f, 2 * t + 1))
    return hsum(fadd(acc0, acc1))
