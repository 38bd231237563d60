"""CPU expert pool rates: GB/s of expert weights read per layer call, old kernels vs new, per quant
type and thread count, measured side by side in one run.

``old``: the kernels before the vectorized rewrite (experiments/cpu_experts_before.py: each row
dequantized into a float32 buffer, then dotted). ``new``: execute/cpu_experts.py (blocks dotted in
place). Shapes: Qwen3-30B-A3B experts (hidden 2048, ffn 768), one token on each of 8 experts per
call (decode); ``--experts`` distinct experts per type (copies of 4 random ones, each in its own
memory) so that rotating 8-expert sets stream from DRAM rather than L3. The F32 row is the
practical ceiling of a core: a streaming float32 dot.

Each rate is the median over ``--reps`` calls, old and new calls alternating so both see the same
machine load. ``--clock cpu`` divides by the process CPU time instead of the wall time (for shared
machines; it then reports GB/s per CPU-second, summed over the threads).

    python3 experiments/bench_cpu_experts.py --threads 1,4,8,16
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402

import cpu_experts_before as old  # noqa: E402
from execute import cpu_experts as new  # noqa: E402
from execute import quant as Q  # noqa: E402
from execute.experts import ExpertTensor, LayerExperts, random_layer  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4", "F16", "BF16", "F32")
NEW_ONLY = ("MXFP4",)  # types the old kernels never read: their old rate is reported as nan


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def big_layer(qtype: int, experts: int, hidden: int, ffn: int, rng: np.random.Generator) -> LayerExperts:
    """``experts`` experts in ``qtype``: copies of 4 random ones (valid blocks, normal floats; MXFP4
    quantized from normal weights, as random_layer's fast path only sets f16 scales)."""
    base = random_layer(rng, 0, 4, hidden, ffn, qtype, exact=Q.QTYPES[qtype].name in NEW_ONLY)

    def grow(t: ExpertTensor) -> ExpertTensor:
        return ExpertTensor(np.tile(t.data, (experts // 4 + 1, 1))[:experts].copy(), t.qtype, t.rows, t.cols, t.name)

    return LayerExperts(0, grow(base.gate), grow(base.up), grow(base.down))


def rates(layer: LayerExperts, threads: int, reps: int, clock) -> tuple[float, float]:
    """(old, new) GB/s: median over ``reps`` calls of 8 experts x 1 token each (old nan for NEW_ONLY)."""
    numba.set_num_threads(threads)
    x = np.random.default_rng(1).standard_normal((8, layer.hidden)).astype(np.float32)
    if Q.QTYPES[layer.gate.qtype].name in NEW_ONLY:
        return float("nan"), rates_of((new,), layer, threads, reps, clock, x)[0]
    o, n = rates_of((old, new), layer, threads, reps, clock, x)
    return o, n


def rates_of(mods: tuple, layer: LayerExperts, threads: int, reps: int, clock, x: np.ndarray) -> list[float]:
    """GB/s of each kernel module in ``mods``, their calls alternating."""
    views = [(m.tensor_views(layer.gate), m.tensor_views(layer.up), m.tensor_views(layer.down)) for m in mods]
    for m, v in zip(mods, views):
        m.run_experts(layer, list(range(8)), x, threads, v)
    ts: list[list[float]] = [[] for _ in mods]
    sets = layer.num_experts // 8
    for r in range(reps):
        ids = list(range((r % sets) * 8, (r % sets) * 8 + 8))
        for k, (m, v) in enumerate(zip(mods, views)):
            t0 = clock()
            m.run_experts(layer, ids, x, threads, v)
            ts[k].append(clock() - t0)
    nbytes = 8 * layer.expert_bytes
    return [nbytes / float(np.median(t)) / 1e9 for t in ts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default=f"1,{os.cpu_count()}", help="comma-separated thread counts")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated quant types")
    p.add_argument("--experts", type=int, default=64, help="distinct experts per type (multiple of 8)")
    p.add_argument("--reps", type=int, default=15, help="calls per (type, threads, kernel)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
        types = [Q.QTYPE_BY_NAME[t] for t in args.types.split(",")]
    except (ValueError, KeyError) as exc:
        p.error(f"--threads/--types: {exc} (types: {', '.join(TYPES)})")
    if max(threads) > numba.config.NUMBA_NUM_THREADS or min(threads) < 1:
        p.error(f"--threads: expected 1..{numba.config.NUMBA_NUM_THREADS}")
    if args.experts < 8 or args.experts % 8:
        p.error("--experts: expected a positive multiple of 8")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    rows = []
    for qt in types:
        layer = big_layer(qt, args.experts, args.hidden, args.ffn, rng)
        for th in threads:
            o, n = rates(layer, th, args.reps, clock)
            rows.append((Q.QTYPES[qt].name, th, o, n))
            log(f"  {Q.QTYPES[qt].name} {th} threads: old {o:.2f} new {n:.2f} GB/s ({time.perf_counter() - t0:.0f} s)")
        del layer
    unit = "GB/s" if args.clock == "wall" else "GB/cpu-s"
    print(f"expert weights read per call ({unit}); hidden {args.hidden}, ffn {args.ffn}, 8 experts x 1 token, "
          f"median of {args.reps}; numba {numba.__version__}, layer {numba.threading_layer()}")
    print(f"{'type':6s}{'threads':>8s}{'old':>9s}{'new':>9s}{'new/old':>9s}{'new/F32':>9s}")
    f32 = {th: n for name, th, _, n in rows if name == "F32"}
    for name, th, o, n in rows:
        ceil = f"{n / f32[th]:9.2f}" if th in f32 else f"{'-':>9s}"
        print(f"{name:6s}{th:8d}{o:9.2f}{n:9.2f}{n / o:9.2f}{ceil}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
