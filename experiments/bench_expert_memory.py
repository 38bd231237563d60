"""Does the CPU pool run slower on a memory-mapped model file than on the calibration's buffers?

``moelab calibrate`` times the pool on experts in anonymous memory; ``moelab run`` reads them from
a GGUF file's read-only memory map. This builds ``--layers`` x ``--experts`` random Q8_0 experts
(the calibration's shape), writes them to a file under ``--work`` and times pool calls of
``--n`` cold experts on both kinds, interleaved (``execute.calibrate_memory``). Prints the medians,
the rate and the ratio mapped / anon, and how much of each kind sits on huge pages; writes
``OUT/bench_expert_memory.json`` with its config.

    python experiments/bench_expert_memory.py --threads 15 --out $OUT/mem      # ~3 GB file, about 30 s
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--n", type=int, default=8, help="experts per pool call (default 8: a cpu policy's decode call)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default=None, help="folder for the file (default: a temporary one)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_expert_memory"), help="output folder (created)")
    args = ap.parse_args(argv)
    for flag in ("threads", "layers", "experts", "n", "rounds", "reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)}: expected >= 1")
    if args.n > args.experts:
        ap.error(f"--n {args.n}: expected <= --experts {args.experts}")
    if args.hidden % 32 or args.ffn % 32:
        ap.error("--hidden and --ffn: expected multiples of 32 (Q8_0 blocks)")
    import numba

    if args.threads > numba.config.NUMBA_NUM_THREADS:
        ap.error(f"--threads {args.threads}: expected <= {numba.config.NUMBA_NUM_THREADS} (this machine's CPU pool)")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"bench_expert_memory: --out {out}: cannot create the folder ({e.strerror})", file=sys.stderr)
        return 2
    import numpy as np

    from execute.calibrate_measure import build_layers
    from execute.calibrate_memory import measure_pool_memory

    layers = build_layers(np.random.default_rng(0), args.layers, args.experts, args.hidden, args.ffn,
                          distinct=args.layers)
    with tempfile.TemporaryDirectory(dir=args.work, prefix="moelab-mem-") as tmp:
        res = measure_pool_memory(layers, args.threads, Path(tmp) / "experts.bin", n=args.n, rounds=args.rounds,
                                  reps=args.reps)
    gb = res["expert_bytes"] * args.n / 1e9
    for k in ("anon", "mapped"):
        m = res[k]["median"]
        pg = res["pages"][k]  # after the calls: every page touched
        print(f"{k:<7} {args.n} experts per call: {m * 1e6:8.1f} us  ({gb / m:6.1f} GB/s)  huge pages "
              f"{pg.get('AnonHugePages_after', 0) + pg.get('FilePmdMapped_after', 0)} of {pg.get('Rss_after', 0)} "
              f"KiB resident")
    print(f"mapped / anon: {res['ratio']:.3f}")
    with open(out / "bench_expert_memory.json", "w") as fh:
        json.dump({"config": vars(args), "result": res}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
