"""execute.gpu_quant on a GPU: every layout's x @ W.T and expert kernels against the numpy dequantizer, and their rates.

Per type: relative error ‖y - ref‖ / ‖ref‖ of ``matmul`` at 1 and 64 tokens (72 x 2304 random
blocks, float64 reference from ``quant.dequantize``) and, for the quantized types, of the ``qmoe_*``
expert kernels (2 experts of 256 x 512, the one-token path and 5 tokens through each); bound 1e-5
for float types, 2e-4 for quantized ones (int8 inputs of two levels, as the CPU pool). Then GB/s
of stored weights read per call (``--reps`` calls in one CUDA graph, its median time over 5
launches: the kernels' time without the host's launch overhead), beside the card's copy rate measured in the same run (and each rate as its share):
``matmul`` of ``--rows`` x ``--cols`` at 1 and 64 tokens, and the expert kernels as the engine
launches them on ``--experts`` experts of ``--ffn`` x ``--hidden`` (gate, up) and ``--hidden`` x
``--ffn`` (down): one token through all of them (qmoe1_gate_up + qmoe1_down_combine) and
``--tokens`` tokens through each (qmoe_gate_up + qmoe_down). Defaults: qwen3-30b-a3b's experts, 8
per call. ``--variants`` adds the batched call's rate with gpu_quant.cu's other tilings of
``qmoe_gate_up`` / ``qmoe_down`` (``gpu_quant.BATCH_VARIANTS``), measured beside the default. Needs
cupy and a GPU. The first call compiles gpu_quant.cu (about a minute;
CuPy caches it).

    python experiments/gpu_quant_check.py --out gpu_quant.json

Exit status 0 when every type is within its bound, 1 otherwise (2 on bad arguments).
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
from execute.gpu_quant import BATCH_VARIANTS, FLOAT_QTYPES, Experts, matmul  # noqa: E402

REL_ERR, REL_ERR_INT8 = 1e-5, 2e-4


def rel(y, ref) -> float:
    y = np.asarray(y, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) if np.isfinite(y).all() else float("inf")


def matmul_err(qt: int, tokens: int, rng: np.random.Generator) -> float:
    rows, cols = 72, 2304
    raw = Q.random_blocks(rng, qt, rows, cols, scale=0.05)
    x = rng.standard_normal((tokens, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ Q.dequantize(raw, qt, cols).astype(np.float64).T
    return rel(cp.asnumpy(matmul(cp.asarray(raw.reshape(-1)), qt, rows, cols, cp.asarray(x))), ref)


def expert_weights(qt: int, num_e: int, ffn: int, hidden: int, rng: np.random.Generator) -> list[np.ndarray]:
    """gate, up, down raw blocks (E, rows, row_bytes), weights of RMS ~2 / sqrt(cols)."""
    out = []
    for rows, cols in ((ffn, hidden), (ffn, hidden), (hidden, ffn)):
        probe = Q.dequantize(Q.random_blocks(np.random.default_rng(0), qt, 16, cols, 1.0), qt, cols)
        scale = 2.0 / np.sqrt(cols) / np.sqrt((probe.astype(np.float64) ** 2).mean())
        out.append(Q.random_blocks(rng, qt, num_e * rows, cols, scale).reshape(num_e, rows, -1))
    return out


def expert_errs(qt: int, rng: np.random.Generator, variants: tuple[str, ...] = ()) -> list[float]:
    """Errors of the one-token call, the batched call and the batched call of each of ``variants``."""
    num_e, ffn, hidden, tokens = 2, 256, 512, 37  # batches: a pass of 32 tokens and one of 5
    parts = expert_weights(qt, num_e, ffn, hidden, rng)
    w = cp.asarray(np.concatenate([p.reshape(num_e, -1) for p in parts], axis=1))
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ys = []
    for e in range(num_e):
        g, u, d = (Q.dequantize(p[e], qt, c).astype(np.float64) for p, c in zip(parts, (hidden, hidden, ffn)))
        a, b = x.astype(np.float64) @ g.T, x.astype(np.float64) @ u.T
        ys.append((a / (1 + np.exp(-a)) * b) @ d.T)
    wts = np.array([0.7, 0.3], np.float32)
    one = Experts(w, (qt, qt, qt), ffn, hidden, weights=wts)(cp.asarray(x[:1]))
    ref1 = sum(float(wts[e]) * ys[e][:1] for e in range(num_e))
    errs = [rel(cp.asnumpy(one), ref1)]
    for v in ("", *variants):
        batch = Experts(w, (qt, qt, qt), ffn, hidden, tokens=tokens, variant=v)(cp.asarray(x))
        errs.append(rel(cp.asnumpy(batch), np.concatenate(ys)))
    return errs


def timed(call, reps: int) -> float:
    """Seconds of one ``call()`` on the GPU: ``reps`` calls captured in one CUDA graph, the graph's
    median time over 5 launches / ``reps`` (no host launch overhead; plain events around each call
    where capture fails), after one warm-up call."""
    call()
    try:
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            for _ in range(reps):
                call()
            g = s.end_capture()
        g.launch(s)
        s.synchronize()
        ts = []
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / reps)
        return float(np.median(ts))
    except Exception as e:  # noqa: BLE001 (capture unsupported: time each call)
        print(f"(graph capture failed: {e}; timing calls one by one)", flush=True)
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        call()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(ts))


def copy_gbps(reps: int) -> float:
    """The card's device-to-device copy rate (bytes read + written per second, 1 GiB each way)."""
    src, dst = cp.ones(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32)
    return 2 * src.nbytes / timed(lambda: cp.copyto(dst, src), reps) / 1e9


def matmul_gbps(qt: int, rows: int, cols: int, tokens: int, reps: int, rng: np.random.Generator) -> float:
    w = cp.asarray(Q.random_blocks(rng, qt, rows, cols, scale=0.05).reshape(-1))
    x = cp.asarray(rng.standard_normal((tokens, cols)).astype(np.float32))
    y = matmul(w, qt, rows, cols, x)
    return w.nbytes / timed(lambda: matmul(w, qt, rows, cols, x, out=y), reps) / 1e9


def expert_gbps(qt: int, a: argparse.Namespace, rng: np.random.Generator) -> list[float]:
    """GB/s of the one-token call, the batched call and the batched call of each of ``a.variants``."""
    parts = expert_weights(qt, a.experts, a.ffn, a.hidden, rng)
    w = cp.asarray(np.concatenate([p.reshape(a.experts, -1) for p in parts], axis=1))
    one = Experts(w, (qt, qt, qt), a.ffn, a.hidden, weights=np.full(a.experts, 1 / a.experts, np.float32))
    x1 = cp.asarray(rng.standard_normal((1, a.hidden)).astype(np.float32))
    xb = cp.asarray(rng.standard_normal((a.tokens, a.hidden)).astype(np.float32))
    rates = [w.nbytes / timed(lambda: one(x1), a.reps) / 1e9]
    for k in one._calls:  # the one-token launches alone (gate/up, down): microseconds, printed
        print(f"  one-token launch: {1e6 * timed(lambda: k(cp.cuda.get_current_stream().ptr, x1.data.ptr), a.reps):.1f} us",
              end="", flush=True)
    print()
    for v in ("", *a.variants):
        batch = Experts(w, (qt, qt, qt), a.ffn, a.hidden, tokens=a.tokens, variant=v)
        rates.append(w.nbytes / timed(lambda: batch(xb), a.reps) / 1e9)
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096, help="a multiple of 256")
    p.add_argument("--experts", type=int, default=8, help="experts per call (<= 32)")
    p.add_argument("--ffn", type=int, default=768, help="expert rows of gate/up, a multiple of 256")
    p.add_argument("--hidden", type=int, default=2048, help="a multiple of 256")
    p.add_argument("--tokens", type=int, default=64, help="tokens through each expert in the batched call")
    p.add_argument("--types", default="", help="comma-separated type names (default: all)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", action="store_true", help=f"also time the batched kernels' variants {BATCH_VARIANTS}")
    p.add_argument("--out", type=Path, help="also write the rows here (JSON)")
    a = p.parse_args(argv)
    a.variants = BATCH_VARIANTS if a.variants else ()
    if a.rows < 1 or a.cols < 256 or a.cols % 256 or a.reps < 1 or a.tokens < 1:
        p.error("--rows >= 1, --cols a multiple of 256, --reps >= 1, --tokens >= 1")
    if not 1 <= a.experts <= 32 or a.ffn % 256 or a.hidden % 256 or a.ffn < 256 or a.hidden < 256:
        p.error("--experts in 1..32, --ffn and --hidden multiples of 256")
    names = [t for t in a.types.split(",") if t]
    if unknown := [t for t in names if t not in Q.QTYPE_BY_NAME]:
        p.error(f"--types: unknown {unknown}; expected names of {sorted(Q.QTYPE_BY_NAME)}")
    qtypes = [Q.QTYPE_BY_NAME[t] for t in names] if names else sorted(Q.LAYOUTS)
    rng = np.random.default_rng(0)
    rows, bad = [], 0
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    ceiling = copy_gbps(a.reps)
    print(f"matmul {a.rows} x {a.cols}; experts {a.experts} x ({a.ffn} x {a.hidden} x 3), 1 and {a.tokens} tokens ({dev}); "
          f"copy ceiling {ceiling:.0f} GB/s")
    print(f"{'type':8s}{'err 1':>9s}{'err 64':>9s}{'err e1':>9s}{'err eB':>9s}{'mm 1':>8s}{'mm 64':>8s}{'exp 1':>8s}"
          f"{'exp B':>8s}" + "".join(f"{v:>8s}" for v in a.variants) + "  GB/s")
    vkeys = [f"expert_batch{v}" for v in a.variants]
    for qt in qtypes:
        quant = qt not in FLOAT_QTYPES
        errs = [matmul_err(qt, 1, rng), matmul_err(qt, 64, rng)] + (expert_errs(qt, rng, a.variants) if quant else [])
        rates = [matmul_gbps(qt, a.rows, a.cols, 1, a.reps, rng), matmul_gbps(qt, a.rows, a.cols, 64, a.reps, rng)]
        rates += expert_gbps(qt, a, rng) if quant else []
        ok = max(errs) <= (REL_ERR_INT8 if quant else REL_ERR)
        bad += not ok
        keys = ["1", "64", "expert_1", "expert_batch", *vkeys]
        row = {"type": Q.LAYOUTS[qt].name, **{f"err_{k}": v for k, v in zip(keys, errs)},
               **{f"gbps_{k}": v for k, v in zip(keys, rates)}, "ok": ok}
        rows.append(row)
        cells = "".join(f"{v:9.1e}" for v in errs[:4]) + " " * 9 * (4 - len(errs[:4]))
        cells += "".join(f"{v:8.1f}" for v in rates) + " " * 8 * (4 + len(vkeys) - len(rates))
        share = " ".join(f"{v / ceiling:.2f}" for v in rates)
        print(f"{Q.LAYOUTS[qt].name:8s}{cells}  {'ok' if ok else 'FAILED'}  of ceiling: {share}", flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "device": dev,
                                     "copy_gbps": ceiling, "rows": rows}, indent=1))
    print(f"{len(rows) - bad}/{len(rows)} types within their bound")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
