"""Both edges of the GPU <-> CPU pool hand-off (execute.handoff), per call, on this machine.

Each call is posted to the pool gated on its input, the GPU runs ``--busy-us`` of work (the
team is then waiting at its gate), ``handoff_put`` writes the input rows and the gate into
mapped memory, and ``handoff_get`` waits for the call's done word and reads its rows. Edges:

- in: the gate written (GPU clock) -> the first CPU worker through it (host clock);
- out: the last CPU output written (host clock) -> the GPU's waiting kernel sees the call done;
- started: the GPU's waiting kernel started -> the last CPU output (positive: the kernel was
  waiting for the pool, as it should; negative: the GPU came late).

``--ahead N`` keeps up to N calls in flight (the host does not wait for each), as a decoding
engine does; 0 synchronizes after every call.

The two clocks are paired by a ping-pong through mapped memory (the shortest round trip of 64,
printed; an edge is off by at most half of it, in opposite directions for in and out, so their
sum is exact). Prints medians and 90th percentiles in microseconds and writes JSON beside.

    python experiments/bench_handoff.py [--threads 15] [--rows 8] [--calls 400] [--busy-us 200] [--ahead 0] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=max((os.cpu_count() or 2) - 1, 1))
    ap.add_argument("--rows", type=int, default=8, help="CPU pairs per call (one token's CPU experts)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--busy-us", type=float, default=200.0, help="GPU work before each put")
    ap.add_argument("--ahead", type=int, default=0, help="calls in flight before the host waits (0: none)")
    ap.add_argument("--out", type=Path, default=None, help="folder for handoff.json")
    args = ap.parse_args()
    for name in ("threads", "rows", "hidden", "ffn", "calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1")
    if args.hidden % 32 or args.ffn % 32 or args.busy_us < 0 or args.ahead < 0:
        ap.error("--hidden and --ffn: multiples of 32; --busy-us and --ahead: >= 0")
    from execute.handoff import bench_edges

    r = bench_edges(args.threads, args.rows, args.hidden, args.ffn, args.calls, args.busy_us, ahead=args.ahead)
    skip = min(20, len(r["in_s"]) // 4)  # first calls: caches and clocks settling
    e_in, e_out = np.array(r["in_s"][skip:]) * 1e6, np.array(r["out_s"][skip:]) * 1e6
    e_st = -np.array(r["wait_started_s"][skip:] or [np.nan]) * 1e6
    summary = {"calls": len(e_in), "round_trip_us": r["round_trip_s"] * 1e6, "rows_equal": r["rows_equal"],
               "in_median_us": float(np.median(e_in)), "in_p90_us": float(np.percentile(e_in, 90)),
               "out_median_us": float(np.median(e_out)), "out_p90_us": float(np.percentile(e_out, 90)),
               "sum_median_us": float(np.median(e_in + e_out)),
               "started_median_us": float(np.median(e_st)), "started_p90_us": float(np.percentile(e_st, 90))}
    print(f"hand-off edges, {summary['calls']} calls of {args.rows} rows, {args.threads} threads, "
          f"GPU busy {args.busy_us:g} us before each put, {args.ahead} ahead; clock pairing round trip {summary['round_trip_us']:.1f} us")
    print(f"{'edge':<8}{'median us':>10}{'p90 us':>10}")
    print(f"{'in':<8}{summary['in_median_us']:10.1f}{summary['in_p90_us']:10.1f}")
    print(f"{'out':<8}{summary['out_median_us']:10.1f}{summary['out_p90_us']:10.1f}")
    print(f"{'started':<8}{summary['started_median_us']:10.1f}{summary['started_p90_us']:10.1f}")
    print(f"{'in+out':<8}{summary['sum_median_us']:10.1f}    GPU rows == CPU rows: {r['rows_equal']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "handoff.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                           "summary": summary, "raw": r}, indent=1))
    return 0 if r["rows_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
