"""Does the simulator predict the executor? Same trace, same model geometry, config by config.

For each configuration (default: ``cpu``; ``lru``, ``static``, ``hybrid`` at about 10, 25 and 50%
of each layer's experts cached; ``hybrid`` at miss fractions 0, 128 and 256 / 256 at 25%; with
``--budgets`` the peer benchmark's: ``gpu``, ``cpu``, and ``lru`` and ``hybrid`` at each budget in
MiB), this runs the executor in trace replay (a Qwen3-30B-A3B-shaped model cut to ``--layers``
layers, random Q8_0 experts in pinned host RAM, ``execute.fidelity``) and the simulator on the
same tokens, policy and cache with the hardware file (``simulate.fidelity``), every config
``--repeats`` times interleaved; prints measured (median, spread) vs predicted tokens/s, p50/p99,
bytes and hits, the errors, Spearman and the targets. Writes ``OUT/raw.json`` (after every run),
``OUT/sim_vs_real.csv``, ``.json``, ``.png`` (and with ``--decompose`` ``decompose.csv``,
``between.csv``). ``--from DIR`` redoes the analysis from ``DIR/raw.json`` without a GPU.
``--peer result.json`` (no GPU) prints the peer benchmark's moelab rows, predicted vs measured.

    python experiments/sim_vs_real.py --hardware docs/fidelity/h200-calibrated.json --layers 48 --budgets 2048,4096,12288 --out $OUT/svr
    python experiments/sim_vs_real.py --hardware docs/fidelity/h200-calibrated.json --peer docs/perf/peer_h200/budget-*/result.json
"""
from __future__ import annotations

import argparse
import os
import sys


def _budgets(text: str) -> list[float]:
    try:
        v = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        v = []
    if not v or any(x <= 0 for x in v):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MiB > 0, comma-separated (e.g. 2048,4096,12288)")
    return v


def parser() -> argparse.ArgumentParser:
    from execute.calibrate import add_shape_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", required=True, help="hardware JSON from moelab calibrate")
    ap.add_argument("--from", dest="from_dir", default=None, help="reuse DIR/raw.json's measurements (no GPU)")
    ap.add_argument("--peer", nargs="+", default=None,
                    help="peer benchmark result.json file(s): predict their moelab rows (no GPU)")
    ap.add_argument("--out", default=None,
                    help="output folder (created; default $OUT, else sim_vs_real; with --peer: none unless given)")
    ap.add_argument("--graph-cpu-block-us", type=float, default=None, metavar="US",
                    help="with --peer: a CPU graph's block time for the +cpugraph rows, measured (bench_token_graph's "
                         "cpugraph mode at no miss, docs/perf/graph_cpu_h200: 112-117 us); default: the file's "
                         "resident-only graph_block_s")
    ap.add_argument("--graph-cpu-pair-us", type=float, default=0.0, metavar="US",
                    help="with --peer: a CPU graph's block grows by US a CPU pair (measured: 51-61 us, "
                         "docs/perf/graph_cpu_h200); default 0, the pool's call overlapping the block")
    ap.add_argument("--upload-factor", type=float, default=1.0, metavar="F",
                    help="with --peer: the runs' host -> device copies take F times the file's (moelab run copies out "
                         "of the model file's map; a ratio tuned on other sessions' rows; default 1)")
    ap.add_argument("--layers", type=int, default=16)
    add_shape_args(ap)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--repeats", type=int, default=3, help="runs of every config, interleaved across configs")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="unrecorded rounds of every config before the measured ones (default 1)")
    ap.add_argument("--host-calibration", choices=("session", "file"), default="session",
                    help="session (default): host-lane and CPU pool costs from moelab calibrate's replay workload "
                         "run in this process before each round; file: as --hardware has them")
    ap.add_argument("--calibration-round", type=int, default=None, metavar="R",
                    help="session calibration from round R's replays only, checked on the other rounds' runs "
                         "(out of sample in time; with the session calibration)")
    ap.add_argument("--same-round", action="store_true",
                    help="with --calibration-round R: check round R's own runs (the host as it was then)")
    ap.add_argument("--per-round", action="store_true",
                    help="every round's runs against that round's own session calibration: per config each round's "
                         "error and their median (no GPU with --from)")
    ap.add_argument("--budgets", type=_budgets, default=None,
                    help="expert budgets in MiB (the peer benchmark's: 2048,4096,12288): runs gpu, cpu, and lru "
                         "and hybrid at each")
    ap.add_argument("--configs", default=None, help="comma-separated labels to run (default: all)")
    ap.add_argument("--no-lane-fit", action="store_true",
                    help="keep the session calibration's read-back and CPU-layer hand-off as the replay logged them "
                         "(default: solved on the session's unlogged calibration runs, simulate.fidelity.fit_lane)")
    ap.add_argument("--cold-pool", action="store_true",
                    help="time each run from its engine's first pool calls (default: one call per layer first, "
                         "as moelab run's prompt calls the pool before decoding)")
    ap.add_argument("--moves", action="store_true",
                    help="run the moves probe each round (execute.calibrate_moves: an upload, streams, a swap or a fill "
                         "per layer against all hits, the same items simulated; its stream fields enter the session file)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decompose", action="store_true",
                    help="also fit per-token times on CPU layers, CPU experts and copies (OUT/decompose.csv) and "
                         "split the host time per layer step in and outside run_layer (OUT/between.csv)")
    return ap


def main(argv=None) -> int:
    from moelab import sim_vs_real as svr

    ap = parser()
    args = ap.parse_args(argv)
    if args.graph_cpu_block_us is not None and not args.graph_cpu_block_us > 0:
        ap.error(f"--graph-cpu-block-us {args.graph_cpu_block_us:g}: expected > 0 microseconds")
    if not args.graph_cpu_pair_us >= 0:
        ap.error(f"--graph-cpu-pair-us {args.graph_cpu_pair_us:g}: expected >= 0 microseconds")
    if not 0 < args.upload_factor <= 4:
        ap.error(f"--upload-factor {args.upload_factor:g}: expected a ratio in (0, 4]")
    if args.peer:
        block = None if args.graph_cpu_block_us is None else args.graph_cpu_block_us * 1e-6
        command = "python3 experiments/sim_vs_real.py " + " ".join(argv if argv is not None else sys.argv[1:])
        return svr.predict_peer_rows(args.peer, args.hardware, graph_cpu_block_s=block, out=args.out, command=command,
                                     upload_factor=args.upload_factor, graph_cpu_pair_s=args.graph_cpu_pair_us * 1e-6)
    if args.graph_cpu_block_us is not None or args.upload_factor != 1.0 or args.graph_cpu_pair_us:
        ap.error("--graph-cpu-block-us, --graph-cpu-pair-us and --upload-factor: only with --peer")
    if args.out is None:
        args.out = os.environ.get("OUT", "sim_vs_real")
    if args.same_round and args.calibration_round is None:
        ap.error("--same-round needs --calibration-round R")
    if args.per_round and (args.calibration_round is not None or args.host_calibration != "session"):
        ap.error("--per-round takes each round's own session calibration (drop --calibration-round, --host-calibration file)")
    if args.calibration_round is not None and args.host_calibration != "session":
        ap.error("--calibration-round needs the session calibration (drop --host-calibration file)")
    for flag, v, low in (("--repeats", args.repeats, 1), ("--warmup-rounds", args.warmup_rounds, 0),
                         ("--layers", args.layers, 1), ("--tokens", args.tokens, 1)):
        if v < low:
            ap.error(f"{flag} {v}: expected >= {low}")
    try:
        runs = svr.runs_of(vars(args))
    except ValueError as e:
        ap.error(str(e))
    if any(c["policy"] in ("lru", "hybrid") and c["slots"] < args.top_k for c in runs):
        ap.error(f"--budgets {args.budgets}: a budget gives fewer than top-k {args.top_k} slots per layer")
    return svr.run(args)


if __name__ == "__main__":
    sys.exit(main())
