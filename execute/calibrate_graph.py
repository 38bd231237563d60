"""Calibration of the token graph (``execute.token_graph``): decode tokens run as one CUDA graph each,
as ``moelab run`` runs them under ``gpu``, on synthetic models of the calibration's shape.

Two models that differ only in their number of blocks (``GRAPH_LAYERS``; random Q8_0 experts, F16
dense matrices, a small vocabulary) are written by ``execute.synth``, loaded, and decoded through
``execute.driver.run`` with the expert engine and the token graph pipelined (the default), every
expert resident. Per timed token: the graphs' device time (``TokenGraph.gpu_s``, CUDA events around
each launch) and the host's busy time (wall time less the time blocked on the graphs,
``TokenGraph.wait_s``). Fitting both over the number of blocks (``graph_fields``) gives the
device time of one block in the graph (slope; the intercept is the head and the graph's copies),
the host time per step the graph computed (slope) and per token (intercept). The runs of the two
models are interleaved, ``reps`` each; the fit takes each model's median.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .calibrate_fit import fit_line, stats

__all__ = ["GRAPH_LAYERS", "GRAPH_VOCAB", "graph_fields", "measure_token_graph"]

GRAPH_LAYERS = (2, 6)  # blocks of the two models the fit runs over
GRAPH_VOCAB = 4096  # small: the head is not what is measured


def graph_fields(runs: dict) -> dict:
    """The hardware file's token-graph fields from ``runs`` ({blocks: {"device_s": stats, "host_s":
    stats}}, per token): ``graph_block_s`` (device slope over blocks), ``graph_step_s`` (host slope)
    and ``graph_token_s`` (host intercept). A slope at or below 0 (noise over two close sizes)
    falls back to the largest model's time per block and no per-token term."""
    blocks = sorted(runs, key=int)
    if len(blocks) < 2:
        raise ValueError(f"graph_fields: runs of two model sizes needed, got {blocks}")
    x = [int(b) for b in blocks]
    dev = [runs[b]["device_s"]["median"] for b in blocks]
    host = [runs[b]["host_s"]["median"] for b in blocks]
    _, block = fit_line(x, dev)
    token, step = fit_line(x, host)
    if not block > 0:
        block = dev[-1] / x[-1]
    if not step > 0:
        token, step = 0.0, host[-1] / x[-1]
    return {"graph_block_s": float(block), "graph_step_s": float(step), "graph_token_s": float(max(token, 0.0))}


def _model(folder: Path, args, blocks: int) -> Path:
    from .synth import SynthConfig, synth_model

    cfg = SynthConfig(arch="qwen3moe", num_layers=blocks, num_experts=args.experts, top_k=args.top_k,
                      hidden=args.hidden, ffn=args.ffn, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      head_dim=args.head_dim, vocab=GRAPH_VOCAB, quant="Q8_0", dense_quant="F16", seed=args.seed)
    return synth_model(folder / f"graph{blocks}.gguf", cfg)


def _decode(weights, threads: int, tokens: list[int], warmup: int) -> dict:
    """One run of ``tokens`` under ``gpu`` with the token graph; per timed token: device and host."""
    import cupy as cp

    from . import model as M
    from scheduler import Capacity, make_policy

    g = weights.info.geometry()
    cap = Capacity.per_layer(g, max(weights.info.num_experts))
    model = M.MoeModel(weights, use_gpu=True, max_tokens=len(tokens) + 1)
    backend = M.EngineExperts(weights, cap, threads, use_gpu=True)
    marks: dict = {}

    def progress(n: int) -> None:
        if n == warmup:
            tg = model.token_graph
            marks.update(t0=time.perf_counter(), gpu=tg.gpu_s, wait=tg.wait_s, tried=tg.tokens, done=tg.complete)

    inputs = [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate(tokens)]
    try:
        M.run(model, backend, make_policy("gpu", g, cap), inputs, progress=progress)
        cp.cuda.get_current_stream().synchronize()
        wall = time.perf_counter() - marks["t0"]
        tg = model.token_graph
        if tg is None:
            raise RuntimeError("the token graph was not attached (MOELAB_TOKEN_GRAPH=0, or no fused decode path)")
        n = len(tokens) - warmup
        tried, done = tg.tokens - marks["tried"], tg.complete - marks["done"]
        if tried != n or done != n:
            raise RuntimeError(f"token graph: {done} of {n} timed tokens completed in the graph ({tried} tried)")
        return {"device_s": (tg.gpu_s - marks["gpu"]) / n, "host_s": (wall - (tg.wait_s - marks["wait"])) / n,
                "wall_s": wall / n}
    finally:
        backend.close()


def measure_token_graph(args, folder: Path, reps: int, tokens: int = 40, warmup: int = 8) -> dict:
    """Per model size: stats of the device and host time per token over ``reps`` interleaved runs
    (``args``: the calibration's shape, threads and seed; the models are written under ``folder``)."""
    from .gguf_model import load_model

    weights = {b: load_model(_model(Path(folder), args, b)) for b in GRAPH_LAYERS}
    ids = np.random.default_rng(args.seed).integers(GRAPH_VOCAB, size=tokens + warmup).tolist()
    samples: dict = {b: {"device_s": [], "host_s": [], "wall_s": []} for b in GRAPH_LAYERS}
    for r in range(reps):
        for b in (GRAPH_LAYERS if r % 2 == 0 else GRAPH_LAYERS[::-1]):
            for k, v in _decode(weights[b], args.threads, ids, warmup).items():
                samples[b][k].append(v)
    runs = {str(b): {k: stats(v) for k, v in s.items()} for b, s in samples.items()}
    return {"runs": runs, "vocab": GRAPH_VOCAB, "tokens": tokens, "warmup": warmup, "fields": graph_fields(runs)}
