"""Dense-path benchmark: one block's dense path and a whole decode token, float32 operators vs fused
kernels vs fused kernels replayed as CUDA graphs, side by side in one run.

Model: a synthetic GGUF of the Qwen3-30B-A3B shape with few blocks (``--layers``; what ``moelab model
synth --preset qwen3-30b-a3b --layers N --vocab 32000 --quant Q8_0`` writes), made in ``--out`` unless
``--model`` names one. Three dense paths over the same weights and KV cache sizes:

- ``float32``: every dense matrix as a float32 copy on the GPU, CuPy operators, the router's logits
  read back and its top-k on the host (the dense path before ``execute.gpu_dense``);
- ``fused``: ``MoeModel`` on a GPU (matrices in their stored type, the fused one-token kernels),
  CUDA graphs off (``MOELAB_CUDA_GRAPHS=0``);
- ``graphs``: the same with each block's token replayed as one CUDA graph (the default).

Measured, alternating the paths ``--repeats`` times:

- dense per block: the time from resuming ``chunk_steps`` to its Step, expert output delivered as
  zeros (host clock, and CUDA events on the dense stream; median over blocks and tokens, the first
  block, which also copies the embedding, left out) over ``--tokens`` decode positions;
- a decode token: ``execute.model.run`` with the expert engine and the ``gpu`` policy (every expert
  resident, as ``moelab run --policy gpu``), tokens/s over ``--tokens`` positions, and the same
  for one prefill chunk of ``--prompt`` tokens;
- one block's token alone (no wait), at the last position: with plain launches, the host time to
  issue them and the device time from a CUDA graph of 50 repetitions (no launch or host gaps);
  as the block's own graph, the host time of a replay (record write + launch) and the device
  time of 50 replays back to back (the record's and the route's copies included).

Prints every path and the ratios; writes ``bench_dense.json`` (results and the config) into ``--out``.

The timing is execute.dense_timing's (its figures reduced by its ``summarize``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from execute.dense_timing import (float32_model, fused_block_split, graph_block_split, summarize, time_dense,
                                  time_tokens)


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF to use (default: synthesise one in --out)")
    p.add_argument("--layers", type=int, default=4, help="blocks of the synthetic model (default 4)")
    p.add_argument("--tokens", type=int, default=32, help="decode positions per measurement (default 32)")
    p.add_argument("--prompt", type=int, default=128, help="tokens of the timed prefill chunk (default 128)")
    p.add_argument("--repeats", type=int, default=3, help="alternations of the two paths (default 3)")
    p.add_argument("--threads", type=int, default=2, help="CPU pool threads of the expert engine (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_dense_out", help="output folder (default bench_dense_out)")
    a = p.parse_args(argv)
    for name in ("layers", "tokens", "prompt", "repeats", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name}: {getattr(a, name)}, expected >= 1")
    if a.model and not Path(a.model).is_file():
        p.error(f"--model: {a.model} is not a file")
    return a


def main(argv=None) -> int:
    a = _args(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # noqa: BLE001 - any failure to reach a GPU is the same answer
        print(f"bench_dense: needs cupy and a CUDA device ({exc})", file=sys.stderr)
        return 2
    from execute import model as M
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model
    from scheduler import Capacity

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = a.model
    if path is None:
        cfg = config_from_preset("qwen3-30b-a3b", num_layers=a.layers, vocab=32000, quant="Q8_0", seed=a.seed)
        path = out / f"qwen3-30b-a3b-{a.layers}l-q8.gguf"
        if not path.is_file():
            synth_model(path, cfg)
    weights = load_model(path)
    info = weights.info
    rng = np.random.default_rng(a.seed)
    tokens, prompt = rng.integers(info.vocab, size=a.tokens), rng.integers(info.vocab, size=a.prompt)
    cap = a.tokens + 1
    models = {"float32": float32_model(weights, cap),
              "fused": M.MoeModel(weights, use_gpu=True, max_tokens=cap, cuda_graphs=False),
              "graphs": M.MoeModel(weights, use_gpu=True, max_tokens=cap, cuda_graphs=True)}
    if not models["fused"].fast:
        print(f"bench_dense: {path}: this model does not run on the fused kernels", file=sys.stderr)
        return 2
    g = info.geometry()
    backend = M.EngineExperts(weights, Capacity.per_layer(g, max(info.num_experts)), a.threads, use_gpu=True)
    res = {k: {"host_us": [], "event_us": [], "tokens_per_s": [], "prompt_tokens_per_s": []} for k in models}
    try:
        for name, m in models.items():  # warm-up: compile kernels, fill allocator pools, capture graphs
            time_dense(m, tokens[:4])
            time_tokens(m, backend, weights, tokens[:4])
            time_tokens(m, backend, weights, prompt[:8], chunk=True)
        if not models["graphs"].graphed:
            print("bench_dense: no CUDA graphs were captured (see the warning above): the graphs row runs the "
                  "plain launches", file=sys.stderr)
        for _ in range(a.repeats):
            for name, m in models.items():
                host, dev = time_dense(m, tokens)
                res[name]["host_us"].append(1e6 * statistics.median(host))
                res[name]["event_us"].append(1e3 * statistics.median(dev))
                res[name]["tokens_per_s"].append(time_tokens(m, backend, weights, tokens))
                res[name]["prompt_tokens_per_s"].append(time_tokens(m, backend, weights, prompt, chunk=True))
        split = [fused_block_split(models["fused"]) for _ in range(a.repeats)]  # last: it may capture a graph
        gsplit = [graph_block_split(models["graphs"]) for _ in range(a.repeats)]
    finally:
        backend.close()
    summary, ratios = summarize(res)
    f, g = summary["fused"], summary["graphs"]
    g["graphed"] = models["graphs"].graphed
    layers = info.num_layers
    print(f"model {path}: {layers} blocks, hidden {info.hidden}, {info.num_heads}/{info.num_kv_heads} heads x "
          f"{info.head_dim}, {max(info.num_experts)} experts top-{info.top_k}; {a.tokens} positions, "
          f"{a.repeats} repeats (medians)")
    print(f"{'path':8} {'dense us/block (host)':>22} {'(events)':>9} {'tokens/s':>9} {'ms/block all-in':>16} "
          f"{'prompt tokens/s':>16}")
    for name, s in summary.items():
        s["ms_per_block_all_in"] = 1e3 / s["tokens_per_s"] / layers
        print(f"{name:8} {s['dense_host_us_per_block']:22.1f} {s['dense_event_us_per_block']:9.1f} "
              f"{s['tokens_per_s']:9.1f} {s['ms_per_block_all_in']:16.3f} {s['prompt_tokens_per_s']:16.1f}")
    print(f"fused / float32: dense {ratios['dense_host']:.1f}x faster (host), {ratios['dense_events']:.1f}x "
          f"(events); decode tokens/s {ratios['tokens_per_s']:.2f}x; prompt tokens/s {ratios['prompt_tokens_per_s']:.2f}x")
    print(f"graphs / fused: dense {ratios['graphs_dense_host']:.2f}x faster (host), "
          f"{ratios['graphs_dense_events']:.2f}x (events); decode tokens/s {ratios['graphs_tokens_per_s']:.2f}x"
          + ("" if g["graphed"] else " (NO graphs were captured: both rows ran the plain launches)"))
    print(f"decode tokens/s, --policy gpu, {layers} blocks: CUDA graphs on {g['tokens_per_s']:.1f}, "
          f"off {f['tokens_per_s']:.1f}")
    issue = statistics.median(x["issue_us"] for x in split)
    dev = [x["device_us"] for x in split if x["device_us"] is not None]
    summary["fused"]["block_issue_us"] = issue
    summary["fused"]["block_device_us"] = statistics.median(dev) if dev else None
    print(f"fused block, launches alone: {issue:.1f} us to issue (host), "
          + (f"{summary['fused']['block_device_us']:.1f} us on the device (CUDA graph)" if dev else "no graph figure"))
    g_issue = [x["issue_us"] for x in gsplit if x["issue_us"] is not None]
    g_dev = [x["device_us"] for x in gsplit if x["device_us"] is not None]
    g["block_issue_us"] = statistics.median(g_issue) if g_issue else None
    g["block_device_us"] = statistics.median(g_dev) if g_dev else None
    if g_issue:
        print(f"graphs block, one replay alone: {g['block_issue_us']:.1f} us to issue (host: record + launch), "
              f"{g['block_device_us']:.1f} us on the device (replays back to back)")
    print("at 48 blocks (per-block all-in time x 48, head not separated): "
          + ", ".join(f"{k} {1e3 / (48 * v['ms_per_block_all_in']):.1f}" for k, v in summary.items()) + " tokens/s")
    (out / "bench_dense.json").write_text(json.dumps({"config": {**vars(a), "model": str(path)}, "summary": summary,
                                                      "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
