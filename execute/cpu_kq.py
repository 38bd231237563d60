"""CPU row kernels of the K-quants (Q2_K .. Q6_K): the block scales decoded per 256 weights in vectors.

Each 256-weight block stores 8 or 16 small integer scales (and Q2_K, Q4_K, Q5_K as many mins)
packed into a few bytes. The kernels read those bytes as one or two 64-bit words, spread them
into one scale per byte with shifts and masks, and turn 8 of them at a time into a float32
vector multiplied by the 8 activation blocks' scales and the block's ``d``: one vector of the
float factors of the block's eight 32-weight integer dots (unsigned weight bytes against the int8
activations, both levels). Q4_K and Q5_K stage the block's 8 weight vectors on the stack
(``block_scratch``), Q3_K and Q2_K hand them over in registers, and the 8 dots run behind one
branch on the instruction-set path
(``dots``); each dot's lanes are summed as integers, the 8 sums (16 with a scale per 16 weights)
gathered in one vector by pairwise adds, converted once and multiplied by the factors
(``acc_dots``, ``acc_dots16``: a blend and one shuffle per pair of vectors, not vphaddd's two
shuffles: llvm-mca's Ice Lake server model puts these loops on the shuffle port), joining the
accumulator in one add; Q6_K, whose decode is a few instructions, branches per dot (``idot``) and accumulates each
with its lanes of that vector (``fma_cvt2``; staging it measured no faster). IQ4_XS stages its
levels + 128 (unsigned) on the vnni path; on the others (int16 pair sums) it dots its signed levels
one by one (``sdot``). Mins and offsets come off once per block as a vector product with the
activations' block sums. Also here:
the float32 vector operations that work needs, and the integer dots and staging shared with
``execute.cpu_experts``, whose 32-weight types Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL run eight blocks
at a time the same way (``dots``, ``sdots`` for signed weights; their d by ``f16x8``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_simd import (HAS_AVX2, F32x8, I32x8, I8x32, V8, V32, VF, _I8, _I32, _F32, _ISA_CODEGEN, _addr_args, _isa_branches, _ptr, _splat, abs_sign,
                       dpbusd_isa, fma_cvt, fma_cvt2, hsum, load_f16, load_i8x32, load_nib32, lut16, nib_hi, nib_lo, sign_abs, vand, vor, vshl, vshr, zero_f32, zero_i32)

__all__ = ["dots", "sdots", "f16x8", "block_scratch", "store_i8x32", "acc_dots", "acc_dots_x16lo", "load_nib32_x16", "acc_dots16", "idot", "sdot", "dot_i16", "dot_i16v", "prefetch_plan", "dot_q4_k", "dot_q6_k", "dot_q2_3k", "dot_iq4_xs", "load_u32", "load_u64", "load_f32x8", "u8_f32x8",
           "i8_f32x8", "fmul", "fadd", "lane", "dup_lo", "dup_hi", "zip_lo", "zip_hi", "nibbles8"]


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
def f16x8(typingctx, base, off, stride):
    """The float16 at base + off + stride k, k < 8, as float32 (the d of 8 consecutive blocks)."""
    if not (_addr_args(base, off) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = builder.ptrtoint(_ptr(context, builder, sig, args[:2], _I8), ir.IntType(64))
        st = context.cast(builder, args[2], sig.args[2], types.int64)
        i64 = ir.IntType(64)
        words = []
        for half in range(2):  # 4 float16 packed in a 64-bit register (scalar ports), then 2 moves to a vector
            u = None
            for k in range(4 * half, 4 * half + 4):
                p = builder.inttoptr(builder.add(a, builder.mul(st, ir.Constant(i64, k))), ir.PointerType(ir.IntType(16)))
                e = builder.zext(builder.load(p, align=1), i64)
                e = builder.shl(e, ir.Constant(i64, 16 * (k % 4))) if k % 4 else e
                u = e if u is None else builder.or_(u, e)
            words.append(u)
        v = ir.Constant(ir.VectorType(i64, 2), ir.Undefined)
        for j, u in enumerate(words):
            v = builder.insert_element(v, u, ir.Constant(_I32, j))
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), VF)
    return F32x8(base, off, stride), codegen


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


@intrinsic
def nib8_f32(typingctx, base, off, hi):
    """The low (hi 0) or high (hi 4) nibbles of the 8 bytes at base + off as float32 (one zero-extending
    load for both: LLVM merges the two calls' loads)."""
    if not (_addr_args(base, off) and isinstance(hi, (types.Integer, types.IntegerLiteral))):
        return None

    def codegen(context, builder, sig, args):
        b = builder.zext(builder.load(_ptr(context, builder, sig, args[:2], ir.VectorType(_I8, 8)), align=1), V8)
        sh = context.cast(builder, args[2], sig.args[2], types.int32)
        b = builder.lshr(b, _splat(builder, sh, V8))
        return builder.uitofp(builder.and_(b, ir.Constant(V8, [15] * 8)), VF)
    return F32x8(base, off, hi), codegen


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


def _zip(half: int):
    def make(typingctx, a, b):
        if a != F32x8 or b != F32x8:
            return None

        def codegen(context, builder, sig, args):
            idx = [4 * half + j // 2 + (8 if j % 2 else 0) for j in range(8)]
            return builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, 8), idx))
        return F32x8(a, b), codegen
    return make


zip_lo = intrinsic(_zip(0))
zip_lo.__doc__ = "[a0, b0, a1, b1, a2, b2, a3, b3] (scales of 16 weights, two per 32-value block)."
zip_hi = intrinsic(_zip(1))
zip_hi.__doc__ = "[a4, b4, a5, b5, a6, b6, a7, b7]."
dup_lo = intrinsic(_dup(0))
dup_lo.__doc__ = "[v0, v0, v1, v1, v2, v2, v3, v3] (a scale per 32 values against scales per 16)."
dup_hi = intrinsic(_dup(1))
dup_hi.__doc__ = "[v4, v4, v5, v5, v6, v6, v7, v7]."


def _is_tuple_of(t, vt, n=None) -> bool:
    return isinstance(t, types.UniTuple) and t.dtype == vt and (n is None or t.count == n)


def _dots_codegen(signed: bool):
    def codegen(context, builder, sig, args):
        isa, xq, a, l2 = (context.cast(builder, args[k], sig.args[k], types.int64) for k in (0, 2, 3, 4))
        qa = None if isinstance(sig.args[1], types.UniTuple) else context.cast(builder, args[1], sig.args[1], types.int64)

        def load(base, k):
            p = builder.add(base, ir.Constant(ir.IntType(64), 32 * k))
            return builder.load(builder.inttoptr(p, ir.PointerType(V32)), align=1)

        if isinstance(sig.args[1], types.UniTuple):  # the 8 vectors themselves (registers)
            q = [builder.extract_value(args[1], k) for k in range(8)]
        else:
            q = [load(qa, k) for k in range(8)]
        x1a, x2a = builder.add(xq, a), builder.add(builder.add(xq, a), l2)
        blocks, done = _isa_branches(builder, isa, "dots")
        outs = []
        for path, blk in enumerate(blocks):  # activations loaded in each path next to their dots (registers)
            builder.position_at_end(blk)
            dp = _ISA_CODEGEN[path]
            vs = []
            for k in range(8):
                u, x1, x2 = q[k], load(x1a, k), load(x2a, k)
                if signed:  # |w| and the activations' signs
                    (au, x1), (_, x2) = abs_sign(builder, u, x1), abs_sign(builder, u, x2)
                    u = au
                v = dp(builder, ir.Constant(V8, None), u, x1)
                vs.append(dp(builder, builder.shl(v, ir.Constant(V8, [8] * 8)), u, x2))
            outs.append((vs, builder.block))
            builder.branch(done)
        builder.position_at_end(done)
        res = []
        for k in range(8):
            phi = builder.phi(V8)
            for vs, blk in outs:
                phi.add_incoming(vs[k], blk)
            res.append(phi)
        return context.make_tuple(builder, sig.return_type, res)
    return codegen


def _dots(signed: bool):
    def make(typingctx, isa, q, xq, a, l2):
        if not (all(isinstance(t, types.Integer) for t in (isa, xq, a, l2))
                and (isinstance(q, types.Integer) or _is_tuple_of(q, I8x32, 8))):
            return None
        return types.UniTuple(I32x8, 8)(isa, q, xq, a, l2), _dots_codegen(signed)
    return make


@intrinsic
def block_scratch(typingctx):
    """The address of 320 bytes on the kernel's stack (one allocation in its entry block): a block's 8
    weight vectors (bytes 0-255, for dots) and 16 float32 (from byte 256)."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(cgutils.alloca_once(builder, ir.ArrayType(_I8, 320)), ir.IntType(64))
    return types.int64(), codegen


@intrinsic
def store_i8x32(typingctx, base, off, v):
    """Bytes base + off .. base + off + 31 = v."""
    if not _addr_args(base, off) or v != I8x32:
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _ptr(context, builder, sig, args[:2], V32), align=1)
        return context.get_dummy_value()
    return types.none(base, off, v), codegen


dots = intrinsic(_dots(False))
dots.__doc__ = """Per k < 8: 256 (q_k . x1) + q_k . x2 per int32 lane, q_k the 32 weight bytes at address q + 32 k
(block_scratch) or element k of q (a tuple of 8 I8x32: no stores and reloads), x1 the 32 activation bytes at xq + a + 32 k
and x2 those l2 bytes on (the second level); dpbusd with q unsigned (<= 127 for the avx2 path), on
path ``isa`` with one branch for all k: a block's dots behind one switch, so each path's
instructions run alone without a copy of the kernel per path."""
sdots = intrinsic(_dots(True))
sdots.__doc__ = "dots for signed weight bytes q (|q| <= 128) through |q| and x sign(q) (x avoids -128)."


def _pairs(builder, a, b, width):
    """Adjacent groups of ``width`` int32 lanes summed, a's sums in the even groups, b's in the odd:
    [a0+a1, b0+b1, a2+a3, b2+b3 ..] for width 1, [a01+a23, b01+b23, a45+a67, b45+b67] (two lanes
    each) for width 2. One blend (any vector port) and one shuffle, where vphaddd takes two shuffles
    (llvm-mca's Ice Lake server model puts the staged kernels on the shuffle port)."""
    idx = ir.VectorType(_I32, 8)
    g = [(j // width) % 2 for j in range(8)]  # 1: lane j holds b's term in place
    x = builder.shuffle_vector(a, b, ir.Constant(idx, [j + 8 * g[j] for j in range(8)]))
    y = builder.shuffle_vector(a, b, ir.Constant(idx, [(j ^ width) + 8 * g[j] for j in range(8)]))
    y = builder.asm(ir.FunctionType(V8, [V8]), "", "=v,0", [y], side_effect=False)  # else LLVM forms vphaddd again
    return builder.add(x, y)


def _sums4(builder, v, k):
    """Dots k .. k + 3 of v summed per half: [s_k, .., s_k+3 over lanes 0-3 | the same over lanes 4-7]."""
    return _pairs(builder, _pairs(builder, v[k], v[k + 1], 1), _pairs(builder, v[k + 2], v[k + 3], 1), 2)


def _acc_lane_sums(builder, args, lo_shift: int):
    """acc (args[0]) + float(the 8 dots of args[1] summed across lanes, lanes 0-3 of each shifted left
    by lo_shift first) * args[2]: acc_dots' and acc_dots_x16lo's body."""
    idx = ir.VectorType(_I32, 8)
    v = [builder.extract_value(args[1], k) for k in range(8)]
    a, b = _sums4(builder, v, 0), _sums4(builder, v, 4)
    lo = builder.shuffle_vector(a, b, ir.Constant(idx, [0, 1, 2, 3, 8, 9, 10, 11]))
    if lo_shift:
        lo = builder.shl(lo, ir.Constant(V8, [lo_shift] * 8))
    s = builder.add(lo, builder.shuffle_vector(a, b, ir.Constant(idx, [4, 5, 6, 7, 12, 13, 14, 15])))
    return builder.fadd(args[0], _opaque(builder, builder.fmul(builder.sitofp(s, VF), args[2])))


@intrinsic
def acc_dots(typingctx, acc, v, f):
    """acc + float(sum of v[k]'s lanes) * f[k] per lane k (one factor per dot): the 8 dots summed
    across lanes as integers (exact: |sum| < 2^31 for the kernels' bytes) in one vector, so a
    block costs one conversion and one multiply, joining the accumulator in one add."""
    if acc != F32x8 or not _is_tuple_of(v, I32x8, 8) or f != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return _acc_lane_sums(builder, args, 0)
    return F32x8(acc, v, f), codegen


@intrinsic
def acc_dots_x16lo(typingctx, acc, v, f):
    """acc_dots with lanes 0-3 of each dot (its first 16 weights) times 16 before the halves are added:
    for weights whose second 16 are high nibbles left in place (16 q: one mask, no shift, vnni only);
    f carries the 1/16 (exact: the result is acc_dots' bit for bit)."""
    if acc != F32x8 or not _is_tuple_of(v, I32x8, 8) or f != F32x8:
        return None

    def codegen(context, builder, sig, args):
        return _acc_lane_sums(builder, args, 4)
    return F32x8(acc, v, f), codegen


@intrinsic
def load_nib32_x16(typingctx, base, off):
    """16 bytes at base + off -> lane j < 16: byte j & 15, lane 16 + j: byte j & 0xF0 (16 times its
    high nibble, left in place: see acc_dots_x16lo)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        q = builder.load(_ptr(context, builder, sig, args, v16), align=1)
        q = builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
        return builder.and_(q, ir.Constant(V32, [15] * 16 + [0xF0] * 16))
    return I8x32(base, off), codegen


@intrinsic
def acc_dots16(typingctx, acc, v, f0, f1):
    """acc + sum_k float(v[k]) * [g x4, h x4] with (g, h) lanes (2k, 2k + 1) of f0 for k < 4, of f1
    (2k - 8, 2k - 7) for k >= 4: a scale per 16 weights (lanes 0-3 of a dot: its first 16); each
    half of each dot summed as integers first (see acc_dots): two conversions and multiplies."""
    if acc != F32x8 or not _is_tuple_of(v, I32x8, 8) or f0 != F32x8 or f1 != F32x8:
        return None

    def codegen(context, builder, sig, args):
        idx = ir.Constant(ir.VectorType(_I32, 8), [0, 2, 4, 6, 1, 3, 5, 7])
        v = [builder.extract_value(args[1], k) for k in range(8)]
        terms = [builder.fmul(builder.sitofp(_sums4(builder, v, k), VF), builder.shuffle_vector(f, f, idx))
                 for k, f in ((0, args[2]), (4, args[3]))]
        return builder.fadd(args[0], _opaque(builder, builder.fadd(*terms)))
    return F32x8(acc, v, f0, f1), codegen


def _opaque(builder, v):
    """v through an empty asm statement: LLVM cannot reassociate across it, so a block's sum joins the
    accumulator (a loop-carried chain) in one add, not as a chain of FMAs (Numba's fastmath flags
    every add as reassociable)."""
    return builder.asm(ir.FunctionType(VF, [VF]), "", "=v,0", [v], side_effect=False)


def _tree_add(builder, terms):
    """The sum of terms, pairwise."""
    while len(terms) > 1:
        terms = [builder.fadd(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
    return terms[0]


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


def _i16_lanes(builder, halves, xa):
    """8 int32 lanes summing the 32 products of two <16 x i8> weight halves (sign-extended) with
    the 32 int16 at address xa: two vpmaddwd (plain IR without AVX2: the same pair sums)."""
    i64, v16w = ir.IntType(64), ir.VectorType(ir.IntType(16), 16)
    out = None
    for h, qh in enumerate(halves):
        xv = builder.load(builder.inttoptr(builder.add(xa, ir.Constant(i64, 32 * h)), ir.PointerType(v16w)), align=1)
        qh = builder.sext(qh, v16w)
        if HAS_AVX2:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [v16w, v16w]), "llvm.x86.avx2.pmadd.wd")
            s = builder.call(fn, [qh, xv])
        else:
            m = builder.mul(builder.sext(qh, ir.VectorType(_I32, 16)), builder.sext(xv, ir.VectorType(_I32, 16)))
            s = builder.add(*(builder.shuffle_vector(m, m, ir.Constant(ir.VectorType(_I32, 8), list(range(j, 16, 2))))
                              for j in (0, 1)))
        out = s if out is None else builder.add(out, s)
    return out


def _halves(builder, q, addr=None):
    """The two <16 x i8> halves of the I8x32 q, or of the 32 bytes at address addr."""
    if addr is not None:
        return [builder.load(builder.inttoptr(builder.add(addr, ir.Constant(ir.IntType(64), 16 * h)),
                                              ir.PointerType(ir.VectorType(_I8, 16))), align=1) for h in range(2)]
    return [builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16))))
            for h in range(2)]


def _dot_i16_codegen(from_memory: bool):
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        if from_memory:
            w, p, x, xo = (context.cast(builder, a, t, types.int64) for a, t in zip(args, sig.args))
            halves = _halves(builder, None, builder.add(w, p))
        else:
            x, xo = (context.cast(builder, a, t, types.int64) for a, t in zip(args[1:], sig.args[1:]))
            halves = _halves(builder, args[0])
        return _i16_lanes(builder, halves, builder.add(x, builder.mul(xo, ir.Constant(i64, 2))))
    return codegen


@intrinsic
def dot_i16(typingctx, w, p, x, xo):
    """The dot of the 32 signed weight bytes at w + p with the int16 x[xo .. xo + 31] (x an
    address, xo in int16 units) as 8 int32 lanes that sum to it (lane l: weights 2 l, 2 l + 1,
    16 + 2 l, 17 + 2 l): sign-extended to int16 and dotted by two vpmaddwd (plain IR without AVX2:
    the same sums). Exact for |x| <= 32767: |lane| < 2^24."""
    if not all(isinstance(a, types.Integer) for a in (w, p, x, xo)):
        return None
    return I32x8(w, p, x, xo), _dot_i16_codegen(True)


@intrinsic
def dot_i16v(typingctx, q, x, xo):
    """dot_i16 of the 32 signed bytes of the vector q."""
    if q != I8x32 or not all(isinstance(a, types.Integer) for a in (x, xo)):
        return None
    return I32x8(q, x, xo), _dot_i16_codegen(False)


@njit(inline="always")
def prefetch_plan(base, r0, rb, end, mode):
    """(how far past a row's end a run's prefetch reaches, its first byte) for the rows of ``rb``
    bytes from base + r0 * rb to ``end``, by the index ``mode`` in cpu_simd.PREFETCH_MODES."""
    if mode == 0:
        return max(2 * rb, 2048), base + r0 * rb
    if mode == 1:
        return 2 * rb, base + (r0 + 2) * rb
    return 0, end


@njit(inline="always")
def _bit_to(h, k, to):
    """Bytewise bit k of h moved to bit ``to`` (others cleared); k and ``to`` fold to constants."""
    if k < to:
        return vand(vshl(h, to - k), 1 << to)
    if k > to:
        return vand(vshr(h, k - to), 1 << to)
    return vand(h, 1 << to)


@njit(inline="always")
def _q45(w, p, qo, h, c, five):
    """Sub-blocks 2c and 2c + 1 of a Q4_K/Q5_K block: 32 bytes of nibbles (and Q5_K's fifth bits)."""
    q = load_i8x32(w, p + qo + 32 * c)
    q0, q1 = nib_lo(q), nib_hi(q)
    if five:
        q0 = vor(q0, _bit_to(h, 2 * c, 4))
        q1 = vor(q1, _bit_to(h, 2 * c + 1, 4))
    return q0, q1


@njit(inline="always", fastmath=True)
def dot_q4_k(w, o, nb, xq, xo, xd, xs, xb, l2, isa, five):
    """Q4_K (five False; 144-byte blocks: f16 d, f16 dmin, u8 scales[12], u8 qs[128]) and Q5_K
    (five; 176 bytes: u8 qh[32] after the scales, bit s of qh[j] the fifth bit of weight 32 s + j).
    The 12 scale bytes as three words lo, mid, hi: sub-block s < 4 has scale lo_s & 63 and min
    mid_s & 63; s >= 4 has scale hi_t & 15 | (lo_t >> 6) << 4 and min hi_t >> 4 | (mid_t >> 6) << 4
    (t = s - 4, x_t byte t of word x); w = d scale q - dmin min."""
    acc = zero_f32()
    cor = zero_f32()
    buf = block_scratch()  # a block's 8 weight vectors, staged for dots
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
            q0, q1 = _q45(w, p, qo, h, c, five)
            store_i8x32(buf, 64 * c, q0)
            store_i8x32(buf, 64 * c + 32, q1)
        acc = acc_dots(acc, dots(isa, buf, xq, xo + 256 * b, l2), f)
    return hsum(acc) - hsum(cor)


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


@intrinsic
def q2_powers(typingctx):
    """[1, 1, 1/4, 1/4, 1/16, 1/16, 1/16, 1/16]: per 16 weights of Q2_K/Q3_K groups 0-3 (or 4-7),
    the inverse of the power of 2 their bits are read at (see _q23)."""
    return F32x8(), lambda context, builder, sig, args: ir.Constant(VF, [4.0 ** -min(j // 2, 2) for j in range(8)])


@njit(inline="always")
def _q23(w, p, j, three):
    """Group j of a Q2_K/Q3_K block (half h = j // 4, s = j % 4) as 2^e q, e = 2 s for s < 3, 4 for
    s = 3 (<= 16 * 7 = 112: unsigned bytes <= 127, as the avx2 path needs): 2 low bits at bits 2 s
    of qs[32 h + j'] (qs at p + 16 for Q2_K, p + 32 for Q3_K), masked in place (s < 3) or shifted
    to bit 4 (s = 3), Q3_K's third at bit 4 h + s of hmask[j'] (p), moved to bit e + 2."""
    h, s = j // 4, j % 4
    e = min(2 * s, 4)
    q = load_i8x32(w, p + (32 if three else 16) + 32 * h)
    q = vand(vshr(q, 2), 0x30) if s == 3 else vand(q, 3 << e)
    if three:
        q = vor(q, _bit_to(load_i8x32(w, p), 4 * h + s, e + 2))
    return q


@njit(inline="always", fastmath=True)
def dot_q2_3k(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, three):
    """Q2_K (three False; 84-byte blocks: u8 scales[16] (scale | min << 4), u8 qs[64], f16 d,
    f16 dmin; w = d scale q - dmin min) and Q3_K (110: u8 hmask[32], u8 qs[64], u8 scales[12], f16
    d; w = d (scale - 32) (q - 4), q - 4 when the third bit is clear). Q3_K's 6-bit scale k: low 4
    bits in byte k % 8 of the first 8 (high nibble for k >= 8), top 2 bits at bits 2 (k // 4) of
    byte 8 + k % 4. A block's 8 groups handed to the dots in registers, behind one branch on the
    path, a scale per 16 weights (acc_dots16). Groups read with their low bits in place where they
    fit (2^e q, see _q23: fewer shifts), the factors times 2^-e (exact: a power of 2 changes the
    rounding of no conversion or product)."""
    acc = zero_f32()
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
            s0, s1 = nib8_f32(w, p, 0), nib8_f32(w, p + 8, 0)
            m0, m1 = nib8_f32(w, p, 4), nib8_f32(w, p + 8, 4)
        blk = xb + 8 * b
        xdv = fmul(load_f32x8(xd, blk), d)
        cor = fadd(cor, fmul(fadd(fmul(m0, load_f32x8(xs16, 2 * blk)), fmul(m1, load_f32x8(xs16, 2 * blk + 8))), dmin))
        q = (_q23(w, p, 0, three), _q23(w, p, 1, three), _q23(w, p, 2, three), _q23(w, p, 3, three),
             _q23(w, p, 4, three), _q23(w, p, 5, three), _q23(w, p, 6, three), _q23(w, p, 7, three))
        f0 = fmul(fmul(s0, dup_lo(xdv)), q2_powers())  # the 2^-e of each group (exact: powers of 2)
        f1 = fmul(fmul(s1, dup_hi(xdv)), q2_powers())
        acc = acc_dots16(acc, dots(isa, q, xq, xo + 256 * b, l2), f0, f1)
    return hsum(acc) - hsum(cor)


@njit(inline="always")
def nibbles8(x):
    """The 8 nibbles of a 32-bit x one a byte (nibble s -> byte s: byte i's low nibble s = 2 i)."""
    x = (x | (x << 16)) & 0x0000FFFF0000FFFF  # byte i -> byte 2 i
    x = (x | (x << 8)) & 0x00FF00FF00FF00FF
    return (x & 0x000F000F000F000F) | ((x << 4) & 0x0F000F000F000F00)


@njit(inline="always")
def _iq4xs_scales(w, p):
    """IQ4_XS's 8 six-bit scales (unsigned, one a byte) of the block at byte p: low nibble s of the
    4 bytes scales_l at p + 4 (byte s // 2, high nibble for odd s), top 2 bits at bits 2 s of the
    u16 scales_h at p + 2."""
    lo = nibbles8(load_u32(w, p + 4))
    y = load_u32(w, p + 2) & 0xFFFF
    y = (y & 0xFF) | ((y & 0xFF00) << 24)  # 2-bit group s -> byte s (bits 0-1)
    y = (y & 0x0000000F0000000F) | ((y & 0x000000F0000000F0) << 12)
    y = (y & 0x0003000300030003) | ((y & 0x000C000C000C000C) << 6)
    return lo | (y << 4)


@njit(inline="always", fastmath=True)
def dot_iq4_xs(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table, tableu):
    """IQ4_XS (136-byte blocks: f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]; 32-weight
    sub-block s: 16 bytes of codes, low nibbles weights 0-15): w = d (scale - 32) level(code). On
    the vnni path the levels + 128 as unsigned bytes by lut16 from the 16 at ``tableu``, a block's 8
    dots staged (dots) and the 128 off through the activation sums xs; on the others (whose int16
    pair sums would overflow on bytes > 127) the signed levels from ``table``, dot by dot, against
    the activations' int16 form (dot_i16v; sdot with one level)."""
    acc0 = zero_f32()
    acc1 = zero_f32()
    cor = zero_f32()
    buf = block_scratch()
    for b in range(nb // 8):
        p = o + 136 * b
        sc = fadd(u8_f32x8(_iq4xs_scales(w, p)), np.float32(-32.0))
        blk = xb + 8 * b
        f = fmul(fmul(sc, load_f32x8(xd, blk)), load_f16(w, p))
        a = xo + 256 * b
        if isa == 0:
            for t in range(4):
                store_i8x32(buf, 64 * t, lut16(load_nib32(w, p + 8 + 32 * t), tableu))
                store_i8x32(buf, 64 * t + 32, lut16(load_nib32(w, p + 24 + 32 * t), tableu))
            acc0 = acc_dots(acc0, dots(isa, buf, xq, a, l2), f)
            cor = fadd(cor, fmul(fmul(sc, load_f32x8(xs, blk)), load_f16(w, p)))
        else:  # with two activation levels their int16 form (dot_i16v: two multiplies per 32, not four)
            for t in range(4):
                q0 = lut16(load_nib32(w, p + 8 + 32 * t), table)
                q1 = lut16(load_nib32(w, p + 24 + 32 * t), table)
                if l2:
                    v0 = dot_i16v(q0, xq + 2 * l2 + 64, a + 64 * t)
                    v1 = dot_i16v(q1, xq + 2 * l2 + 64, a + 64 * t + 32)
                else:
                    v0 = sdot(q0, xq, a + 64 * t, l2, isa)
                    v1 = sdot(q1, xq, a + 64 * t + 32, l2, isa)
                acc0 = fma_cvt(acc0, v0, lane(f, 2 * t))
                acc1 = fma_cvt(acc1, v1, lane(f, 2 * t + 1))
    return hsum(fadd(acc0, acc1)) - np.float32(128.0) * hsum(cor)
