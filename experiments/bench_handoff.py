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

``--submit`` (no GPU) times the host's ``CpuExpertPool.submit`` of a gated call instead, per wake
setting side by side (``execute.cpu_pool.bench_submit``: the caller opens the gate), with the team
hot (``--gap-us`` of host work between calls, shorter than the pool's spin) and asleep (a gap
longer than ``--spin-us``):

    python experiments/bench_handoff.py --submit [--threads 15] [--gap-us 50,3000] [--spin-us 2000]
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
    ap.add_argument("--out", type=Path, default=None, help="folder for handoff.json (submit.json with --submit)")
    ap.add_argument("--submit", action="store_true", help="time the pool's submit per wake setting (no GPU)")
    ap.add_argument("--gap-us", default="50,3000", help="with --submit: host work between calls (comma list)")
    ap.add_argument("--spin-us", type=float, default=2000.0, help="with --submit: the pool's spin before it sleeps")
    args = ap.parse_args()
    if args.submit:
        return submit(ap, args)
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


def submit(ap, args) -> int:
    try:
        gaps = [float(g) for g in args.gap_us.split(",")]
    except ValueError:
        ap.error(f"--gap-us: expected microseconds separated by commas, got {args.gap_us!r}")
    if any(g < 0 for g in gaps) or not 0 <= args.spin_us <= 1e6 or args.calls < 16:
        ap.error("--gap-us: >= 0; --spin-us: 0..1e6; --calls: >= 16 with --submit")
    from execute.cpu_pool import bench_submit

    rows, summary = {}, []
    print(f"pool submit of a gated call, {args.rows} rows, {args.threads} threads, spin {args.spin_us:g} us")
    print(f"{'gap us':>8} {'wake':<6}{'median us':>10}{'p90 us':>10}{'gap ratio':>10}")
    for gap in gaps:
        r = bench_submit(args.threads, args.rows, args.hidden, args.ffn, args.calls, gap, args.spin_us)
        rows[str(gap)] = r
        for wake, v in r.items():
            s = np.array(v["submit_s"][len(v["submit_s"]) // 8:]) * 1e6  # the first round: settling
            g = np.median(v["gap_s"]) / (gap * 1e-6) if gap else 1.0
            summary.append({"gap_us": gap, "wake": wake, "median_us": float(np.median(s)),
                            "p90_us": float(np.percentile(s, 90)), "gap_ratio": float(g)})
            print(f"{gap:8g} {wake:<6}{np.median(s):10.1f}{np.percentile(s, 90):10.1f}{g:10.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "submit.json").write_text(json.dumps({"config": vars(args) | {"out": str(args.out)},
                                                          "summary": summary, "raw": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
