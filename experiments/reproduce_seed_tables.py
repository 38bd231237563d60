"""Predict the published decode rows below with the simulator and print them side by side.

Machines: the ``rtx4060-laptop`` and ``l4-colab`` presets. Model: Qwen3.5-35B-A3B geometry (40 layers
x 256 experts, top-8) in the published quant types, on a synthetic trace of that geometry (no
recorded Qwen3.5 routing is available). Rows: upstream ``--cpu-moe`` (policy ``cpu``), upstream's
cache (``lru`` with the same MiB budget) and the PR's hybrid + adaptive (``hybrid``, adaptive fills,
cache starting empty). The published figures are the ``TABLES`` entries.

    python experiments/reproduce_seed_tables.py [--tokens 256] [--seeds 3] [--out docs/SEED_TABLES.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from simulate import SimConfig, load_model, run
from simulate.run import load_tokens

# (machine preset, expert quant, cache MiB, {row: published tokens/s}, note)
TABLES = [
    ("rtx4060-laptop", "Q6_K", 4096, {"cpu": 19.6, "lru": 21.1, "hybrid": 37.7},
     "RTX 4060 Laptop 8 GB, Qwen3.5-35B-A3B Q6_K, 4096 MiB cache, 256 tokens (mean of 2 rounds)"),
    ("l4-colab", "IQ4_XS", 5000, {"cpu": 31.4, "lru": 33.2, "hybrid": 41.45},
     "L4 24 GB (12 vCPU), Qwen3.5-35B-A3B IQ4_XS, 5000 MiB cache, 256 tokens (hybrid: 41.3/41.6 before the faster "
     "fill, 45.9 after)"),
]
ROW_NAMES = {"cpu": "--cpu-moe", "lru": "cache (upstream LRU)", "hybrid": "hybrid + adaptive"}


def predict(hw: str, quant: str, mib: float, policy: str, tokens: int, seed: int, pinned: bool = True) -> dict:
    cfg = SimConfig(model="qwen3.5-35b-a3b", hardware=hw, policy=policy, cache_mib=mib, trace="synth",
                    synth_tokens=tokens, seed=seed, expert_quant=quant, adaptive=True, pinned=pinned)
    model = load_model(cfg.model).with_quant(quant)
    result, info = run(cfg, model=model, tokens=load_tokens(cfg, model))
    return {**result.summary(), **info}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="generated tokens per run (the seed's runs: 256)")
    ap.add_argument("--seeds", type=int, default=3, help="synthetic traces per row (mean reported)")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args(argv)
    lines = ["# Seed 000's decode rows, predicted by the simulator", "",
             f"Command: `python experiments/reproduce_seed_tables.py --tokens {args.tokens} --seeds {args.seeds}`", "",
             "Synthetic traces (traces.synth default parameters) of the Qwen3.5-35B-A3B geometry; the hardware "
             "presets' numbers are spec sheets and estimates, not fitted to these rows. Error = predicted / "
             "published - 1.", ""]
    errors, ratios = [], []
    for hw, quant, mib, published, note in TABLES:
        lines += [f"## {note}", "", f"Preset `{hw}`, experts {quant}.", "",
                  "| row | published t/s | predicted t/s | error | bound t/s | hit rate | GPU / PCIe / CPU busy "
                  "| predicted, pageable uploads | error |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
        pred = {}
        for policy, pub in published.items():
            runs = [predict(hw, quant, mib, policy, args.tokens, seed) for seed in range(args.seeds)]
            tps = float(np.mean([r["tokens_per_s"] for r in runs]))
            r0 = {k: float(np.mean([r[k] for r in runs])) for k in ("bound_tokens_per_s", "hit_rate", "gpu_busy",
                                                                     "pcie_busy", "cpu_busy")}
            pred[policy] = tps
            errors.append((abs(tps / pub - 1), f"{ROW_NAMES[policy]} on {hw}", tps / pub - 1))
            pg = float(np.mean([predict(hw, quant, mib, policy, args.tokens, seed, pinned=False)["tokens_per_s"]
                                for seed in range(args.seeds)]))
            lines.append(f"| {ROW_NAMES[policy]} | {pub:.1f} | {tps:.1f} | {tps / pub - 1:+.0%} | "
                         f"{r0['bound_tokens_per_s']:.1f} | {r0['hit_rate']:.1%} | {r0['gpu_busy']:.0%} / "
                         f"{r0['pcie_busy']:.0%} / {r0['cpu_busy']:.0%} | {pg:.1f} | {pg / pub - 1:+.0%} |")
            print(f"{hw:16} {ROW_NAMES[policy]:22} published {pub:5.1f}  predicted {tps:5.1f}  "
                  f"({tps / pub - 1:+.0%})", file=sys.stderr)
        slots = runs[0]["slots_per_layer"]
        pub_ratio = published["hybrid"] / published["lru"]
        pred_ratio = pred["hybrid"] / pred["lru"]
        ratios.append((hw, pub_ratio, pred_ratio))
        lines += ["", f"Cache: {slots} of 256 experts per layer. Hybrid / cache: published {pub_ratio:.2f}x, "
                      f"predicted {pred_ratio:.2f}x. Hybrid / --cpu-moe: published "
                      f"{published['hybrid'] / published['cpu']:.2f}x, predicted {pred['hybrid'] / pred['cpu']:.2f}x.", ""]
    worst = max(errors)
    within = sum(1 for e in errors if e[0] <= 0.25)
    lines += ["## Errors, plainly", "",
              f"- {within} of {len(errors)} rows (pinned uploads) are within 25% of the published figure; the "
              f"largest error is {worst[2]:+.0%} ({worst[1]}).",
              "- Hybrid / cache, the ratio the seed argues with: " + "; ".join(
                  f"{hw} published {a:.2f}x, predicted {b:.2f}x ({'reproduced within 15%' if abs(b / a - 1) <= 0.15 else 'not reproduced'})"
                  for hw, a, b in ratios) + ".",
              "- The pageable column assumes upstream uploads from mmap'd (pageable) weights; compare each row's "
              "two predictions with the published figure rather than picking the closer one per row.",
              "- Causes not modelled or not calibrated: the synthetic trace's hit rates are not Qwen3.5's (no "
              "recorded Qwen3.5 routing exists here); the CPU rates per quant type and all laptop/L4 host "
              "figures are estimates; upstream's cache loads during the prompt and its uploads are not batched "
              "the same way; llama.cpp's CPU path and graph overheads are not ours. The presets were not fitted "
              "to these rows.", ""]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
