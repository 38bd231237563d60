"""CPU expert pool rates: GB/s of expert weights read per call, per quant type and call shape, the
pool's empty-call round trip and the host's streaming ceiling, all measured in one run.

``new``: ``CpuExpertPool`` (execute/cpu_experts.py: int8 activations, vpdpbusd, a native thread
team), submit -> result, as the engine calls it. ``old``: the kernels before the rewrite
(experiments/cpu_experts_before.py: float32 activations, rows dotted block by block, two regions
on Numba's OpenMP pool with passive waiting, called directly on this thread). Shapes: Qwen3-30B-A3B experts (hidden 2048, ffn 768). Call shapes: 1, 2
and 8 experts x 1 token (decode) and 8 experts x 8 tokens (prefill: 64 pairs, each expert read
once). Each type's layer has ``--experts`` distinct experts (copies of 4 random ones, each in its
own memory) and calls rotate through them, so weights stream from DRAM rather than the L3.

The ceiling is a Numba float32 sum over ``--ceiling-mib`` with the same thread count. Per-core
rates (``--per-core``, default 1 and 2 threads) put old and new side by side for every type and
are printed in GB per CPU-second (process time), which stays meaningful on a shared machine.
Each figure is the median over ``--reps`` calls (old and new run the same calls, one after the other).

    python3 experiments/bench_cpu_experts.py --threads 15

The last line reads ``Q8_0 8 experts: <X> GB/s, <R> of the ceiling, empty call <U> us``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T_START = time.perf_counter()

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

import cpu_experts_before as old  # noqa: E402
from execute import cpu_experts as new  # noqa: E402
from execute import quant as Q  # noqa: E402
from execute.experts import ExpertTensor, LayerExperts, random_layer  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4", "BF16")
EXACT = ("MXFP4",)  # types built by quantizing normal weights (random_layer's fast path only sets f16 scales)
SHAPES = (("1x1", 1, 1), ("2x1", 2, 1), ("8x1", 8, 1), ("8x8", 8, 8))  # (name, experts, tokens each)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@njit(parallel=True, fastmath=True, cache=True)
def _stream_sum(a):
    s = np.float32(0.0)
    for i in prange(a.size):
        s += a[i]
    return s


def ceiling_gbps(threads: int, mib: int, reps: int) -> float:
    """Best of ``reps`` parallel float32 sums over ``mib`` MiB with ``threads`` threads (GB/s)."""
    numba.set_num_threads(threads)
    a = np.ones(mib * 2**20 // 4, np.float32)
    _stream_sum(a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _stream_sum(a)
        ts.append(time.perf_counter() - t0)
    return a.nbytes / min(ts) / 1e9


def l3_bytes() -> int:
    """The last-level cache's size from sysfs (0 when unknown)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * unit if text.rstrip("KMG").isdigit() else 0


def big_layer(qtype: int, experts: int, hidden: int, ffn: int, rng: np.random.Generator) -> LayerExperts:
    """``experts`` experts in ``qtype``: copies of 4 random ones (random_layer's fast blocks but for EXACT)."""
    base = random_layer(rng, 0, 4, hidden, ffn, qtype, exact=Q.QTYPES[qtype].name in EXACT)

    def grow(t: ExpertTensor) -> ExpertTensor:
        return ExpertTensor(np.tile(t.data, (experts // 4 + 1, 1))[:experts].copy(), t.qtype, t.rows, t.cols, t.name)

    return LayerExperts(0, grow(base.gate), grow(base.up), grow(base.down))


def calls(layer: LayerExperts, k: int, tokens: int, reps: int, rng: np.random.Generator) -> list[tuple]:
    """``reps`` + 1 calls of k distinct experts x ``tokens`` tokens, rotating through the layer's
    experts: (expert ids per pair, x)."""
    out = []
    for r in range(reps + 1):
        ids = [(r * k + j) % layer.num_experts for j in range(k)]
        pairs = [e for _ in range(tokens) for e in ids]
        out.append((pairs, rng.standard_normal((len(pairs), layer.hidden)).astype(np.float32)))
    return out


def rates(layer: LayerExperts, shape: tuple, threads: int, reps: int, clock,
          rng: np.random.Generator, spin_us: float = 100.0) -> tuple[float, float]:
    """(old, new) GB/s of weights read for one call shape: medians over the same ``reps`` calls,
    old ones first, then new ones (the new pool's team would spin during old calls; the first
    call of each is a warm-up); ``spin_us`` the pool's (0 when CPU time is the clock: a spinning
    wait would count as work)."""
    _, k, tokens = shape
    work = calls(layer, k, tokens, reps, rng)
    nbytes = k * layer.expert_bytes
    numba.set_num_threads(threads)
    ov = (old.tensor_views(layer.gate), old.tensor_views(layer.up), old.tensor_views(layer.down))
    to, tn = [], []
    for pairs, x in work:
        t0 = clock()
        old.run_experts(layer, pairs, x, threads, ov)
        to.append(clock() - t0)
    with new.CpuExpertPool(threads, timeout_s=120, spin_us=spin_us) as pool:  # its team spins between calls
        for pairs, x in work:
            t0 = clock()
            pool.submit(layer, pairs, x).result()
            tn.append(clock() - t0)
    return nbytes / float(np.median(to[1:])) / 1e9, nbytes / float(np.median(tn[1:])) / 1e9


def empty_call_us(threads: int, reps: int, rng: np.random.Generator) -> float:
    """Median submit -> result round trip of a call with no pairs (the team's hand-off alone)."""
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0, exact=False)
    x = np.zeros((0, 256), np.float32)
    ts = []
    with new.CpuExpertPool(threads, timeout_s=120) as pool:
        pool.submit(layer, [], x).result()
        for _ in range(reps):
            t0 = time.perf_counter()
            pool.submit(layer, [], x).result()
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


def first_call_s(rng: np.random.Generator) -> float:
    """Seconds from this script's start to the end of its first pool call (imports, Numba's cache
    or compilation, thread start)."""
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0, exact=False)
    with new.CpuExpertPool(1, timeout_s=600) as pool:
        pool.submit(layer, [0], np.ones((1, 256), np.float32)).result()
    return time.perf_counter() - T_START


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="pool threads for the main table (default: cores - 1)")
    p.add_argument("--per-core", default="1,2", help="comma-separated thread counts of the old-vs-new table ('' skips)")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated quant types")
    p.add_argument("--experts", type=int, default=0,
                   help="distinct experts per type (>= 8; default: 64, or more to span twice the L3)")
    p.add_argument("--reps", type=int, default=15, help="calls per figure")
    p.add_argument("--ceiling-mib", type=int, default=0,
                   help="array size of the streaming ceiling (default: 1024, or 4 x the L3)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--out", type=Path, help="also write the figures and arguments here (JSON)")
    args = p.parse_args(argv)
    try:
        types = [Q.QTYPE_BY_NAME[t] for t in args.types.split(",")]
        per_core = [int(t) for t in args.per_core.split(",") if t.strip()]
    except (ValueError, KeyError) as exc:
        p.error(f"--types/--per-core: {exc} (types: {', '.join(TYPES)})")
    limit = max(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS or any(not 1 <= t <= limit for t in per_core):
        p.error(f"--threads/--per-core: expected 1..{numba.config.NUMBA_NUM_THREADS}")
    if args.experts and args.experts < 8 or args.reps < 1 or args.ceiling_mib < 0:
        p.error("--experts: expected >= 8; --reps: expected >= 1; --ceiling-mib: expected >= 1")
    l3 = l3_bytes()
    ceiling_mib = args.ceiling_mib or max(1024, 4 * l3 // 2**20)
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: directory {args.out.parent} does not exist")
    rng = np.random.default_rng(0)
    first_s = first_call_s(rng)
    log(f"  first pool call {first_s:.1f} s after start")
    ceiling = ceiling_gbps(args.threads, ceiling_mib, 5)
    log(f"  ceiling {ceiling:.1f} GB/s ({args.threads} threads)")
    empty = empty_call_us(args.threads, 200, rng)
    log(f"  empty call {empty:.1f} us")
    main_rows, core_rows = [], []
    for qt in types:
        name = Q.QTYPES[qt].name
        per_expert = 2 * args.ffn * Q.row_bytes(qt, args.hidden) + args.hidden * Q.row_bytes(qt, args.ffn)
        experts = args.experts or max(64, -(-2 * l3 // per_expert // 8) * 8)
        layer = big_layer(qt, experts, args.hidden, args.ffn, rng)
        for shape in SHAPES:
            o, n = rates(layer, shape, args.threads, args.reps, time.perf_counter, rng)
            main_rows.append((name, shape[0], o, n))
            log(f"  {name} {shape[0]} {args.threads} threads: old {o:.2f} new {n:.2f} GB/s "
                f"({time.perf_counter() - T_START:.0f} s)")
        for th in per_core:
            o, n = rates(layer, SHAPES[2], th, max(3, args.reps // 3), time.process_time, rng, 0.0)
            core_rows.append((name, th, o, n))
        del layer
    print(f"expert weights read per call (GB/s, median of {args.reps}); hidden {args.hidden}, ffn {args.ffn}; "
          f"shape = experts x tokens each; {args.threads} threads; numba {numba.__version__}")
    print(f"{'type':6s}{'shape':>6s}{'old':>9s}{'new':>9s}{'new/old':>9s}{'of ceil':>9s}")
    for name, shape, o, n in main_rows:
        print(f"{name:6s}{shape:>6s}{o:9.2f}{n:9.2f}{n / o:9.2f}{n / ceiling:9.2f}")
    if core_rows:
        print("per core, 8 experts x 1 token (GB per CPU-second: process time, all threads)")
        print(f"{'type':6s}{'threads':>8s}{'old':>9s}{'new':>9s}{'new/old':>9s}")
        for name, th, o, n in core_rows:
            print(f"{name:6s}{th:8d}{o:9.2f}{n:9.2f}{n / o:9.2f}")
    print(f"streaming ceiling {ceiling:.1f} GB/s ({args.threads} threads, float32 sum of {ceiling_mib} MiB); "
          f"first pool call {first_s:.1f} s after start; {time.perf_counter() - T_START:.0f} s in all")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "ceiling_gbps": ceiling, "ceiling_mib": ceiling_mib, "l3_bytes": l3, "empty_call_us": empty, "first_call_s": first_s,
            "rates": [dict(zip(("type", "shape", "old_gbps", "new_gbps"), r)) for r in main_rows],
            "per_core": [dict(zip(("type", "threads", "old_gbps", "new_gbps"), r)) for r in core_rows]}, indent=1))
    q8 = [n for name, shape, _, n in main_rows if name == "Q8_0" and shape == "8x1"]
    if q8:
        print(f"Q8_0 8 experts: {q8[0]:.1f} GB/s, {q8[0] / ceiling:.2f} of the ceiling, empty call {empty:.1f} us")
    else:
        print(f"Q8_0 8 experts: not measured (--types), empty call {empty:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
