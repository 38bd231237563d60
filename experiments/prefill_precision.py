"""Stage by stage, a prefill chunk's GPU arithmetic against float64 (``execute.prefill_precision``):
per block, each stage's relative error and its rounding bound, isolated (every stage fed the
reference's input) and chained (the block's stages one after another), plus a few tokens through
the one-token kernels. Needs a GPU.

Writes ``result.json`` (records + config), ``config.json`` and ``README.md`` (the table) into ``--out``.

    python experiments/prefill_precision.py --out $OUT/precision --model M.gguf [--tokens 256] [--blocks 0,1]
    python experiments/prefill_precision.py --out $OUT/precision --synth 4   # a 4-block qwen3-30b-a3b Q8_0 file made first
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="GGUF file (GQA, NeoX RoPE, softmax-routed SiLU experts)")
    src.add_argument("--synth", type=int, metavar="BLOCKS", help="make a qwen3-30b-a3b Q8_0 file of BLOCKS blocks first")
    p.add_argument("--tokens", type=int, default=256, help="chunk length (default 256)")
    p.add_argument("--blocks", default=None, help="comma-separated blocks to compare (default: all)")
    p.add_argument("--seed", type=int, default=0, help="the random token ids' seed")
    p.add_argument("--time", action="store_true", help="also time block 0's f16 products and the head, K-slices 256 and 0")
    a = p.parse_args(argv)
    if a.tokens < 2:
        p.error(f"--tokens {a.tokens}: expected >= 2")
    if a.synth is not None and a.synth < 1:
        p.error(f"--synth {a.synth}: expected >= 1 blocks")
    try:
        a.blocks = None if a.blocks is None else {int(b) for b in a.blocks.split(",")}
    except ValueError:
        p.error(f"--blocks {a.blocks!r}: expected comma-separated block numbers")
    return a


def _timings(rows) -> str:
    if not rows:
        return ""
    lines = ["", "f16 products of a chunk (CUDA events, median ms; split_k 0: one product over all of K):", "",
             "| matrix | rows x cols | tokens | split_k | ms |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['matrix']} | {r['rows']} x {r['cols']} | {r['tokens']} | {r['split_k']} | {r['ms']:.4f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = _args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from execute.gguf_model import load_model
    from execute.prefill_precision import compare, table

    t0 = time.perf_counter()
    model = a.model
    if a.synth is not None:
        import tempfile

        from execute.synth import config_from_preset, synth_model

        model = Path(tempfile.mkdtemp()) / f"qwen3_{a.synth}.gguf"
        synth_model(model, config_from_preset("qwen3-30b-a3b", num_layers=a.synth, vocab=32000, quant="Q8_0"))
    made_s = time.perf_counter() - t0
    config = {"command": "python experiments/prefill_precision.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": str(model), "tokens": a.tokens, "blocks": sorted(a.blocks) if a.blocks else None, "seed": a.seed}
    (a.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rows: list[dict] = []

    def progress(line: str) -> None:  # the records so far, in case the run is cut short
        print(line, flush=True)
        (a.out / "result.json").write_text(json.dumps({"config": config, "rows": rows, "partial": True}, indent=2) + "\n")

    weights = load_model(model)
    if a.time:  # first: short, and the precision rows follow whatever happens
        from execute.prefill_precision import time_products

        config["timings"] = time_products(weights, a.tokens)
        print(json.dumps(config["timings"]), flush=True)
    compare(weights, a.tokens, a.seed, blocks=a.blocks, progress=progress, rows=rows)
    config["synth_s"], config["wall_s"] = made_s, time.perf_counter() - t0
    (a.out / "result.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    text = table(rows)
    (a.out / "README.md").write_text(
        f"# Prefill precision, stage by stage\n\n`{config['command']}` ({a.tokens} tokens, seed {a.seed}); ratio = "
        "relative error / the stage's bound (execute/prefill_precision.py); chained rows carry the block's "
        f"earlier stages' error.\n\n```\n{text}\n```\n" + _timings(config.get("timings")))
    print(text)
    if a.synth is not None:
        model.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
