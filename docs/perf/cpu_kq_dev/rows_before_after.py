"""Row kernels as the pool's row loop runs them, single thread, rows in L2, min over reps, one process:
before = HEAD copy's _dot_row with the path a run-time value (its _rows), after = this tree's _dot_row
with the path a constant (its _rows_<path>). GB/s of stored weights. usage: rows_before_after.py ISA TYPES REPS [TREE] [DIR_OF_execute_before]"""
import sys, time
# the tree under test, and beside it a package ``execute_before``: execute/{__init__,cpu_experts,cpu_simd,cpu_iq,
# cpu_pool,quant,quant_iq,iq_grids,experts}.py of commit 442646f (its relative imports keep it self-contained)
sys.path.insert(0, sys.argv[4] if len(sys.argv) > 4 else "."); sys.path.insert(0, sys.argv[5] if len(sys.argv) > 5 else "/tmp/cmp")
import numpy as np
from numba import njit
import execute.cpu_experts as A
import execute_before.cpu_experts as B
from execute import quant as Q
from execute.cpu_simd import choose_isa

def addr(a): return a.__array_interface__['data'][0]
isa_name, types, reps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
isa = choose_isa(isa_name)

def make(M, isa_expr):
    src = f"""
def loop(w, rows, rb, cols, xq, xd, xs, xs16, l2, isa, table, out, qt):
    for r in range(rows):
        out[r] = M._dot_row(qt, w, rb, r, cols, 0, 0, xq, xd, xs, xs16, l2, table, {isa_expr})
"""
    g = {"M": M}
    exec(src, g)
    return njit(fastmath=True)(g["loop"])

fb, fa = make(B, "isa"), make(A, str(isa))
rng = np.random.default_rng(0)
rows, cols = 256, 2048
x = rng.standard_normal(cols).astype(np.float32)
xq = np.zeros(2 * cols + 64, np.int8); xd = np.zeros(cols // 32 + 1, np.float32)
xs = np.zeros_like(xd); xs16 = np.zeros(cols // 16 + 1, np.float32)
A._quantize(x, xq, xd, xs, xs16, cols)
print(f"path {isa_name}: single thread, {rows} rows x {cols} (in L2), min of {reps}; before -> after GB/s of stored weights", flush=True)
for name in types:
    qt = Q.QTYPE_BY_NAME[name]
    data = Q.random_blocks(rng, qt, rows, cols, 1 / np.sqrt(cols)).reshape(-1)
    rb = Q.row_bytes(qt, cols, "x", Q.CPU_QTYPES)
    outs, best = [], []
    for f, M in ((fb, B), (fa, A)):
        out = np.zeros(rows, np.float32)
        args = (addr(data), rows, rb, cols, addr(xq), addr(xd), addr(xs), addr(xs16), cols, isa, addr(M._TABLES), out, qt)
        t0 = time.perf_counter(); f(*args); ct = time.perf_counter() - t0
        outs.append(out); best.append([1e9, args])
    for _ in range(reps):
        for k, f in enumerate((fb, fa)):
            t0 = time.perf_counter(); f(*best[k][1]); best[k][0] = min(best[k][0], time.perf_counter() - t0)
    gb = [rows * rb / b[0] / 1e9 for b in best]
    ref = Q.dequantize(data.reshape(rows, -1), qt, cols).reshape(rows, cols).astype(np.float64) @ x.astype(np.float64)
    err = [np.linalg.norm(o - ref) / np.linalg.norm(ref) for o in outs]
    print(f"{name:8s} {gb[0]:6.2f} -> {gb[1]:6.2f}  x{gb[1]/gb[0]:.2f}   rel err {err[0]:.1e} / {err[1]:.1e}", flush=True)
