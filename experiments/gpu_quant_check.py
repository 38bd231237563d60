"""execute.gpu_quant on a GPU: every layout's x @ W.T against the numpy dequantizer, and its rate.

Per type: relative error ‖y - ref‖ / ‖ref‖ of 1 and 64 tokens (72 x 512 random blocks, float64
reference from ``quant.dequantize``; bound 1e-5), then GB/s of stored weights read by one call
of ``--rows`` x ``--cols`` at 1 and 64 tokens (median of ``--reps`` calls timed with CUDA
events, after a warm-up). Needs cupy and a GPU; no pytest (the device machine has none).

    python experiments/gpu_quant_check.py --out gpu_quant.json

Exit status 0 when every type is within the bound, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy as cp  # noqa: E402

from execute import quant as Q  # noqa: E402
from execute.gpu_quant import matmul  # noqa: E402


def rel_err(qt: int, tokens: int, rng: np.random.Generator) -> float:
    rows, cols = 72, 512
    raw = Q.random_blocks(rng, qt, rows, cols, scale=0.05)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ Q.dequantize(raw, qt, cols).astype(np.float64).T
    y = cp.asnumpy(matmul(cp.asarray(raw.reshape(-1)), qt, rows, cols, cp.asarray(x)))
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) if np.isfinite(y).all() else float("inf")


def gbps(qt: int, rows: int, cols: int, tokens: int, reps: int, rng: np.random.Generator) -> float:
    w = cp.asarray(Q.random_blocks(rng, qt, rows, cols, scale=0.05).reshape(-1))
    x = cp.asarray(rng.standard_normal((tokens, cols)).astype(np.float32))
    y = matmul(w, qt, rows, cols, x)
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        matmul(w, qt, rows, cols, x, out=y)
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return w.nbytes / float(np.median(ts)) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096, help="a multiple of 256")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, help="also write the rows here (JSON)")
    a = p.parse_args(argv)
    if a.rows < 1 or a.cols < 256 or a.cols % 256 or a.reps < 1:
        p.error("--rows >= 1, --cols a multiple of 256, --reps >= 1")
    rng = np.random.default_rng(0)
    rows, bad = [], 0
    print(f"{'type':8s}{'err 1':>10s}{'err 64':>10s}{'GB/s 1':>9s}{'GB/s 64':>9s}  ({cp.cuda.runtime.getDeviceProperties(0)['name'].decode()})")
    for qt in sorted(Q.LAYOUTS):
        e1, e64 = rel_err(qt, 1, rng), rel_err(qt, 64, rng)
        g1, g64 = gbps(qt, a.rows, a.cols, 1, a.reps, rng), gbps(qt, a.rows, a.cols, 64, a.reps, rng)
        ok = e1 <= 1e-5 and e64 <= 1e-5
        bad += not ok
        rows.append({"type": Q.LAYOUTS[qt].name, "err_1": e1, "err_64": e64, "gbps_1": g1, "gbps_64": g64, "ok": ok})
        print(f"{Q.LAYOUTS[qt].name:8s}{e1:10.1e}{e64:10.1e}{g1:9.1f}{g64:9.1f}  {'ok' if ok else 'FAILED'}", flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    print(f"{len(rows) - bad}/{len(rows)} types within 1e-5")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
