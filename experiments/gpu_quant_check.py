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
per call. ``--variants`` adds the batched call's rate with gpu_quant.cu's other versions of
``qmoe_gate_up`` / ``qmoe_down`` (``gpu_quant.BATCH_VARIANTS``), measured beside the default. The
expert rates take ``--copies`` copies of the weights in turn (more bytes than the L2 cache holds).
Each one-token launch is also timed alone, for the default kernels and ``gpu_quant.ONE_VARIANTS``
(``--only``: again in a module of the type alone; ``--down-rows``: the down launch at other rows per
block; ``--probe``: without their dots, and without their weight copies); ``--one`` times only those,
``--no-one`` all but those; ``--no-matmul`` skips the matmul rates; ``--occupancy`` prints the
kernels' registers, stack and blocks per SM. Needs cupy and a GPU; gpu_quant.cu compiles in 30-60 s.

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
from execute.kernel_timing import copy_ceiling_gbps, graph_seconds as timed  # noqa: E402
from execute.gpu_quant import BATCH_VARIANTS, FLOAT_QTYPES, ONE_PROBES, ONE_VARIANTS, Q8_BLOCK, Experts, kernel_info, matmul  # noqa: E402

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


def tried(fn, what: str) -> float:  # fn(), or NaN with the error printed: a failed variant leaves the others' figures
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"  {what}: {type(e).__name__}: {' '.join(str(e).split())[:200]}", flush=True)
        return float("nan")


def expert_errs(qt: int, rng: np.random.Generator, variants: tuple[str, ...] = (), defines: tuple[str, ...] = ()) -> list[float]:
    """Errors of the one-token call, the batched call and the batched call of each of ``variants``
    (kernels of the module of ``defines``)."""
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
    ref1 = sum(float(wts[e]) * ys[e][:1] for e in range(num_e))
    one = [lambda v=v: rel(cp.asnumpy(Experts(w, (qt, qt, qt), ffn, hidden, weights=wts, variant=v, defines=defines)(
        cp.asarray(x[:1]))), ref1) for v in ("", *ONE_VARIANTS)]
    batch = [lambda v=v: rel(cp.asnumpy(Experts(w, (qt, qt, qt), ffn, hidden, tokens=tokens, variant=v, defines=defines)(
        cp.asarray(x))), np.concatenate(ys)) for v in ("", *variants)]
    return [tried(f, f"error {v or 'default'}") for f, v in zip(one + batch, ["1", *ONE_VARIANTS, "B", *variants])]


def copy_gbps(reps: int) -> tuple[float, float]:
    """The card's device-to-device copy rate (bytes read + written per second, 1 GiB each way): a
    copy (a graph's memcpy node) and an element-wise kernel (x * 1)."""
    src, dst = cp.ones(1 << 28, cp.float32), cp.empty(1 << 28, cp.float32)
    return (2 * src.nbytes / timed(lambda: cp.copyto(dst, src), reps) / 1e9,
            2 * src.nbytes / timed(lambda: cp.multiply(src, 1.0, out=dst), reps) / 1e9)


def matmul_gbps(qt: int, rows: int, cols: int, tokens: int, reps: int, rng: np.random.Generator) -> float:
    w = cp.asarray(Q.random_blocks(rng, qt, rows, cols, scale=0.05).reshape(-1))
    x = cp.asarray(rng.standard_normal((tokens, cols)).astype(np.float32))
    y = matmul(w, qt, rows, cols, x)
    return w.nbytes / timed(lambda: matmul(w, qt, rows, cols, x, out=y), reps) / 1e9


def expert_gbps(qt: int, a: argparse.Namespace, rng: np.random.Generator) -> list[float]:
    """GB/s of the one-token call, the batched call and the batched call of each of ``a.variants``
    (``a.copies`` copies of the experts' weights, taken in turn). Prints each one-token launch
    alone (us) for the default kernels, ``ONE_VARIANTS``, and with ``a.only`` the same compiled in
    a module of type ``qt`` alone."""
    parts = expert_weights(qt, a.experts, a.ffn, a.hidden, rng)
    w1 = np.concatenate([p.reshape(a.experts, -1) for p in parts], axis=1)
    ws = [cp.asarray(np.roll(w1, i, axis=0)) for i in range(a.copies)]
    wts = np.full(a.experts, 1 / a.experts, np.float32)
    x1 = cp.asarray(rng.standard_normal((1, a.hidden)).astype(np.float32))
    xb = cp.asarray(rng.standard_normal((a.tokens, a.hidden)).astype(np.float32))
    rates, nb = [], ws[0].nbytes
    bd = (f"GQ_ONLY={qt}",) if a.type_modules else ()  # the module every timed kernel comes from
    only = [] if a.type_modules or not a.only else [(v, (f"GQ_ONLY={qt}",), True) for v in ("", *ONE_VARIANTS)]
    for v, d, extra in [] if a.no_one else [(v, bd, False) for v in ("", *ONE_VARIANTS)] + only:
        ones = [Experts(w, (qt, qt, qt), a.ffn, a.hidden, weights=wts, variant=v, defines=d) for w in ws]
        us = [1e6 * timed([lambda o=o, k=k: o._calls[k](cp.cuda.get_current_stream().ptr, x1.data.ptr) for o in ones],
                          a.reps) for k in (0, 1)]
        t = timed([lambda o=o: o(x1) for o in ones], a.reps)
        rates += [] if extra else [nb / t / 1e9]
        print(f"  one token{v or ' (default)'}{' ' + d[0] if extra else ''}: gate/up {us[0]:.1f} us, down {us[1]:.1f} us, "
              f"{nb / t / 1e9:.0f} GB/s", flush=True)
    for v in ONE_PROBES if a.probe and not a.no_one else ():  # without the dots (_p) and the weight copies (_n)
        ones = [Experts(w, (qt, qt, qt), a.ffn, a.hidden, weights=wts, variant=v, defines=bd) for w in ws]
        us = [1e6 * timed([lambda o=o, k=k: o._calls[k](cp.cuda.get_current_stream().ptr, x1.data.ptr) for o in ones],
                          a.reps) for k in (0, 1)]
        print(f"  probe{v} ({'no dots' if v == '_p' else 'no dots, no copies'}): gate/up {us[0]:.1f} us, "
              f"down {us[1]:.1f} us", flush=True)
    for r in [] if a.no_one else a.down_rows:
        ones = [Experts(w, (qt, qt, qt), a.ffn, a.hidden, weights=wts, down_rows=r, defines=bd) for w in ws]
        for o in ones:
            o(x1)
        us = 1e6 * timed([lambda o=o: o._calls[1](cp.cuda.get_current_stream().ptr, x1.data.ptr) for o in ones], a.reps)
        print(f"  one token down, {r} rows per block: {us:.1f} us", flush=True)
    only = [(v, d, True) for v, d, _ in only[:1]]
    for v, d, extra in [] if a.one else [(v, bd, False) for v in ("", *a.variants)] + only:
        r = tried(lambda: nb / timed([lambda b=b: b(xb) for b in [Experts(w, (qt, qt, qt), a.ffn, a.hidden, tokens=a.tokens,
                  variant=v, defines=d) for w in ws]], a.reps) / 1e9, f"{a.tokens} tokens {v}")
        rates += [] if extra else [r]
        print(f"  {a.tokens} tokens {v or '(f16)'}{' ' + d[0] if extra else ''}: {r:.1f} GB/s", flush=True)
    return rates


def occupancy() -> None:
    """Registers, stack bytes, shared bytes and resident blocks per SM of the expert kernels."""
    batched = [(n + v, Q8_BLOCK.get(v, (128, 0, 0))[0], Q8_BLOCK.get(v, (128, 0, 0))[1 + i]) for v in ("", *BATCH_VARIANTS)
               for i, n in enumerate(("qmoe_gate_up", "qmoe_down"))]
    one = [("qmoe1_gate_up", 128, 0), ("qmoe1_down_combine", 256, 0)]  # (ONE_VARIANTS: the same kernels launched otherwise)
    for name, block, smem in one + batched + [("qmatmul_q1", 128, 0), ("qx8", 128, 0)]:
        try:
            print(f"  {name} x{block}: {kernel_info(name, block, shared_bytes=smem)}", flush=True)
        except Exception as e:  # noqa: BLE001 (a driver without the call: the rates still run)
            print(f"  {name}: {e}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=4096, help="a multiple of 256")
    p.add_argument("--experts", type=int, default=8, help="experts per call (<= 32 unless --no-one)")
    p.add_argument("--ffn", type=int, default=768, help="expert rows of gate/up, a multiple of 256")
    p.add_argument("--hidden", type=int, default=2048, help="a multiple of 256")
    p.add_argument("--tokens", type=int, default=64, help="tokens through each expert in the batched call")
    p.add_argument("--types", default="", help="comma-separated type names (default: all)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", nargs="?", const=",".join(BATCH_VARIANTS), default="", help="also time these batched variants (comma-separated; alone: all)")
    one = p.add_mutually_exclusive_group()
    one.add_argument("--one", action="store_true", help="time the one-token expert calls only (no matmul, no batches)")
    p.add_argument("--type-modules", action="store_true", help="every expert kernel from a module compiled for its "
                   "type alone (-DGQ_ONLY: a fraction of the whole module's compile); no matmul")
    one.add_argument("--no-one", action="store_true", help="time the batched expert calls only (errors still run)")
    p.add_argument("--only", action="store_true", help="also time them compiled in a module of the type alone")
    p.add_argument("--copies", type=int, default=4, help="copies of the experts' weights timed in turn (beyond L2)")
    p.add_argument("--occupancy", action="store_true", help="print the expert kernels' registers and blocks per SM")
    p.add_argument("--down-rows", default="", help="comma-separated rows per block to time the down launch at")
    p.add_argument("--no-matmul", action="store_true", help="skip the matmul rates (their errors still run)")
    p.add_argument("--probe", action="store_true", help="also time the one-token launches without their dots (and copies)")
    p.add_argument("--out", type=Path, help="also write the rows here (JSON)")
    a = p.parse_args(argv)
    a.variants, a.no_matmul = tuple(v for v in a.variants.split(",") if v), a.no_matmul or a.type_modules
    if bad_v := [v for v in a.variants if v not in BATCH_VARIANTS]: p.error(f"--variants: unknown {bad_v}; expected names of {BATCH_VARIANTS}")
    try:
        a.down_rows = [int(r) for r in a.down_rows.split(",") if r]
    except ValueError:
        p.error(f"--down-rows: {a.down_rows!r}, expected comma-separated integers")
    if any(not 1 <= r <= 32 for r in a.down_rows):
        p.error(f"--down-rows: {a.down_rows}, expected values in 1..32")
    if a.rows < 1 or a.cols < 256 or a.cols % 256 or a.reps < 1 or a.tokens < 1 or a.copies < 1:
        p.error("--rows >= 1, --cols a multiple of 256, --reps >= 1, --tokens >= 1, --copies >= 1")
    if not 1 <= a.experts <= (4096 if a.no_one else 32) or a.ffn % 256 or a.hidden % 256 or a.ffn < 256 or a.hidden < 256:
        p.error("--experts in 1..32 (1..4096 with --no-one), --ffn and --hidden multiples of 256")
    names = [t for t in a.types.split(",") if t]
    if unknown := [t for t in names if t not in Q.QTYPE_BY_NAME]:
        p.error(f"--types: unknown {unknown}; expected names of {sorted(Q.QTYPE_BY_NAME)}")
    qtypes = [Q.QTYPE_BY_NAME[t] for t in names] if names else sorted(Q.LAYOUTS)
    rng = np.random.default_rng(0)
    rows, bad = [], 0
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    (copy, ceiling), copy_ev = copy_gbps(a.reps), copy_ceiling_gbps()
    print(f"matmul {a.rows} x {a.cols}; experts {a.experts} x ({a.ffn} x {a.hidden} x 3) in {a.copies} copies, 1 and "
          f"{a.tokens} tokens ({dev}); copy ceiling {ceiling:.0f} GB/s (element-wise; memcpy {copy:.0f} in a graph, "
          f"{copy_ev:.0f} by events)")
    if a.occupancy:
        t1, t2 = cp.ones(32, cp.float32), cp.empty(32, cp.float32)
        print(f"  a graph node of one tiny kernel: {1e6 * timed(lambda: cp.multiply(t1, 1.0, out=t2), a.reps):.1f} us")
        occupancy()
    ekeys = ([] if a.no_one else ["expert_1", *(f"expert_1{v}" for v in ONE_VARIANTS)]) + ([] if a.one else
                                                                     ["expert_batch", *(f"expert_batch{v}" for v in a.variants)])
    ekeys = [k.replace("expert_", "e") for k in ekeys]
    keys = ["mm1", "mm64", *ekeys] if not (a.one or a.no_matmul) else ekeys
    ekeys_err = [*([] if a.type_modules else ["mm1", "mm64"]), "e1", *(f"e1{v}" for v in ONE_VARIANTS), "eB",
                 *(f"eB{v}" for v in a.variants)]
    print(f"{'type':8s}" + "".join(f"{'err ' + k:>10s}" for k in ekeys_err)
          + "".join(f"{k:>10s}" for k in keys) + "  GB/s")
    for qt in [t for t in qtypes if not (a.type_modules and t in FLOAT_QTYPES)]:  # (type modules: quantized only)
        quant = qt not in FLOAT_QTYPES
        errs = [] if a.type_modules else [matmul_err(qt, 1, rng), matmul_err(qt, 64, rng)]
        errs += expert_errs(qt, rng, a.variants, (f"GQ_ONLY={qt}",) if a.type_modules else ()) if quant else []
        rates = [] if a.one or a.no_matmul else [matmul_gbps(qt, a.rows, a.cols, t, a.reps, rng) for t in (1, 64)]
        rates += expert_gbps(qt, a, rng) if quant else []
        ok = all(e <= (REL_ERR_INT8 if quant else REL_ERR) for e in errs)  # (NaN: a variant failed)
        bad += not ok
        rows.append({"type": Q.LAYOUTS[qt].name, "errs": dict(zip(ekeys_err, errs)), **{f"gbps_{k}": v for k, v in zip(keys, rates)},
                     "ok": ok})
        share = " ".join(f"{v / ceiling:.2f}" for v in rates)
        print(f"{Q.LAYOUTS[qt].name:8s}" + "".join(f"{v:10.1e}" for v in errs) + "".join(f"{v:10.1f}" for v in rates)
              + f"  {'ok' if ok else 'FAILED'}  of ceiling: {share}; of memcpy (events): "
              + " ".join(f"{v / copy_ev:.2f}" for v in rates), flush=True)
        if a.out is not None:  # after every type: a run cut short keeps what it measured
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "device": dev, "copy_gbps": copy,
                                         "copy_events_gbps": copy_ev, "elementwise_gbps": ceiling, "rows": rows}, indent=1))
    print(f"{len(rows) - bad}/{len(rows)} types within their bound")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
