"""CPU row kernels of the lattice and IQ1 i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): integer dots.

Per 32 weights each type stores grid indices (IQ2_*, IQ1_*: 4, 8 weights each; IQ3_*: 8, 4
weights each), 32 signs and one or two scales (see ``quant``'s layout table). The grid values are
unsigned bytes <= 62, stored in the tables as 64 + grid: a group's 32 bytes are gathered by its
indices (one load per entry) and its signs applied as one masked subtract, 128 - (64 + grid) where
the sign bit is set (``sign_off``: unsigned 2..126, so the avx2 path's int16 pair sums stay exact),
the 64 taken off through the activation sums. What can be decoded for a whole block at once is, in
vectors, before its groups are gathered: the KSIGNS bytes of IQ2_XXS, IQ3_XXS and IQ2_XS (the
7-bit index and its parity, ``ksigns``), the grid byte offsets of IQ2_XS, IQ2_S, IQ3_S and IQ1_*
(``grid_index_*``) and the scales, the staged sign bytes and offsets one block ahead of their
loads (``iq_scratch``). A block's 8 groups go to the dots in registers, behind one branch on the
instruction-set path (``cpu_kq.dots``, both activation levels); IQ2_XS, IQ2_S and IQ1_* scale
each 16 weights (``acc_dots16``). What bounds them is the gather (``_gather``): a group's indices
come in one scalar load split by shifts, each grid entry is broadcast from memory (a load and no
shuffle) and the entries are joined by blends (any vector port; one insert per entry kept the one
shuffle port busy): a blend per entry is now about a third of a block's vector work on llvm-mca's
Ice Lake server model (IQ2_XXS ~52 cycles a block, IQ3_XXS ~76 with twice the entries).

``IQ_TABLES`` (each grid as bytes) sits at ``cpu_experts``' code tables; the kernels
take its address.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_kq import (acc_dots, acc_dots16, dots, dup_hi, dup_lo, fadd, fmul, load_f32x8, load_u32, load_u64,
                     nibbles8, u8_f32x8, zip_hi, zip_lo)
from .cpu_simd import HAS_AVX2, F32x8, I32x8, I8x32, V8, VF, _splat, choose_mode, hsum, load_f16, zero_f32
from .iq_grids import grid

__all__ = ["IQ_TABLES", "GATHER_MODES", "choose_gather", "dot_iq_xxs", "dot_iq_s", "dot_iq1"]

# byte offsets in IQ_TABLES: the grids as bytes + 64 (see sign_off): IQ2_XXS (256 x 8), IQ3_XXS (256 x 4),
# IQ2_XS (512 x 8), IQ2_S (1024 x 8), IQ3_S (512 x 4)
_G2 = 0
_G3 = _G2 + 256 * 8
_G2XS = _G3 + 256 * 4
_G2S = _G2XS + 512 * 8
_G3S = _G2S + 1024 * 8
_G1 = _G3S + 512 * 4  # IQ1_S/IQ1_M: 8 g + 8 (delta -1/8), then 8 g + 10 (delta +1/8; entry 2048 on), 2048 x 8 each
IQ_TABLES = np.concatenate([(grid(n) + 64).astype(np.uint8).reshape(-1)
                            for n in ("IQ2_XXS", "IQ3_XXS", "IQ2_XS", "IQ2_S", "IQ3_S")]
                           + [(8 * grid("IQ1_S") + k).astype(np.uint8).reshape(-1) for k in (8, 10)])
assert IQ_TABLES.size == _G1 + 2 * 2048 * 8


def _gather(k: int, width: int, offsets: bool = False, loads: bool = False):
    """An intrinsic (table, w, p) -> I8x32: the ``k`` entries of ``width`` bytes of the table at
    address ``table``, side by side, indexed by the k bytes at address w + p (entry numbers), or
    with ``offsets`` by the k u16 at w + p (byte offsets into the table). The indices come in one
    or two scalar loads and are split by shifts (ALU ports, not loads); each entry is broadcast
    from memory (a load alone, no shuffle) and the k joined by blends (any vector port), where
    inserts would put one shuffle per entry on the one shuffle port. ``loads``: each index by a
    load of its own (load ports, not ALU ones)."""
    lane = ir.IntType(8 * width)
    vec = ir.VectorType(lane, k)
    per = 4 if offsets else 8  # indices per 64-bit word
    step = 16 if offsets else 8

    def code(builder, t, base):
        i64 = ir.IntType(64)
        nw = -(-k // per)  # words of indices
        wbits = ir.IntType(min(64, k * step))
        words = []
        for j in range(0 if loads else nw):
            wv = builder.load(builder.inttoptr(builder.add(base, ir.Constant(i64, 8 * j)), ir.PointerType(wbits)), align=1)
            # opaque, so that LLVM does not narrow the shifts below back into byte loads
            wv = builder.asm(ir.FunctionType(wbits, [wbits]), "", "=r,0", [wv], side_effect=False)
            words.append(builder.zext(wv, i64) if wbits.width < 64 else wv)
        parts = []
        for j in range(k):
            if loads:
                it = ir.IntType(step)
                f = builder.load(builder.inttoptr(builder.add(base, ir.Constant(i64, step // 8 * j)), ir.PointerType(it)), align=1)
                off = builder.zext(f, i64)
            else:
                f = words[j // per]
                if j % per:
                    f = builder.lshr(f, ir.Constant(i64, step * (j % per)))
                off = builder.and_(f, ir.Constant(i64, (1 << step) - 1))
            if not offsets:
                off = builder.mul(off, ir.Constant(i64, width))
            e = builder.load(builder.inttoptr(builder.add(t, off), ir.PointerType(lane)), align=1)
            b = _splat(builder, e, vec)  # vpbroadcast from memory
            parts.append(builder.asm(ir.FunctionType(vec, [vec]), "", "=v,0", [b], side_effect=False))
        return builder.bitcast(_blend_tree(builder, parts, k), ir.VectorType(ir.IntType(8), 32))
    return _table_intrinsic(code)


def _table_intrinsic(code):
    """An intrinsic (table, w, p) -> I8x32 (three integers, as int64) whose LLVM value is
    ``code(builder, table, w + p)``."""
    @intrinsic
    def gather(typingctx, table, w, p):
        if not all(isinstance(a, types.Integer) for a in (table, w, p)):
            return None

        def codegen(context, builder, sig, args):
            t, wa, pa = (context.cast(builder, a, s, types.int64) for a, s in zip(args, sig.args))
            return code(builder, t, builder.add(wa, pa))
        return I8x32(table, w, p), codegen
    return gather


def _blend_tree(builder, parts, k):
    """The k vectors joined: lane j from parts[j] (pairwise blends)."""
    idx = ir.VectorType(ir.IntType(32), k)
    lanes = [[j] for j in range(k)]  # which lanes each vector holds correctly
    vs = list(parts)
    while len(vs) > 1:
        nv, nl = [], []
        for i in range(0, len(vs), 2):
            a, b = vs[i], vs[i + 1]
            mask = [l + k if l in lanes[i + 1] else l for l in range(k)]
            nv.append(builder.shuffle_vector(a, b, ir.Constant(idx, mask)))
            nl.append(lanes[i] + lanes[i + 1])
        vs, lanes = nv, nl
    return vs[0]


# How a group's grid entries are gathered (the job's J_ISA field carries the mode at bits 4-5): "blend"
# (_gather: broadcasts from memory joined by blends, the indices split from one load by shifts),
# "loads" (the same, each index loaded alone) or "vgather" (_vgather: one hardware gather).
GATHER_MODES = ("blend", "loads", "vgather")


def choose_gather(name: str | None = None, what: str = "MOELAB_CPU_GATHER") -> int:
    """Index in GATHER_MODES of ``name`` (default: the environment's MOELAB_CPU_GATHER, else
    "blend"); a ValueError naming ``what`` for an unknown mode."""
    return choose_mode(GATHER_MODES, "MOELAB_CPU_GATHER", name, what)


def _vgather(k: int, width: int, offsets: bool = False):
    """``_gather`` by one AVX2 gather (vpgatherdq for k = 4 entries of 8 bytes, vpgatherdd for 8 of
    4): the k indices (bytes, or with ``offsets`` u16 byte offsets) at w + p widened to dwords by one
    load (vpmovzx), the table read at table + index * width (or + offset). A host without AVX2
    compiles _gather's code instead."""
    if not HAS_AVX2:
        return _gather(k, width, offsets)
    ity = ir.IntType(16 if offsets else 8)
    i32 = ir.IntType(32)
    lane = ir.IntType(8 * width)
    vec = ir.VectorType(lane, k)
    scale = 1 if offsets else width

    def code(builder, t, base):
        a = builder.inttoptr(base, ir.PointerType(ir.VectorType(ity, k)))
        idx = builder.zext(builder.load(a, align=1), ir.VectorType(i32, k))
        i8p = ir.PointerType(ir.IntType(8))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, i8p, idx.type, vec, ir.IntType(8)]),
                                             f"llvm.x86.avx2.gather.d.{'q' if width == 8 else 'd'}.256")
        ones = ir.Constant(vec, [-1] * k)
        r = builder.call(fn, [ir.Constant(vec, None), builder.inttoptr(t, i8p), idx, ones, ir.Constant(ir.IntType(8), scale)])
        return builder.bitcast(r, ir.VectorType(ir.IntType(8), 32))
    return _table_intrinsic(code)


def _by_mode(k: int, width: int, offsets: bool = False):
    """k grid entries of ``width`` bytes (indices: bytes at w + p, or with ``offsets`` u16 byte
    offsets) by gather mode vg (GATHER_MODES): _vgather, _gather with loads, or _gather."""
    blend, loads, hw = _gather(k, width, offsets), _gather(k, width, offsets, True), _vgather(k, width, offsets)

    @njit(inline="always")
    def by_mode(t, w, p, vg):
        return hw(t, w, p) if vg == 2 else loads(t, w, p) if vg == 1 else blend(t, w, p)
    return by_mode


_g8x4, _g4x8 = _by_mode(4, 8), _by_mode(8, 4)  # IQ2_XXS: four 8-byte entries; IQ3_XXS: eight 4-byte
_g8x4_off, _g4x8_off = _by_mode(4, 8, True), _by_mode(8, 4, True)  # at u16 byte offsets staged per block


@intrinsic
def sign_off(typingctx, q, bits):
    """q (byte j: 64 + a grid byte, the tables' form) as 128 - q where bit j of ``bits`` is set: the
    signed grid bytes (|grid| <= 62) as unsigned 2..126, for an unsigned x signed dot (the 64
    comes off through the activation sums); one masked subtract."""
    if q != I8x32 or not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        b = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), ir.IntType(32))
        neg = builder.bitcast(b, ir.VectorType(ir.IntType(1), 32))
        c128 = ir.Constant(ir.VectorType(ir.IntType(8), 32), [128] * 32)
        return builder.select(neg, builder.sub(c128, args[0]), args[0])
    return I8x32(q, bits), codegen


def _words(stride: int):
    """An intrinsic (w, off) -> I32x8: the 8 u32 at w + off + stride k (stride 4), or the second u32
    of each of the 8 8-byte groups from w + off (stride 8): reads exactly 32 or 64 bytes."""
    n = 8 * stride // 4

    @intrinsic
    def words(typingctx, w, off):
        if not (isinstance(w, types.Integer) and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            a = builder.add(*(context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args)))
            def half(k):  # 32 bytes (a 64-byte load would be a 512-bit register: see _grid_index_codegen)
                h = builder.add(a, ir.Constant(ir.IntType(64), 32 * k))
                return builder.load(builder.inttoptr(h, ir.PointerType(V8)), align=1)
            if n == 8:
                return half(0)
            lo = builder.asm(ir.FunctionType(V8, [V8]), "", "=v,0", [half(0)], side_effect=False)  # not merged
            return builder.shuffle_vector(lo, half(1), ir.Constant(ir.VectorType(i32, 8), list(range(1, 16, 2))))
        return I32x8(w, off), codegen
    return words


words4 = _words(4)  # IQ3_XXS: 8 contiguous sign words
words8 = _words(8)  # IQ2_XXS: the second u32 of each 8-byte group (signs and scale)


@intrinsic
def ksigns(typingctx, v):
    """Per u32 lane: its four 7-bit fields (bits 7 k ..) as KSIGNS bytes (the field and its
    parity in bit 7), byte k: the sign bits of weights 8 k .. 8 k + 7 of the lane's group."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        def c(x):
            return ir.Constant(V8, [x] * 8)
        u = args[0]
        f = [builder.and_(builder.lshr(u, c(7 * k)) if k else u, c(127)) for k in range(4)]
        s = builder.or_(builder.or_(f[0], builder.shl(f[1], c(8))), builder.or_(builder.shl(f[2], c(16)), builder.shl(f[3], c(24))))
        q = builder.xor(s, builder.lshr(s, c(4)))  # parity into bit 0 of each byte (see the docstring)
        q = builder.xor(q, builder.lshr(q, c(2)))
        q = builder.xor(q, builder.lshr(q, c(1)))
        return builder.or_(s, builder.shl(builder.and_(q, c(0x01010101)), c(7)))
    return I32x8(v), codegen


@intrinsic
def top4_f32(typingctx, v):
    """float(u >> 28) per u32 lane."""
    if v != I32x8:
        return None
    return F32x8(v), lambda context, builder, sig, args: builder.uitofp(
        builder.lshr(args[0], ir.Constant(V8, [28] * 8)), VF)


@intrinsic
def store_i32x8(typingctx, base, off, v):
    """The 32 bytes at base + off = v."""
    if not (isinstance(base, types.Integer) and isinstance(off, types.Integer)) or v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        a = builder.add(*(context.cast(builder, x, t, types.int64) for x, t in zip(args[:2], sig.args[:2])))
        builder.store(args[2], builder.inttoptr(a, ir.PointerType(V8)), align=1)
        return context.get_dummy_value()
    return types.none(base, off, v), codegen


@njit(inline="always")
def _xxs_signs(w, p, sl, three):
    """The KSIGNS bytes of the IQ2_XXS/IQ3_XXS block at byte p, at sl + _SIGNS."""
    store_i32x8(sl, _SIGNS, ksigns(words4(w, p + 66) if three else words8(w, p + 2)))


@njit(inline="always")
def _xxs_group(w, p, sl, table, g, three, vg):
    """Group g of the IQ2_XXS/IQ3_XXS block at byte p: its grid bytes gathered (by mode ``vg``,
    GATHER_MODES), signs applied."""
    if three:
        q = _g4x8(table + _G3, w, p + 2 + 8 * g, vg)
    else:
        q = _g8x4(table + _G2, w, p + 2 + 8 * g, vg)
    return sign_off(q, load_u32(sl, _SIGNS + 4 * g))


@njit(inline="always", fastmath=True)
def dot_iq_xxs(w, o, nb, xq, xo, xd, xs, xb, l2, isa, table, three, vg):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations (see cpu_experts._quantize):
    IQ2_XXS (three False; 66-byte blocks: f16 d, per group u32 grid indices, u32 signs + scale) or
    IQ3_XXS (98-byte blocks: f16 d, u8 qs[64], u32 signs + scale per group); ``table``:
    IQ_TABLES' address. A block's 8 sign words are decoded together (``ksigns``: sign bytes with
    their parity, staged after the weights), its scales (0.5 + top 4 bits) / 4 (IQ2_XXS) or / 2
    as one vector; its 8 dots behind one branch on the path (cpu_kq.dots)."""
    acc = zero_f32()
    cor = zero_f32()
    buf = iq_scratch()
    bs = 98 if three else 66
    n = nb // 8
    if n:
        _xxs_signs(w, o, buf, three)
    for b in range(n):
        p = o + bs * b
        sl = buf + _SLOT * (b & 1)
        if b + 1 < n:  # the next block's sign bytes, a block ahead of their loads (see iq_scratch)
            _xxs_signs(w, p + bs, buf + _SLOT * ((b + 1) & 1), three)
        u = words4(w, p + 66) if three else words8(w, p + 2)
        q = (_xxs_group(w, p, sl, table, 0, three, vg), _xxs_group(w, p, sl, table, 1, three, vg),
             _xxs_group(w, p, sl, table, 2, three, vg), _xxs_group(w, p, sl, table, 3, three, vg),
             _xxs_group(w, p, sl, table, 4, three, vg), _xxs_group(w, p, sl, table, 5, three, vg),
             _xxs_group(w, p, sl, table, 6, three, vg), _xxs_group(w, p, sl, table, 7, three, vg))
        f = fmul(fadd(top4_f32(u), np.float32(0.5)), load_f16(w, p) * (np.float32(0.5) if three else np.float32(0.25)))
        blk = xb + 8 * b
        acc = acc_dots(acc, dots(isa, q, xq, xo + 256 * b, l2), fmul(f, load_f32x8(xd, blk)))
        cor = fadd(cor, fmul(f, load_f32x8(xs, blk)))
    return hsum(acc) - np.float32(64.0) * hsum(cor)


_SIGNS, _IDX = 0, 32  # scratch bytes of a slot (iq_scratch): 0-31 a block's sign words, from _IDX its grid offsets (u16)
_SLOT = 160  # bytes from one slot of sign words and offsets to the next
_I16 = ir.IntType(16)


def _cv(n: int, vals, t=_I16):
    """A constant vector of n lanes of type t (vals: one value or a list)."""
    return ir.Constant(ir.VectorType(t, n), vals if isinstance(vals, list) else [vals] * n)


def _grid_index_codegen(kind: int):
    """Codegen of grid_index for kind 0 IQ2_XS, 1 IQ2_S, 2 IQ3_S, 3 IQ1_S, 4 IQ1_M: in parts of 16
    u16 lanes (256 bits: a wider vector would be a 512-bit register on AVX-512 hosts, whose use
    turns off one of the three vector ports of Intel's cores while it runs)."""
    def codegen(context, builder, sig, args):
        w, p, buf = (context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args))
        i64 = ir.IntType(64)

        def at(base, off):
            return builder.add(base, ir.Constant(i64, off))

        def load(a, n, t=ir.IntType(8)):
            return builder.load(builder.inttoptr(a, ir.PointerType(ir.VectorType(t, n))), align=1)

        def store(v, a):
            builder.store(v, builder.inttoptr(a, ir.PointerType(v.type)), align=1)

        def spread(v, js, per):  # lane i of the result: lane js[i] // per of v
            return builder.shuffle_vector(v, v, _cv(16, [j // per for j in js], ir.IntType(32)))

        wp = builder.add(w, p)
        n, width = (64, 4) if kind == 2 else (32, 8)
        for j0 in range(0, n, 16):
            js = list(range(j0, j0 + 16))
            if kind == 0:  # u16 entries: grid index (9 bits), KSIGNS index (7 bits)
                e = load(at(wp, 2 + 2 * j0), 16, _I16)
                store(builder.shl(builder.and_(e, _cv(16, 511)), _cv(16, 3)), at(buf, _IDX + 2 * j0))
                sg = builder.lshr(e, _cv(16, 9))
                q = builder.xor(sg, builder.lshr(sg, _cv(16, 4)))
                q = builder.xor(q, builder.lshr(q, _cv(16, 2)))
                q = builder.xor(q, builder.lshr(q, _cv(16, 1)))
                sg = builder.or_(sg, builder.shl(builder.and_(q, _cv(16, 1)), _cv(16, 7)))
                store(builder.trunc(sg, ir.VectorType(ir.IntType(8), 16)), at(buf, _SIGNS + j0))
                continue
            qs = builder.zext(load(at(wp, (2 if kind != 4 else 0) + j0), 16), ir.VectorType(_I16, 16))
            if kind == 1:  # 2 bits of qh[j // 4] at 2 (j % 4)
                hb = spread(builder.zext(load(at(wp, 66), 8), ir.VectorType(_I16, 8)), js, 4)
                hi = builder.and_(builder.lshr(hb, _cv(16, [2 * (j % 4) for j in js])), _cv(16, 3))
            elif kind == 2:  # bit j % 8 of qh[j // 8]
                hb = spread(builder.zext(load(at(wp, 66), 8), ir.VectorType(_I16, 8)), js, 8)
                hi = builder.and_(builder.lshr(hb, _cv(16, [j % 8 for j in js])), _cv(16, 1))
            elif kind == 3:  # 3 bits of the u16 qh[j // 4] at 3 (j % 4); its bit 15 clear: the +1/8 table
                hw = spread(load(at(wp, 34), 8, _I16), js, 4)
                hi = builder.and_(builder.lshr(hw, _cv(16, [3 * (j % 4) for j in js])), _cv(16, 7))
                plus = builder.shl(builder.lshr(builder.xor(hw, _cv(16, 0x8000)), _cv(16, 15)), _cv(16, 11))
                hi = builder.or_(hi, builder.lshr(plus, _cv(16, 8)))
            else:  # IQ1_M: nibble j of qh (byte j // 2, high for odd j): 3 bits, bit 3 clear: the +1/8 table
                hb = spread(builder.zext(load(at(wp, 32), 16), ir.VectorType(_I16, 16)), js, 2)
                k = builder.and_(builder.lshr(hb, _cv(16, [4 * (j % 2) for j in js])), _cv(16, 15))
                hi = builder.xor(k, _cv(16, 8))  # bits 0-2 the index's, bit 3 set for the +1/8 table
            idx = builder.or_(qs, builder.shl(hi, _cv(16, 8)))
            store(builder.shl(idx, _cv(16, 3 if width == 8 else 2)), at(buf, _IDX + 2 * j0))
        return context.get_dummy_value()
    return codegen


def _grid_index(kind: int):
    @intrinsic
    def grid_index(typingctx, w, p, buf):
        if not all(isinstance(a, types.Integer) for a in (w, p, buf)):
            return None
        return types.none(w, p, buf), _grid_index_codegen(kind)
    return grid_index


grid_index_2xs, grid_index_2s, grid_index_3s, grid_index_1s, grid_index_1m = (_grid_index(k) for k in range(5))
grid_index_2xs.__doc__ = """A block's grid byte offsets (u16, scratch from _IDX) and, for IQ2_XS, its sign bytes (KSIGNS
of each entry's 7-bit index, from _SIGNS); likewise IQ2_S, IQ3_S (offsets of 4-byte entries) and
IQ1_S/IQ1_M (from the -1/8 table, 2048 entries on for +1/8)."""



@intrinsic
def iq_scratch(typingctx):
    """The address of 320 bytes on the kernel's stack (one allocation in its entry block): two slots
    of _SLOT bytes, each a block's sign words (from _SIGNS) and grid offsets (from _IDX). A block's slot is written one block ahead of its loads: a load of a few
    bytes from a vector store still in flight may wait for the store to complete (store-to-load
    forwarding fails), stalling the block; a block later the store has completed."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(cgutils.alloca_once(builder, ir.ArrayType(ir.IntType(8), 2 * _SLOT)), ir.IntType(64))
    return types.int64(), codegen


@njit(inline="always")
def _index_s(w, p, sl, kind):
    if kind == 0:
        grid_index_2xs(w, p, sl)
    elif kind == 1:
        grid_index_2s(w, p, sl)
    else:
        grid_index_3s(w, p, sl)


@njit(inline="always")
def _s_group(w, p, sl, table, g, kind, vg):
    """Group g of the IQ2_XS/IQ2_S/IQ3_S block at byte p (offsets and IQ2_XS's signs staged at sl)."""
    if kind == 2:
        t = table + _G3S
        q = _g4x8_off(t, sl, _IDX + 16 * g, vg)
        return sign_off(q, load_u32(w, p + 74 + 4 * g))
    t = table + (_G2S if kind == 1 else _G2XS)
    q = _g8x4_off(t, sl, _IDX + 8 * g, vg)
    return sign_off(q, load_u32(w, p + 34 + 4 * g) if kind == 1 else load_u32(sl, _SIGNS + 4 * g))


@njit(inline="always", fastmath=True)
def dot_iq_s(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table, kind, vg):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: kind 0 IQ2_XS (74-byte
    blocks: f16 d, u16 qs[32], u8 scales[8]), 1 IQ2_S (82: f16 d, u8 qs[32], u8 signs[32], u8
    qh[8], u8 scales[8]), 2 IQ3_S (110: f16 d, u8 qs[64], u8 qh[8], u8 signs[32], u8 scales[4]);
    ``table``: IQ_TABLES' address. IQ2_XS/IQ2_S scale each 16 weights (d (0.5 + nibble) / 4, low
    nibble first), IQ3_S each 32 (d (1 + 2 nibble))."""
    acc = zero_f32()
    cor = zero_f32()
    buf = iq_scratch()
    bs = 74 if kind == 0 else 82 if kind == 1 else 110
    n = nb // 8
    if n:
        _index_s(w, o, buf, kind)
    for b in range(n):
        p = o + bs * b
        d = load_f16(w, p)
        sl = buf + _SLOT * (b & 1)
        if b + 1 < n:  # the next block's offsets (and sign bytes), a block ahead of their loads
            _index_s(w, p + bs, buf + _SLOT * ((b + 1) & 1), kind)
        q = (_s_group(w, p, sl, table, 0, kind, vg), _s_group(w, p, sl, table, 1, kind, vg), _s_group(w, p, sl, table, 2, kind, vg),
             _s_group(w, p, sl, table, 3, kind, vg), _s_group(w, p, sl, table, 4, kind, vg), _s_group(w, p, sl, table, 5, kind, vg),
             _s_group(w, p, sl, table, 6, kind, vg), _s_group(w, p, sl, table, 7, kind, vg))
        v = dots(isa, q, xq, xo + 256 * b, l2)
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


@intrinsic
def _f16_bits(typingctx, h):
    """The low 16 bits of an integer as a float16 bit pattern -> float32, exact (IQ1_M's scattered
    d; one vcvtph2ps, where computing it from its fields took a call to exp2f)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        b = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), ir.IntType(16))
        return builder.fpext(builder.bitcast(b, ir.HalfType()), ir.FloatType())
    return types.float32(h), codegen


@intrinsic
def iq1m_scales(typingctx, w, p):
    """(w, p) -> (f0, f1): IQ1_M's odd integer scales 2 s + 1 of a block's 16 half-groups (16
    weights each; f0 groups 0-3, f1 groups 4-7, two lanes per group) as float32, s at bits 3 k of
    the u16 scales[k // 4] (p + 48)."""
    if not (isinstance(w, types.Integer) and isinstance(p, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = builder.add(*(context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args)))
        h = builder.load(builder.inttoptr(builder.add(a, ir.Constant(ir.IntType(64), 48)), ir.PointerType(ir.VectorType(_I16, 4))), align=1)
        i32 = ir.IntType(32)
        h = builder.shuffle_vector(h, h, _cv(16, [k // 4 for k in range(16)], i32))
        v = builder.and_(builder.lshr(h, _cv(16, [3 * (k % 4) for k in range(16)])), _cv(16, 7))
        v = builder.or_(builder.shl(v, _cv(16, 1)), _cv(16, 1))
        lo, hi = (builder.uitofp(builder.shuffle_vector(v, v, _cv(8, list(range(k, k + 8)), i32)), VF)
                  for k in (0, 8))  # 8 lanes each (16 float32 would be a 512-bit register)
        return context.make_tuple(builder, sig.return_type, (lo, hi))
    return types.UniTuple(F32x8, 2)(w, p), codegen


@intrinsic
def iq1s_scales(typingctx, w, p):
    """(w, p) -> IQ1_S's odd integer scales 2 s + 1 of a block's 8 groups (32 weights each) as
    float32, s at bit 12 of each group's u16 qh (p + 34)."""
    if not (isinstance(w, types.Integer) and isinstance(p, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = builder.add(*(context.cast(builder, v, t, types.int64) for v, t in zip(args, sig.args)))
        h = builder.load(builder.inttoptr(builder.add(a, ir.Constant(ir.IntType(64), 34)), ir.PointerType(ir.VectorType(_I16, 8))), align=1)
        v = builder.and_(builder.lshr(h, _cv(8, 12)), _cv(8, 7))
        return builder.uitofp(builder.or_(builder.shl(v, _cv(8, 1)), _cv(8, 1)), VF)
    return F32x8(w, p), codegen




@njit(inline="always")
def _g1(t, sl, g, vg):
    """Group g's IQ1 grid bytes (offsets staged at sl)."""
    return _g8x4_off(t, sl, _IDX + 8 * g, vg)


@njit(inline="always")
def _index_1(w, p, sl, m):
    if m:
        grid_index_1m(w, p, sl)
    else:
        grid_index_1s(w, p, sl)


@njit(inline="always", fastmath=True)
def dot_iq1(w, o, nb, xq, xo, xd, xs, xs16, xb, l2, isa, table, m, vg):
    """Row from byte o of w (nb 32-weight groups) . the int8 activations: IQ1_S (m False; 50-byte
    blocks: f16 d, u8 qs[32], u16 qh[8]) or IQ1_M (56: u8 qs[32], u8 qh[16] a nibble per 8
    weights, u16 scales[4] with d in their top nibbles). w = dl (g + delta), g in {-1, 0, 1} and
    delta +-1/8, so 8 w / dl = u - 9 with u = 8 g + 9 + 8 delta in 0..18 (the tables): per 32
    (IQ1_S) or 16 (IQ1_M) weights, dl / 8 (u . x - 9 sum x). ``table``: IQ_TABLES' address."""
    acc = zero_f32()
    cor = zero_f32()
    buf = iq_scratch()
    t = table + _G1
    bs = 56 if m else 50
    n = nb // 8
    if n:
        _index_1(w, o, buf, m)
    for b in range(n):
        p = o + bs * b
        sl = buf + _SLOT * (b & 1)
        if b + 1 < n:  # the next block's offsets, a block ahead of their loads
            _index_1(w, p + bs, buf + _SLOT * ((b + 1) & 1), m)
        q = (_g1(t, sl, 0, vg), _g1(t, sl, 1, vg), _g1(t, sl, 2, vg), _g1(t, sl, 3, vg),
             _g1(t, sl, 4, vg), _g1(t, sl, 5, vg), _g1(t, sl, 6, vg), _g1(t, sl, 7, vg))
        v = dots(isa, q, xq, xo + 256 * b, l2)
        blk = xb + 8 * b
        xdv = load_f32x8(xd, blk)
        if m:
            sc = load_u64(w, p + 48)  # the top nibbles of the 4 u16 scales: d's bits, low first
            d = _f16_bits(((sc >> 12) & 0xF) | ((sc >> 24) & 0xF0) | ((sc >> 36) & 0xF00) | ((sc >> 48) & 0xF000))
            s0, s1 = iq1m_scales(w, p)
            dq = d * np.float32(0.125)
            f0 = fmul(s0, dq)  # per 16 weights
            f1 = fmul(s1, dq)
            acc = acc_dots16(acc, v, fmul(f0, dup_lo(xdv)), fmul(f1, dup_hi(xdv)))
            cor = fadd(cor, fadd(fmul(f0, load_f32x8(xs16, 2 * blk)), fmul(f1, load_f32x8(xs16, 2 * blk + 8))))
        else:
            f = fmul(iq1s_scales(w, p), load_f16(w, p) * np.float32(0.125))  # per 32 weights
            acc = acc_dots(acc, v, fmul(f, xdv))
            cor = fadd(cor, fmul(f, load_f32x8(xs, blk)))
    return hsum(acc) - np.float32(9.0) * hsum(cor)
