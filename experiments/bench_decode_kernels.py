"""Each one-token decode kernel of one block timed alone, and the block's whole graph, on random
weights of a model's shapes (``execute.kernel_timing``), for each kernel variant side by side
(``MOELAB_DECODE_KERNELS``: v1, v2, v3 the default, v4): us per launch, GB/s of the bytes it must read
against a device copy measured in the same run, and the time lost against that ceiling.

Defaults: the synthetic qwen3-30b-a3b block of the H200 peer runs (hidden 2048, 32 q / 4 kv heads
x 128, 128 experts top-8, ffn 768, F16 dense, F32 router, Q8_0 experts) at 256 keys, 8 blocks of
weights cycled so that a launch does not find its weights in L2. Writes
``--out``/bench_decode_kernels.json (config and result) and prints the tables. One GPU, ~30 s.

    python experiments/bench_decode_kernels.py --keys 256 --variants v1,v2,v3,v4 --out $OUT/decode_kernels
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_TYPES = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=256, help="keys each attention reads (context length)")
    ap.add_argument("--blocks", type=int, default=8, help="blocks of distinct weights cycled (defeats L2)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--dense-quant", default="F16", help="F32, F16, BF16 or Q8_0 (qkv and output rows)")
    ap.add_argument("--variants", default="v1,v2,v3,v4", help="comma list of v1..v4 (the first is the base)")
    ap.add_argument("--repeat", type=int, default=4, help="passes over the blocks in one graph")
    ap.add_argument("--reps", type=int, default=10, help="graph replays per trial")
    ap.add_argument("--trials", type=int, default=5, help="trials (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/bench_decode_kernels"))
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    if any(v not in ("v1", "v2", "v3", "v4") for v in variants) or len(set(variants)) != len(variants):
        ap.error(f"--variants: {args.variants!r}, expected a comma list of distinct v1, v2, v3, v4")
    if args.dense_quant.upper() not in _TYPES:
        ap.error(f"--dense-quant: {args.dense_quant!r}, expected F32, F16, BF16 or Q8_0")
    for f in ("repeat", "reps", "trials"):
        if getattr(args, f) < 1:
            ap.error(f"--{f}: expected >= 1")
    from execute.kernel_timing import BlockShape, summarize, time_block

    try:
        shape = BlockShape(hidden=args.hidden, experts=args.experts, top_k=args.top_k, ffn=args.ffn, keys=args.keys,
                           blocks=args.blocks, dense_qtype=_TYPES[args.dense_quant.upper()])
    except ValueError as e:
        ap.error(str(e))
    result = time_block(shape, variants, args.repeat, args.reps, args.trials, args.seed)
    print(summarize(result), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_decode_kernels.json").write_text(json.dumps({"config": vars(args), "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
