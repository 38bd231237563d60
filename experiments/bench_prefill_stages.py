"""Where a prefill chunk's time goes, per stage of one block: launches, bytes and FLOPs counted from
the code (``execute.prefill_stages``), the host-only work (routing, Step, plan, audit) measured at
the real geometry, and, with ``--gpu``, each stage timed on a GPU on one block of a synthetic model of
the preset's shapes (``execute.prefill_timing``: CUDA events, medians; one whole chunk through the
run loop for comparison).

Writes ``result.json`` (rows + config), ``config.json`` and ``README.md`` (the tables) into ``--out``.

    python experiments/bench_prefill_stages.py --out /tmp/stages              # counts + host work (any machine)
    python experiments/bench_prefill_stages.py --out $OUT/stages --gpu        # + GPU timings (~30-60 s)
    python experiments/bench_prefill_stages.py --out $OUT/chunks --model M.gguf  # whole chunks of a file's blocks

``--model`` (GPU) runs ``execute.prefill_timing.chunk_profile`` instead: whole chunks of every block of
the file, block by block and on the device (``execute.prefill_device``) side by side, garbage
collections, the device path's host and device time per block, cProfile of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from execute.prefill_stages import ChunkShape, cost_rows, host_costs, table  # noqa: E402

_PRESETS = {"qwen3-30b-a3b": dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, ffn=768)}
_LAYERS = {"qwen3-30b-a3b": 48}


def readme(config: dict, counts: list[dict], host: dict, gpu: dict | None) -> str:
    s = config["shape"]
    lines = ["# Prefill stages of one block", "",
             f"Preset `{config['preset']}` (hidden {s['hidden']}, {s['heads']} heads / {s['kv_heads']} kv x {s['head_dim']}, "
             f"{s['experts']} experts top-{s['top_k']}, ffn {s['ffn']}); chunk of {s['tokens']} tokens at position "
             f"{s['pos']}; command: `{config['command']}`.", "",
             "## Counted from the code (per block)", "", table(counts), "",
             f"Times {config['layers']} blocks per chunk: {config['layers'] * counts[-1]['launches']} launches, "
             f"{config['layers'] * counts[-1]['host_waits']} host waits, {config['layers'] * counts[-1]['MB'] / 1e3:.1f} GB, "
             f"{config['layers'] * counts[-1]['GFLOP']:.0f} GFLOP.", "",
             "## Host-only work per block, measured here (median ms)", "",
             "| routing (route_rows) | Step (merge_rows) | plan + audit | policy |", "|---:|---:|---:|---|",
             f"| {1e3 * host['route_s']:.3f} | {1e3 * host['step_s']:.3f} | {1e3 * host['plan_s']:.3f} | {config['policy']} |",
             ""]
    if gpu is not None:
        lines += [f"## GPU, one block ({gpu['device']}, MOELAB_PREFILL={gpu['prefill_env']})", "",
                  "device_ms: events around the call; kernel_ms: the same with the stream held while the host "
                  "queues (host gaps removed); host_ms: until the call returns. GB/s and TFLOP/s from the counted "
                  "bytes and FLOPs over kernel_ms.", "", table(gpu["rows"]), "",
                  f"Setup: synthetic model {gpu['setup_s']['synth']:.1f} s, load and upload "
                  f"{gpu['setup_s']['load_and_prepare']:.1f} s.", ""]
        for key, rows in (gpu.get("host_profile") or {}).items():
            lines += [f"## Host time of one warm chunk by function (cProfile, by {key} time)", "",
                      "| function | calls | own ms | cumulative ms |", "|---|---:|---:|---:|"]
            lines += [f"| {r['function']} | {r['calls']} | {r['own_ms']:.3f} | {r['cumulative_ms']:.3f} |" for r in rows]
            lines.append("")
    return "\n".join(lines)


def _cell(v) -> str:
    if isinstance(v, list):
        return " / ".join(_cell(x) for x in v)
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def chunks_main(args, argv) -> int:
    from execute.prefill_timing import chunk_profile

    res = chunk_profile(args.model, tokens=args.tokens, reps=args.reps)
    res["command"] = "python experiments/bench_prefill_stages.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "result.json").write_text(json.dumps(res, indent=2) + "\n")
    keys = ("case", "runs", "wall_ms", "per_block_ms", "tokens_per_s", "dense_ms", "experts_ms", "other_ms",
            "queue_ms_per_block", "wait_ms_per_block", "gpu_ms_per_block", "gc_collections", "gc_ms")
    lines = [f"# Whole chunks of {res['tokens']} tokens, {res['blocks']} blocks of `{args.model.name}` ({res['device']})", "",
             f"Command: `{res['command']}`; {res['gc_objects']} objects tracked by the collector; chunks on the "
             f"device {res['device_chunks']} (run again block by block: {res['device_reruns']}), logits identical to "
             f"block by block: {res['logits_identical']}.", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in res["rows"]]
    for key, rows in res["host_profile"].items():
        lines += ["", f"## One warm chunk by function (cProfile, by {key} time)", "",
                  "| function | calls | own ms | cumulative ms |", "|---|---:|---:|---:|"]
        lines += [f"| {r['function']} | {r['calls']} | {r['own_ms']:.3f} | {r['cumulative_ms']:.3f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (args.out / "README.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(_PRESETS))
    ap.add_argument("--tokens", type=int, default=256, help="chunk length (default 256)")
    ap.add_argument("--pos", type=int, default=0, help="position of the chunk's first token (default 0)")
    ap.add_argument("--policy", default="gpu", choices=("gpu", "cpu"), help="policy of the host-work measurement")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per GPU stage (default 20)")
    ap.add_argument("--gpu", action="store_true", help="time the stages on the GPU (needs cupy and a device)")
    ap.add_argument("--dense-quant", default="F16", choices=("F16", "Q8_0", "BF16", "F32"),
                    help="the synthetic model's dense matrices (default F16, as the peer benchmark's file)")
    ap.add_argument("--workdir", default=None, help="where the synthetic one-block model is written (default: a temporary dir)")
    ap.add_argument("--model", type=Path, default=None,
                    help="time whole chunks of this GGUF file's blocks instead (needs cupy and a device)")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.pos < 0 or args.reps < 1:
        print(f"bench_prefill_stages: --tokens {args.tokens}, --pos {args.pos}, --reps {args.reps}: expected "
              "tokens >= 1, pos >= 0, reps >= 1", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.is_file():
        print(f"bench_prefill_stages: --model {args.model}: no such file", file=sys.stderr)
        return 2
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"bench_prefill_stages: --out {args.out}: {exc}", file=sys.stderr)
        return 2
    if args.model is not None:
        return chunks_main(args, argv)
    bpw = {"F32": 4.0, "F16": 2.0, "BF16": 2.0}.get(args.dense_quant, 34 / 32)
    shape = ChunkShape(args.tokens, args.pos, **_PRESETS[args.preset], dense_bytes_per_weight=bpw)
    counts = cost_rows(shape)
    host = host_costs(shape, layers=_LAYERS[args.preset], policy=args.policy)
    gpu = None
    if args.gpu:
        from execute.prefill_timing import time_stages

        gpu = time_stages(args.tokens, args.pos, args.preset, reps=args.reps, workdir=args.workdir,
                          dense_quant=args.dense_quant)
    config = {"preset": args.preset, "layers": _LAYERS[args.preset], "policy": args.policy, "reps": args.reps,
              "dense_quant": args.dense_quant,
              "shape": dataclasses.asdict(shape),
              "command": "python experiments/bench_prefill_stages.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (args.out / "result.json").write_text(json.dumps({"config": config, "counts": counts, "host": host, "gpu": gpu},
                                                     indent=2) + "\n")
    text = readme(config, counts, host, gpu)
    (args.out / "README.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
