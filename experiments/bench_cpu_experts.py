"""CPU expert pool rates: GB/s of expert weights read per call, per quant type and call shape, the
pool's empty-call round trip and the host's streaming ceiling, all measured in one run.

``new``: ``CpuExpertPool`` (execute/cpu_experts.py: int8 activations, a native thread team),
submit -> result, as the engine calls it, once per entry of ``--isa``: an instruction-set path of
its integer dot (default every path this host runs: vnni = vpdpbusd, avx2 = vpmaddubsw +
vpmaddwd, plain; MOELAB_CPU_ISA), optionally with a row prefetch mode (``vnni:rows``; 2k, rows,
off: MOELAB_CPU_PREFETCH) and the i-quants' grid gather (``vnni:2k:vgather``; blend, vgather:
MOELAB_CPU_GATHER); repeat entries to interleave an A/B. ``old`` (``--no-old`` skips it):
the kernels before the rewrite (execute/cpu_experts_baseline.py: float32 activations, rows dotted
block by block, Numba's OpenMP pool, called on this thread). Shapes: Qwen3-30B-A3B experts
(hidden 2048, ffn 768); calls of 1, 2 and 8 experts x 1 token (decode) and 8 experts x 8 tokens
(prefill: 64 pairs, each expert read once). Each type's layer has ``--experts`` distinct experts
(copies of 4 random ones, each in its own memory); calls rotate through them, and each kernel
(old, then each entry) takes the next ones, so weights stream from DRAM rather than the L3.

The ceiling: a Numba float32 sum over ``--ceiling-mib``, same threads. ``--per-core`` rates (default
1, 2 threads): GB per CPU-second (process time: meaningful on a shared machine). Medians of ``--reps``.

    python3 experiments/bench_cpu_experts.py --threads 15

The last lines read ``Q8_0 8 experts (<isa>): <X> GB/s, <R> of the ceiling, <F>x the old kernel, ...``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba  # noqa: E402
from numba import njit, prange  # noqa: E402

from execute import cpu_experts_baseline as old  # noqa: E402
from execute import cpu_iq, cpu_simd  # noqa: E402
from execute.cpu_pool import CpuExpertPool  # noqa: E402
from execute import quant as Q  # noqa: E402
from execute.experts import ExpertTensor, LayerExperts, random_layer  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4", "BF16")  # the default; any of cpu_experts' types may be asked for
PREFETCH = os.environ.get("MOELAB_CPU_PREFETCH", cpu_simd.PREFETCH_MODES[0])  # of an --isa entry without one
GATHER = os.environ.get("MOELAB_CPU_GATHER", cpu_iq.GATHER_MODES[0])
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
    return a.nbytes / min(_timed(lambda: _stream_sum(a)) for _ in range(reps)) / 1e9


def _timed(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def l3_bytes() -> int:
    """The last-level cache's size from sysfs (0 when unknown)."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    num = text.rstrip("KMG")
    return int(num) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1) if num.isdigit() else 0


def big_layer(qtype: int, experts: int, hidden: int, ffn: int, rng: np.random.Generator) -> LayerExperts:
    """``experts`` experts in ``qtype``: copies of 4 random ones (random blocks with valid scales,
    but for EXACT: quantized normal weights)."""
    if Q.LAYOUTS[qtype].name in EXACT:
        base = random_layer(rng, 0, 4, hidden, ffn, qtype, exact=True)
    else:
        def t(rows: int, cols: int, name: str) -> ExpertTensor:
            data = Q.random_blocks(rng, qtype, 4 * rows, cols, 1 / np.sqrt(cols)).reshape(4, -1)
            return ExpertTensor(data, qtype, rows, cols, name)
        base = LayerExperts(0, t(ffn, hidden, "gate"), t(ffn, hidden, "up"), t(hidden, ffn, "down"))

    def grow(t: ExpertTensor) -> ExpertTensor:
        return ExpertTensor(np.tile(t.data, (experts // 4 + 1, 1))[:experts].copy(), t.qtype, t.rows, t.cols, t.name)

    return LayerExperts(0, grow(base.gate), grow(base.up), grow(base.down))


def calls(layer: LayerExperts, k: int, tokens: int, reps: int, rng: np.random.Generator, start: int = 0) -> list[tuple]:
    """``reps`` + 1 calls of k distinct experts x ``tokens`` tokens, rotating through the layer's
    experts from call ``start`` on: (expert ids per pair, x)."""
    out = []
    for r in range(start, start + reps + 1):
        ids = [(r * k + j) % layer.num_experts for j in range(k)]
        pairs = [e for _ in range(tokens) for e in ids]
        out.append((pairs, rng.standard_normal((len(pairs), layer.hidden)).astype(np.float32)))
    return out


def rates(layer: LayerExperts, shape: tuple, threads: int, reps: int, clock, rng: np.random.Generator,
          isas: list[str], spin_us: float = 100.0, with_old: bool = True) -> tuple[float, list[float]]:
    """(old, [new per entry of ``isas``]) GB/s of weights read for one call shape, medians over
    ``reps`` calls each: old first (nan if skipped or not read by them; the pool's team would spin
    during them), then each entry; ``spin_us`` the pool's (0 when CPU time is the clock)."""
    _, k, tokens = shape
    nbytes = k * layer.expert_bytes
    numba.set_num_threads(threads)
    o = float("nan")
    if with_old and all(t.qtype in Q.QTYPES for t in (layer.gate, layer.up, layer.down)):
        ov, work = tuple(old.tensor_views(t) for t in (layer.gate, layer.up, layer.down)), calls(layer, k, tokens, reps, rng)
        to = [_timed(lambda: old.run_experts(layer, pairs, x, threads, ov), clock) for pairs, x in work]
        o = nbytes / float(np.median(to[1:])) / 1e9
    out = []
    for v, entry in enumerate(isas, 1):
        isa, pf, gm = (entry.split(":") + ["", ""])[:3]
        os.environ["MOELAB_CPU_ISA"] = isa  # all three read when the pool's scratch is made
        os.environ["MOELAB_CPU_PREFETCH"] = pf or PREFETCH
        os.environ["MOELAB_CPU_GATHER"] = gm or GATHER
        work = calls(layer, k, tokens, reps, rng, v * (reps + 1))
        with CpuExpertPool(threads, timeout_s=120, spin_us=spin_us) as pool:  # its team spins between calls
            tn = [_timed(lambda: pool.submit(layer, pairs, x).result(), clock) for pairs, x in work]
        out.append(nbytes / float(np.median(tn[1:])) / 1e9)
    return o, out


def empty_call_us(threads: int, reps: int, rng: np.random.Generator) -> float:
    """Median submit -> result round trip of a call with no pairs (the team's hand-off alone)."""
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0, exact=False)
    x = np.zeros((0, 256), np.float32)
    with CpuExpertPool(threads, timeout_s=120) as pool:
        pool.submit(layer, [], x).result()
        ts = [_timed(lambda: pool.submit(layer, [], x).result()) for _ in range(reps)]
    return float(np.median(ts)) * 1e6


def first_call_s(rng: np.random.Generator) -> float:
    """Seconds from this script's start to the end of its first pool call (imports, Numba's cache
    or compilation, thread start)."""
    layer = random_layer(rng, 0, 2, 256, 256, Q.Q8_0, exact=False)
    with CpuExpertPool(1, timeout_s=600) as pool:
        pool.submit(layer, [0], np.ones((1, 256), np.float32)).result()
    return time.perf_counter() - T_START


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="pool threads for the main table (default: cores - 1)")
    p.add_argument("--per-core", default="1,2", help="comma-separated thread counts of the old-vs-new table ('' skips)")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated quant types ('all': every CPU type)")
    p.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated call shapes")
    p.add_argument("--isa", default=",".join(cpu_simd.host_isas()), help="comma-separated integer-dot paths, each "
                   f"ISA[:PREFETCH[:GATHER]] (default: this host's, {','.join(cpu_simd.host_isas())}; the first is the last line's)")
    p.add_argument("--old", action=argparse.BooleanOptionalAction, default=True, help="also time the old kernels")
    p.add_argument("--experts", type=int, default=0, help="distinct experts per type (>= 8; default: 64, or twice the L3)")
    p.add_argument("--reps", type=int, default=15, help="calls per figure")
    p.add_argument("--ceiling-mib", type=int, default=0, help="the ceiling's array (default: 1024, or 4 x the L3)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--out", type=Path, help="also write the figures and arguments here (JSON)")
    args = p.parse_args(argv)
    try:
        types = (sorted(Q.CPU_QTYPES) if args.types == "all" else [Q.QTYPE_BY_NAME[t] for t in args.types.split(",")])
        shapes = [next(s for s in SHAPES if s[0] == name) for name in args.shapes.split(",")]
        per_core = [int(t) for t in args.per_core.split(",") if t.strip()]
        isas = args.isa.split(",")
        for isa, pf, gm in ((i.split(":") + ["", ""])[:3] for i in isas):
            cpu_simd.choose_isa(isa, "--isa"), cpu_simd.choose_prefetch(pf or PREFETCH, "--isa"), cpu_iq.choose_gather(gm or GATHER, "--isa")
        for qt in types:
            Q.quant_type(qt, "--types", Q.CPU_QTYPES)
    except (ValueError, KeyError, StopIteration) as exc:
        p.error(f"--types/--shapes/--per-core/--isa: {exc!r}; shapes are {', '.join(s[0] for s in SHAPES)}")
    limit = max(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS or any(not 1 <= t <= limit for t in per_core):
        p.error(f"--threads/--per-core: expected 1..{numba.config.NUMBA_NUM_THREADS}")
    if args.experts and args.experts < 8 or args.reps < 1 or args.ceiling_mib < 0:
        p.error("--experts: expected >= 8; --reps: expected >= 1; --ceiling-mib: expected >= 1")
    l3 = l3_bytes()
    ceiling_mib = args.ceiling_mib or max(1024, 4 * l3 // 2**20)
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: directory {args.out.parent} does not exist")
    rng, load0 = np.random.default_rng(0), os.getloadavg()[0]  # the host's load at the start and the end: printed, kept
    first_s = first_call_s(rng)
    ceiling, empty = ceiling_gbps(args.threads, ceiling_mib, 5), empty_call_us(args.threads, 200, rng)
    log(f"  first pool call {first_s:.1f} s after start; ceiling {ceiling:.1f} GB/s ({args.threads} threads); empty call {empty:.1f} us")
    main_rows, core_rows = [], []
    for qt in types:
        name = Q.LAYOUTS[qt].name
        per_expert = (2 * args.ffn * Q.row_bytes(qt, args.hidden, "--types", Q.CPU_QTYPES)
                      + args.hidden * Q.row_bytes(qt, args.ffn, "--types", Q.CPU_QTYPES))
        experts = args.experts or max(64, -(-2 * l3 // per_expert // 8) * 8)
        layer = big_layer(qt, experts, args.hidden, args.ffn, rng)
        for shape in shapes:
            o, ns = rates(layer, shape, args.threads, args.reps, time.perf_counter, rng, isas, with_old=args.old)
            main_rows += [(name, shape[0], isa, o, n) for isa, n in zip(isas, ns)]
            log(f"  {name} {shape[0]} {args.threads} threads: old {o:.2f} new " + " ".join(
                f"{isa} {n:.2f}" for isa, n in zip(isas, ns)) + f" GB/s ({time.perf_counter() - T_START:.0f} s)")
        for th in per_core:
            o, ns = rates(layer, SHAPES[2], th, max(3, args.reps // 3), time.process_time, rng, isas, 0.0, args.old)
            core_rows += [(name, th, isa, o, n) for isa, n in zip(isas, ns)]
            log(f"  {name} {th} threads: " + " ".join(f"{isa} {n:.2f}" for isa, n in zip(isas, ns)) + " GB per CPU-s")
        del layer
    print(f"expert weights read per call (GB/s, median of {args.reps}); hidden {args.hidden}, ffn {args.ffn}; "
          f"shape = experts x tokens each; {args.threads} threads; numba {numba.__version__}")
    print(f"{'type':7s}{'shape':>6s}{'isa':>17s}{'old':>9s}{'new':>9s}{'new/old':>9s}{'of ceil':>9s}")
    for name, shape, isa, o, n in main_rows:
        print(f"{name:7s}{shape:>6s}{isa:>17s}{o:9.2f}{n:9.2f}{n / o:9.2f}{n / ceiling:9.2f}")
    if core_rows:
        print("per core, 8 experts x 1 token (GB per CPU-second: process time, all threads)")
        print(f"{'type':7s}{'threads':>8s}{'isa':>17s}{'old':>9s}{'new':>9s}{'new/old':>9s}")
        for name, th, isa, o, n in core_rows:
            print(f"{name:7s}{th:8d}{isa:>17s}{o:9.2f}{n:9.2f}{n / o:9.2f}")
    print(f"streaming ceiling {ceiling:.1f} GB/s ({args.threads} threads, float32 sum of {ceiling_mib} MiB); first pool call {first_s:.1f} s "
          f"after start; {time.perf_counter() - T_START:.0f} s in all; load average {load0:.2f} -> {(load1 := os.getloadavg()[0]):.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "load_average": [load0, load1],
            "ceiling_gbps": ceiling, "ceiling_mib": ceiling_mib, "l3_bytes": l3, "empty_call_us": empty, "first_call_s": first_s,
            "rates": [dict(zip(("type", "shape", "isa", "old_gbps", "new_gbps"), r)) for r in main_rows],
            "per_core": [dict(zip(("type", "threads", "isa", "old_gbps", "new_gbps"), r)) for r in core_rows]}, indent=1))
    q8 = [(isa, o, n) for name, shape, isa, o, n in main_rows if name == "Q8_0" and shape == "8x1"]
    for isa, o, n in q8:
        print(f"Q8_0 8 experts ({isa}): {n:.1f} GB/s, {n / ceiling:.2f} of the ceiling, {n / o:.2f}x the old "
              f"kernel, empty call {empty:.1f} us")
    if not q8:
        print(f"Q8_0 8 experts: not measured (--types), empty call {empty:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
