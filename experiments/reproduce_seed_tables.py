"""Predict the published decode rows in ``experiments/seed_tables.json`` with the simulator.

Machines: the ``rtx4060-laptop`` and ``l4-colab`` presets; models: the Qwen3.5-35B-A3B preset and
the Qwen3-Coder-Next geometry of the data file. The method (configurations, engines, fill lag,
which rows fit which parameter, the rate taken from a stated load time, the routing checks) is
``simulate.seeds``'s docstring and the report's Method section. The last line counts only the rows
no parameter was fitted on.

    python experiments/reproduce_seed_tables.py [--seeds 3] [--tokens-scale 1.0] [--data experiments/seed_tables.json] [--out docs/SEED_TABLES.md]
    python experiments/reproduce_seed_tables.py --fit-routing --seeds 5   # the routing grid against routing_stats, best first
    python experiments/reproduce_seed_tables.py --fixed mailbox_s=1.7e-05   # a parameter given, not fitted

The data file's ``routing`` (the synthetic routing's parameters) is the first line ``--fit-routing``
prints: chosen on the published routing statistics, none of them a table row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from simulate import seeds

DATA = Path(__file__).resolve().parent / "seed_tables.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="synthetic traces per row (mean reported)")
    ap.add_argument("--tokens-scale", type=float, default=1.0,
                    help="fraction of each row's published token count to simulate (tests use less)")
    ap.add_argument("--data", default=str(DATA), help="the published figures (JSON)")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    ap.add_argument("--fit-routing", action="store_true",
                    help="print the routing grid's RMS error against the data file's routing_stats (best first) and stop")
    ap.add_argument("--fixed", action="append", default=[], metavar="PARAM=VALUE",
                    help="take a fitted parameter as given on every machine (its fitting row is then predicted)")
    args = ap.parse_args(argv)
    fixed = {}
    for f in args.fixed:
        name, _, value = f.partition("=")
        try:
            fixed[name] = float(value)
        except ValueError:
            print(f"error: --fixed {f}: expected PARAM=VALUE with a number", file=sys.stderr)
            return 2
    if args.seeds < 1:
        print(f"error: --seeds {args.seeds}, expected >= 1", file=sys.stderr)
        return 2
    if not 0 < args.tokens_scale <= 1:
        print(f"error: --tokens-scale {args.tokens_scale}, expected in (0, 1]", file=sys.stderr)
        return 2
    if args.out and not Path(args.out).resolve().parent.is_dir():
        print(f"error: --out {args.out}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        data = seeds.fix_params(seeds.load_data(Path(args.data)), fixed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.fit_routing:
        if args.out:
            print("error: --fit-routing writes no report; drop --out", file=sys.stderr)
            return 2
        try:
            grid = seeds.fit_routing(data, args.seeds)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("rms | " + " | ".join(c["about"] for c in data["routing_stats"]) + " | parameters")
        print("published | " + " | ".join(f"{c['published']:.3f}" for c in data["routing_stats"]) + " |")
        for g in grid:
            print(f"{g['rms']:.4f} | " + " | ".join(f"{v:.3f}" for v in g["simulated"]) + f" | {json.dumps(g['params'])}")
        return 0
    hosts = seeds.derive_hosts(data, args.seeds, args.tokens_scale)
    results = seeds.predict_tables(data, hosts, args.seeds, args.tokens_scale)
    cmd = "python experiments/reproduce_seed_tables.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "") + (
        f" --tokens-scale {args.tokens_scale}" if args.tokens_scale != 1.0 else "") + "".join(
        f" --fixed {f}" for f in args.fixed) + " --out docs/SEED_TABLES.md"
    text = seeds.report(data, hosts, results, args.seeds, cmd, seeds.routing_checks(data, args.seeds),
                        seeds.bounds(data, hosts, args.seeds, args.tokens_scale, results))
    print(text, end="")
    if args.out:
        out = Path(args.out)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.resolve().parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
