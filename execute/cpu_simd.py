"""256-bit vector values and the few operations the CPU expert kernels need, as Numba intrinsics.

Numba has no vector type; this module gives it three, ``I8x32`` (32 bytes), ``I32x8`` and
``F32x8``, each an LLVM vector held in a register, and operations on them that lower to one or
a few instructions. The kernels in ``execute.cpu_experts`` are written with them in plain Numba
loops, so the block structure of each quant type stays readable while the inner loop is the
integer dot llama.cpp uses: ``dpbusd`` (32 unsigned weight bytes x 32 signed activation bytes,
summed in groups of 4 into 8 int32 lanes), one int -> float conversion and one FMA per 32
weights into a vector accumulator, one horizontal sum per row.

``dpbusd`` is ``vpdpbusd`` (AVX-512 VNNI or AVX-VNNI) when the host has it; otherwise the same
arithmetic in plain IR (zero/sign extension, multiply, pairwise adds), which LLVM lowers to
``vpmaddwd`` and adds on AVX2. ``lut16`` (MXFP4's code table) is ``vpshufb`` (AVX2). Numba's
on-disk cache is keyed on the CPU name and features, so code compiled for one host is never
loaded on another.

Loads take an address (``addr(array)``) and a byte offset, are unaligned (``align 1``) and read
exactly the bytes named; callers keep offsets in bounds (the kernels' views are checked once per
call by ``tensor_views``) and the arrays alive.
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

__all__ = ["I8x32", "I32x8", "F32x8", "HAS_VNNI", "zero_i32", "zero_f32", "load_i8x32", "load_nib32",
           "nib_lo", "nib_hi", "vand", "vor", "vshl", "vshr", "xor80", "lut16", "dpbusd", "dpbusd_isa", "sign_abs", "bits32", "ISA_PATHS", "host_isas", "choose_isa",
           "PREFETCH_MODES", "choose_mode", "choose_prefetch", "fma_cvt",
           "fma_cvt2", "comb256", "hsum", "addr", "prefetch", "load_f16", "load_f32", "load_u16", "load_i8", "load_u8", "store_f32",
           "ptr_f32", "ptr_i64", "ptr_i8", "ptr_i16", "atomic_load", "atomic_store", "atomic_add", "pause", "futex_wait",
           "futex_wake", "now_ns", "yield_cpu"]

_features = llvm.get_host_cpu_features()
HAS_VNNI = bool(_features.get("avx512vnni") and _features.get("avx512vl")) or bool(_features.get("avxvnni"))


class VecType(types.Type):
    """A 256-bit LLVM vector of ``n`` lanes of ``kind`` (i8, i32 or f32)."""

    def __init__(self, kind: str, n: int):
        self.kind, self.n = kind, n
        super().__init__(name=f"Vec{kind}x{n}")


I8x32, I32x8, F32x8 = VecType("i8", 32), VecType("i32", 8), VecType("f32", 8)
_I8, _I32, _F32 = ir.IntType(8), ir.IntType(32), ir.FloatType()


def _ll(t: VecType) -> ir.VectorType:
    return ir.VectorType({"i8": _I8, "i32": _I32, "f32": _F32}[t.kind], t.n)


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _ll(fe_type))


V8, V32, VF = _ll(I32x8), _ll(I8x32), _ll(F32x8)


def _splat(builder, value, vt: ir.VectorType):
    """Scalar ``value`` (already of the lane type) in every lane of ``vt``."""
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, vt.count), [0] * vt.count))


def _ptr(context, builder, sig, args, lt, k=0):
    """Pointer to byte args[k] + args[k + 1] (two integers; args[k] alone when it is the last), as ``lt*``."""
    b = context.cast(builder, args[k], sig.args[k], types.int64)
    if k + 1 < len(args):
        b = builder.add(b, context.cast(builder, args[k + 1], sig.args[k + 1], types.int64))
    return builder.inttoptr(b, ir.PointerType(lt))


def _addr_args(base, off) -> bool:
    return isinstance(base, types.Integer) and isinstance(off, types.Integer)


@intrinsic
def addr(typingctx, arr):
    """The address of a contiguous array's first element (int64). The kernels read through
    addresses, not arrays, so that Numba adds no reference counting to their inner loops; the
    caller keeps the array alive."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(a.data, ir.IntType(64))
    return types.int64(arr), codegen


@intrinsic
def zero_i32(typingctx):
    """<8 x i32> zeros."""
    return I32x8(), lambda context, builder, sig, args: ir.Constant(V8, None)


@intrinsic
def zero_f32(typingctx):
    """<8 x f32> zeros."""
    return F32x8(), lambda context, builder, sig, args: ir.Constant(VF, None)


@intrinsic
def load_i8x32(typingctx, base, off):
    """Bytes base + off .. base + off + 31."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_ptr(context, builder, sig, args, V32), align=1)
    return I8x32(base, off), codegen


@intrinsic
def load_nib32(typingctx, base, off):
    """16 bytes at base + off -> 32 nibbles: lane j < 16 is byte j & 15, lane 16 + j is byte j >> 4
    (the 16 bytes loaded into both halves, the upper shifted: no cross-half shuffle)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        v16, v64 = ir.VectorType(_I8, 16), ir.VectorType(ir.IntType(64), 4)
        q = builder.load(_ptr(context, builder, sig, args, v16), align=1)
        q = builder.bitcast(builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2)), v64)
        q = builder.lshr(q, ir.Constant(v64, [0, 0, 4, 4]))  # the copy in the upper half shifted (vpsrlvq)
        return builder.and_(builder.bitcast(q, V32), ir.Constant(V32, [15] * 32))
    return I8x32(base, off), codegen


def _binop(name):
    def make(typingctx, v, c):
        if v != I8x32:
            return None

        def codegen(context, builder, sig, args):
            rhs = args[1] if sig.args[1] == I8x32 else _splat(builder, builder.trunc(args[1], _I8), V32)
            return getattr(builder, name)(args[0], rhs)
        return I8x32(v, c), codegen
    return make


vand = intrinsic(_binop("and_"))
vand.__doc__ = "Bytewise v & c (c: a vector or an integer, splatted)."
vor = intrinsic(_binop("or_"))
vor.__doc__ = "Bytewise v | c."
vshl = intrinsic(_binop("shl"))
vshl.__doc__ = "Bytewise v << c."
vshr = intrinsic(_binop("lshr"))
vshr.__doc__ = "Bytewise logical v >> c."


@intrinsic
def nib_lo(typingctx, v):
    """Bytewise v & 15."""
    if v != I8x32:
        return None
    return I8x32(v), lambda context, builder, sig, args: builder.and_(args[0], ir.Constant(V32, [15] * 32))


@intrinsic
def nib_hi(typingctx, v):
    """Bytewise v >> 4 (logical)."""
    if v != I8x32:
        return None
    return I8x32(v), lambda context, builder, sig, args: builder.lshr(args[0], ir.Constant(V32, [4] * 32))


@intrinsic
def xor80(typingctx, v):
    """Bytewise v ^ 0x80: int8 w -> uint8 w + 128."""
    if v != I8x32:
        return None
    return I8x32(v), lambda context, builder, sig, args: builder.xor(args[0], ir.Constant(V32, [0x80] * 32))


@intrinsic
def lut16(typingctx, v, table):
    """Bytewise table[v] for v in 0..15; ``table`` the address of 16 bytes (vpshufb)."""
    if v != I8x32 or not isinstance(table, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        t = builder.load(_ptr(context, builder, sig, args, v16, k=1), align=1)
        t2 = builder.shuffle_vector(t, t, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32, [V32, V32]), "llvm.x86.avx2.pshuf.b")
        return builder.call(fn, [t2, args[0]])
    return I8x32(v, table), codegen


def _dpbusd_ir(builder, acc, u, s):
    """acc + per-lane sums of 4 products u8 x s8, in plain IR (no dot-product instruction)."""
    w32 = ir.VectorType(_I32, 32)
    p = builder.mul(builder.zext(u, w32), builder.sext(s, w32))
    idx = ir.VectorType(_I32, 8)
    parts = [builder.shuffle_vector(p, p, ir.Constant(idx, [4 * i + k for i in range(8)])) for k in range(4)]
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


def _dpbusd_vnni(builder, acc, u, s):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [V8, V8, V8]), "llvm.x86.avx512.vpdpbusd.256")
    return builder.call(fn, [acc, builder.bitcast(u, V8), builder.bitcast(s, V8)])


def _dpbusd_avx2(builder, acc, u, s):
    """vpmaddubsw (u8 x s8, adjacent pairs summed into int16, saturating) then vpmaddwd with ones:
    exact while each pair's sum fits int16, i.e. u <= 127 or |s| * u small (see ``dpbusd``)."""
    v16 = ir.VectorType(ir.IntType(16), 16)
    mb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [V32, V32]), "llvm.x86.avx2.pmadd.ub.sw")
    mw = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [v16, v16]), "llvm.x86.avx2.pmadd.wd")
    pairs = builder.call(mb, [u, s])
    return builder.add(acc, builder.call(mw, [pairs, ir.Constant(v16, [1] * 16)]))


# The integer dot's instruction-set paths, best first: "vnni" (vpdpbusd: AVX-512 VNNI with VL, or
# AVX-VNNI, one LLVM intrinsic, LLVM picks the encoding), "avx2" (vpmaddubsw + vpmaddwd, as
# llama.cpp's AVX2 path), "plain" (widening multiplies and adds in plain IR). Kernels take the path
# as a run-time argument (cpu_experts: a job field) and compile every path the host has; a path the
# host lacks compiles as "plain" and is never chosen (choose_isa refuses it).
ISA_PATHS = ("vnni", "avx2", "plain")
ISA_VNNI, ISA_AVX2, ISA_PLAIN = 0, 1, 2
HAS_AVX2 = bool(_features.get("avx2"))
_ISA_CODEGEN = (_dpbusd_vnni if HAS_VNNI else _dpbusd_ir, _dpbusd_avx2 if HAS_AVX2 else _dpbusd_ir, _dpbusd_ir)


def host_isas() -> tuple[str, ...]:
    """The paths this host runs, best first."""
    return tuple(n for n, ok in zip(ISA_PATHS, (HAS_VNNI, HAS_AVX2, True)) if ok)


def choose_isa(name: str | None = None, what: str = "MOELAB_CPU_ISA") -> int:
    """Index in ISA_PATHS of ``name`` (default: the environment's MOELAB_CPU_ISA, else the best
    the host runs); a ValueError naming ``what`` for an unknown path or one the host lacks."""
    import os

    name = name if name is not None else os.environ.get("MOELAB_CPU_ISA") or host_isas()[0]
    if name not in ISA_PATHS:
        raise ValueError(f"{what}={name!r}: expected one of {', '.join(ISA_PATHS)}")
    if name not in host_isas():
        raise ValueError(f"{what}={name!r}: this CPU runs only {', '.join(host_isas())}")
    return ISA_PATHS.index(name)


# How a run of weight rows is prefetched (the job's J_ISA field carries the mode above its 2 path
# bits): "2k" at least 2 KB (and two rows) past the row being dotted, the run's first bytes at
# once; "rows" the row two on, from the run's third row; "off" none (the hardware's prefetchers).
PREFETCH_MODES = ("2k", "rows", "off")


def choose_mode(modes: tuple, env: str, name: str | None = None, what: str | None = None) -> int:
    """Index in ``modes`` of ``name`` (default: the environment's ``env``, else the first mode); a
    ValueError naming ``what`` (default ``env``) for an unknown mode."""
    import os

    name = name if name is not None else os.environ.get(env) or modes[0]
    if name not in modes:
        raise ValueError(f"{what or env}={name!r}: expected one of {', '.join(modes)}")
    return modes.index(name)


def choose_prefetch(name: str | None = None, what: str = "MOELAB_CPU_PREFETCH") -> int:
    """Index in PREFETCH_MODES of ``name`` (default: the environment's MOELAB_CPU_PREFETCH, else
    "2k"); a ValueError naming ``what`` for an unknown mode."""
    return choose_mode(PREFETCH_MODES, "MOELAB_CPU_PREFETCH", name, what)


def _isa_branches(builder, isa, name: str) -> tuple[list, object]:
    """A three-way branch on ``isa`` (an i64 at run time; plain by default): the basic blocks
    ``{name}_<path>`` in ``ISA_PATHS`` order and ``{name}_done``, which the paths must end in."""
    fn = builder.function
    blocks = [fn.append_basic_block(f"{name}_{n}") for n in ISA_PATHS]
    done = fn.append_basic_block(f"{name}_done")
    sw = builder.switch(isa, blocks[ISA_PLAIN])
    sw.add_case(ir.Constant(isa.type, ISA_VNNI), blocks[ISA_VNNI])
    sw.add_case(ir.Constant(isa.type, ISA_AVX2), blocks[ISA_AVX2])
    return blocks, done


def _dp_switch(builder, isa, acc, u, s):
    """The dot on path ``isa`` (an i64 at run time): a three-way branch LLVM folds or unswitches
    where ``isa`` is loop-invariant, so each path's instructions run alone."""
    blocks, done = _isa_branches(builder, isa, "dp")
    out = []
    for k, blk in enumerate(blocks):
        builder.position_at_end(blk)
        out.append((_ISA_CODEGEN[k](builder, acc, u, s), builder.block))
        builder.branch(done)
    builder.position_at_end(done)
    phi = builder.phi(V8)
    for v, blk in out:
        phi.add_incoming(v, blk)
    return phi


@intrinsic
def dpbusd_isa(typingctx, isa, acc, u, s):
    """acc[l] + sum_{k<4} u[4l+k] * s[4l+k] (u unsigned, s signed bytes) on instruction-set path
    ``isa`` (index in ISA_PATHS): vpdpbusd; vpmaddubsw + vpmaddwd, exact when every pair
    u[2i] s[2i] + u[2i+1] s[2i+1] fits int16 (u <= 127 with |s| <= 127, or u <= 128 with |s| <= 127
    as after ``sign_abs``); or plain IR."""
    if not isinstance(isa, types.Integer) or acc != I32x8 or u != I8x32 or s != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return _dp_switch(builder, context.cast(builder, args[0], sig.args[0], types.int64), *args[1:])
    return I32x8(isa, acc, u, s), codegen


@intrinsic
def dpbusd(typingctx, acc, u, s):
    """acc[l] + sum_{k<4} u[4l+k] * s[4l+k]: u as unsigned bytes, s as signed bytes, on the best
    path compiled for this host (vpdpbusd with VNNI, else plain IR)."""
    if acc != I32x8 or u != I8x32 or s != I8x32:
        return None
    return I32x8(acc, u, s), lambda context, builder, sig, args: _ISA_CODEGEN[0](builder, *args)


@intrinsic
def sign_abs(typingctx, w, x):
    """(|w|, x * sign(w)) bytewise, for signed x signed dots on an unsigned x signed instruction:
    |w| . x sign(w) = w . x (|w| of -128 is 128 as an unsigned byte; x must avoid -128)."""
    if w != I8x32 or x != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, abs_sign(builder, *args))
    return types.UniTuple(I8x32, 2)(w, x), codegen


def abs_sign(builder, wv, xv):
    """(|w|, x sign(w)) bytewise in IR: vpabsb and, on AVX2 hosts, vpsignb (one instruction where the
    selects it replaces take a compare and a blend or more per vector)."""
    zero = ir.Constant(V32, None)
    neg = builder.icmp_signed("<", wv, zero)
    aw = builder.select(neg, builder.sub(zero, wv), wv)
    if HAS_AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32, [V32, V32]), "llvm.x86.avx2.psign.b")
        return aw, builder.call(fn, [xv, wv])
    return aw, builder.select(neg, builder.sub(zero, xv), builder.select(builder.icmp_signed("==", wv, zero), zero, xv))


@intrinsic
def bits32(typingctx, base, off):
    """The 32 bits of the uint32 at base + off as bytes 0/1 (lane j: bit j)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        b = builder.load(_ptr(context, builder, sig, args, _I32), align=1)
        return builder.zext(builder.bitcast(b, ir.VectorType(ir.IntType(1), 32)), V32)
    return I8x32(base, off), codegen


@intrinsic
def comb256(typingctx, hi, lo):
    """hi * 256 + lo, per int32 lane (two activation levels with scales in ratio 256)."""
    if hi != I32x8 or lo != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.add(builder.shl(args[0], ir.Constant(V8, [8] * 8)), args[1])
    return I32x8(hi, lo), codegen


@intrinsic
def fma_cvt(typingctx, acc, v, s):
    """acc + float(v) * s (s: float32 scalar, broadcast)."""
    if acc != F32x8 or v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], VF)
        sv = _splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), VF)
        return builder.fadd(args[0], builder.fmul(f, sv, flags=("fast",)), flags=("fast",))
    return F32x8(acc, v, types.float32), codegen


@intrinsic
def fma_cvt2(typingctx, acc, v, s0, s1):
    """acc + float(v) * [s0 x4, s1 x4]: lanes 0-3 (bytes 0-15) scaled by s0, lanes 4-7 by s1."""
    if acc != F32x8 or v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        f = builder.sitofp(args[1], VF)
        a = _splat(builder, context.cast(builder, args[2], sig.args[2], types.float32), VF)
        b = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), VF)
        sv = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 12, 13, 14, 15]))
        return builder.fadd(args[0], builder.fmul(f, sv, flags=("fast",)), flags=("fast",))
    return F32x8(acc, v, types.float32, types.float32), codegen


@intrinsic
def hsum(typingctx, v):
    """Sum of the 8 lanes (float32, any order)."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, VF]),
                                            "llvm.vector.reduce.fadd.v8f32")
        return builder.call(fn, [ir.Constant(_F32, -0.0), args[0]], fastmath=("fast",))
    return types.float32(v), codegen


@intrinsic
def prefetch(typingctx, base, off):
    """Hint the cache line at base + off into the caches (prefetcht0); no fault if out of range."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        i8p = ir.PointerType(_I8)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [_ptr(context, builder, sig, args, _I8), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                          ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(base, off), codegen


@intrinsic
def load_f16(typingctx, base, off):
    """The float16 at byte base + off (any alignment), as float32."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        h = builder.load(_ptr(context, builder, sig, args, ir.HalfType()), align=1)
        return builder.fpext(h, _F32)
    return types.float32(base, off), codegen


@intrinsic
def load_f32(typingctx, base, i):
    """Element ``i`` of the float32 array at address ``base``."""
    if not _addr_args(base, i):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), ir.PointerType(_F32))
        return builder.load(builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]), align=4)
    return types.float32(base, i), codegen


@intrinsic
def load_u16(typingctx, base, i):
    """Element ``i`` of the uint16 array at address ``base``, as uint32."""
    if not _addr_args(base, i):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), ir.PointerType(ir.IntType(16)))
        v = builder.load(builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]), align=2)
        return builder.zext(v, _I32)
    return types.uint32(base, i), codegen


@intrinsic
def load_i8(typingctx, base, off):
    """The byte at base + off as int32 (signed)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        b = builder.load(_ptr(context, builder, sig, args, _I8), align=1)
        return builder.sext(b, _I32)
    return types.int32(base, off), codegen


@intrinsic
def load_u8(typingctx, base, off):
    """The byte at base + off as int32 (unsigned)."""
    if not _addr_args(base, off):
        return None

    def codegen(context, builder, sig, args):
        b = builder.load(_ptr(context, builder, sig, args, _I8), align=1)
        return builder.zext(b, _I32)
    return types.int32(base, off), codegen


@intrinsic
def store_f32(typingctx, base, i, v):
    """Element ``i`` of the float32 array at address ``base`` = v."""
    if not _addr_args(base, i):
        return None

    def codegen(context, builder, sig, args):
        p = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), ir.PointerType(_F32))
        builder.store(context.cast(builder, args[2], sig.args[2], types.float32),
                      builder.gep(p, [context.cast(builder, args[1], sig.args[1], types.int64)]), align=4)
        return context.get_dummy_value()
    return types.none(base, i, v), codegen


def _view(dtype):
    @intrinsic
    def ptr(typingctx, base):
        if not isinstance(base, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            lt = context.get_data_type(dtype)
            return builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64), ir.PointerType(lt))
        return types.CPointer(dtype)(base), codegen
    return ptr


ptr_f32 = _view(types.float32)
ptr_f32.__doc__ = "float32* at an address (for numba.carray views of scratch the caller keeps alive)."
ptr_i64 = _view(types.int64)
ptr_i64.__doc__ = "int64* at an address."
ptr_i8 = _view(types.int8)
ptr_i8.__doc__ = "int8* at an address."
ptr_i16 = _view(types.int16)
ptr_i16.__doc__ = "int16* at an address."


# Synchronisation for the pool's native thread team: sequentially consistent atomics on int64
# array elements, the spin-loop hint, Linux futexes on the low 32 bits of an int64 element, and
# CLOCK_MONOTONIC (the clock of Python's time.perf_counter on Linux).

def _elem(context, builder, sig, args):
    a = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(a.data, [context.cast(builder, args[1], sig.args[1], types.int64)])


def _int64_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64


@intrinsic
def atomic_load(typingctx, arr, i):
    """arr[i], an atomic (sequentially consistent) load."""
    if not _int64_array(arr):
        return None
    return types.int64(arr, i), lambda context, builder, sig, args: builder.load_atomic(
        _elem(context, builder, sig, args), "seq_cst", 8)


@intrinsic
def atomic_store(typingctx, arr, i, v):
    """arr[i] = v, an atomic (sequentially consistent) store."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        builder.store_atomic(context.cast(builder, args[2], sig.args[2], types.int64), _elem(context, builder, sig, args),
                             "seq_cst", 8)
        return context.get_dummy_value()
    return types.none(arr, i, v), codegen


@intrinsic
def atomic_add(typingctx, arr, i, v):
    """arr[i] += v atomically; the old value."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _elem(context, builder, sig, args),
                                  context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")
    return types.int64(arr, i, v), codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 pause)."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


_I64 = ir.IntType(64)
_SYS_FUTEX, _FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = 202, 128, 129  # x86-64 Linux
_SYS_SCHED_YIELD = 24


@intrinsic
def yield_cpu(typingctx):
    """sched_yield: a spinning thread lets another runnable thread of its core run (returns at once
    when there is none). A spin that never yields holds a core its waker may be queued on."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
        builder.call(fn, [ir.Constant(_I64, _SYS_SCHED_YIELD)])
        return context.get_dummy_value()
    return types.none(), codegen


def _futex(context, builder, sig, args, op, val, timeout):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, [_I64], var_arg=True), "syscall")
    p = builder.bitcast(_elem(context, builder, sig, args), ir.PointerType(_I32))
    return builder.call(fn, [ir.Constant(_I64, _SYS_FUTEX), p, ir.Constant(_I32, op), val, timeout])


@intrinsic
def futex_wait(typingctx, arr, i, expected, timeout_ns):
    """Sleep while the low 32 bits of arr[i] equal those of ``expected``, at most timeout_ns
    (a spurious or early return is possible: callers re-check)."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        t = context.cast(builder, args[3], sig.args[3], types.int64)
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        billion = ir.Constant(_I64, 1_000_000_000)
        builder.store(builder.sdiv(t, billion), builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        builder.store(builder.srem(t, billion), builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        val = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), _I32)
        return _futex(context, builder, sig, args, _FUTEX_WAIT_PRIVATE, val, ts)
    return types.int64(arr, i, expected, timeout_ns), codegen


@intrinsic
def futex_wake(typingctx, arr, i):
    """Wake every thread in futex_wait on arr[i]."""
    if not _int64_array(arr):
        return None

    def codegen(context, builder, sig, args):
        return _futex(context, builder, sig, args, _FUTEX_WAKE_PRIVATE, ir.Constant(_I32, 2 ** 31 - 1),
                      ir.Constant(ir.PointerType(_I8), None))
    return types.int64(arr, i), codegen


@intrinsic
def now_ns(typingctx):
    """CLOCK_MONOTONIC in nanoseconds."""
    def codegen(context, builder, sig, args):
        ts = cgutils.alloca_once(builder, ir.ArrayType(_I64, 2))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_I32, ts.type]), "clock_gettime")
        builder.call(fn, [ir.Constant(_I32, 1), ts])
        s = builder.load(builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 0)]))
        ns = builder.load(builder.gep(ts, [ir.Constant(_I32, 0), ir.Constant(_I32, 1)]))
        return builder.add(builder.mul(s, ir.Constant(_I64, 1_000_000_000)), ns)
    return types.int64(), codegen


def kernel_cache_subpath() -> str:
    """Where under NUMBA_CACHE_DIR Numba keeps this package's kernels (its own naming: the folder's
    name and the SHA1 of its path)."""
    import os

    from numba.core.caching import UserProvidedCacheLocator

    return UserProvidedCacheLocator.get_suitable_cache_subpath(os.path.abspath(__file__))


def drop_stale_kernel_caches(modules: tuple[str, ...] = ("cpu_simd", "cpu_kq", "cpu_iq", "cpu_q32", "cpu_experts",
                                                               "cpu_pool")) -> bool:
    """Numba keys a cached function on its own source file alone: a kernel cached in cpu_pool.py
    would keep calling the old code of a changed cpu_experts.py. So the cache indexes of these
    modules (this package's ``__pycache__``, or NUMBA_CACHE_DIR) are dropped whenever the digest
    of their sources changes; True when they were. Called before any of their kernels runs."""
    import hashlib
    import os
    from pathlib import Path

    from numba.core import config

    here = Path(__file__).resolve().parent
    digest = hashlib.sha1(b"".join((here / f"{m}.py").read_bytes() for m in modules)).hexdigest()
    cache = Path(config.CACHE_DIR) / kernel_cache_subpath() if config.CACHE_DIR else here / "__pycache__"
    stamp = cache / "moelab-kernels.sha1"
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        for m in modules:
            for f in cache.glob(f"{m}.*.nbi"):
                f.unlink(missing_ok=True)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}")
        tmp.write_text(digest)
        tmp.replace(stamp)
    except OSError:  # a read-only tree: Numba caches elsewhere (or not at all)
        return False
    return True
