"""Q2_K / Q3_K row dots on rows in the caches, one thread: ns per 256-weight block of the kernel's
dot (cpu_kq.dot_q2_3k) against its integer part alone (the 2-bit / 3-bit decode and the 8 integer
dots, the float factors hoisted out of the loop): what is left is the scales' decode, the per-16
factors, the mins' correction and the conversions, the part that per-256 activation scales (llama.cpp's
q8_K) would turn into integer work. Interleaved rounds, the best of 4.

    python docs/perf/cpu_avx2_host/q23_split.py Q3_K 512 1   # type, rows of 2048 weights, path (0 vnni, 1 avx2, 2 plain)
"""
import sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import numpy as np
from numba import njit
from execute import quant as Q
from execute.cpu_kq import _q23, acc_dots, dot_q2_3k, dots, load_f32x8
from execute.cpu_simd import hsum, zero_f32
from execute.cpu_experts import _quantize

@njit(inline="always", fastmath=True)
def ints_only(w, o, nb, xq, xo, xd, xs16, xb, l2, isa, three):
    """dot_q2_3k's integer part (decode + dots) with the float factors hoisted: a bound on what
    any activation-scale change saves."""
    acc = zero_f32()
    f0 = load_f32x8(xd, 0)
    for b in range(nb // 8):
        p = o + (110 if three else 84) * b
        q = (_q23(w, p, 0, three), _q23(w, p, 1, three), _q23(w, p, 2, three), _q23(w, p, 3, three),
             _q23(w, p, 4, three), _q23(w, p, 5, three), _q23(w, p, 6, three), _q23(w, p, 7, three))
        acc = acc_dots(acc, dots(isa, q, xq, xo + 256 * b, l2), f0)
    return hsum(acc)

name, rows, isa = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if name not in ("Q2_K", "Q3_K"):
    sys.exit(f"type {name!r}: expected Q2_K or Q3_K")
qt = Q.QTYPE_BY_NAME[name]; three = name == "Q3_K"
cols = 2048; nb = cols // 32; l2 = cols
rng = np.random.default_rng(0)
w = Q.random_blocks(rng, qt, rows, cols, 0.02).reshape(-1)
x = rng.standard_normal(cols).astype(np.float32)
xq = np.zeros(2 * cols + 64 + 2 * cols, np.int8)
xd = np.zeros(nb, np.float32); xs = np.zeros(nb, np.float32); xs16 = np.zeros(2 * nb, np.float32)
_quantize(x, xq[:2 * cols], xd, xs, xs16, l2, np.zeros(0, np.int16))
rb = w.nbytes // rows
@njit(fastmath=True)
def run(w, xq, xd, xs16, rows, rb, nb, l2, isa, reps, three, variant):
    wa, xa, da, sa = w.ctypes.data, xq.ctypes.data, xd.ctypes.data, xs16.ctypes.data
    s = np.float32(0)
    for _ in range(reps):
        for r in range(rows):
            if variant == 0:
                s += dot_q2_3k(wa, r * rb, nb, xa, 0, da, sa, 0, l2, isa, three)
            else:
                s += ints_only(wa, r * rb, nb, xa, 0, da, sa, 0, l2, isa, three)
    return s
reps = max(1, 300_000_000 // w.nbytes)
res = {0: [], 1: []}
for rnd in range(4):
    for v in (0, 1):
        run(w, xq, xd, xs16, rows, rb, nb, l2, isa, 1, three, v)
        t0 = time.perf_counter(); run(w, xq, xd, xs16, rows, rb, nb, l2, isa, reps, three, v); dt = time.perf_counter() - t0
        res[v].append(dt / (reps * rows * nb // 8) * 1e9)
print(name, "isa", isa, "rows", rows, "ns per 256-weight block: full %.2f (min of 4), integer part alone %.2f" % (min(res[0]), min(res[1])))
