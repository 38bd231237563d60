"""Timing the dense path on a GPU, for ``experiments/bench_dense.py``: a float32-operator model
(the dense path before the fused kernels) beside ``MoeModel``, the dense time per block from the
host clock and CUDA events, one block's launches alone (issue time, device time from a CUDA
graph), one block's own graph replayed, and tokens/s of ``execute.model.run`` with every expert
resident. ``summarize`` reduces the repeated figures to medians and ratios (no GPU needed)."""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

__all__ = ["float32_model", "time_dense", "graph_block_split", "fused_block_split", "time_tokens", "summarize"]


def float32_model(weights, max_tokens: int):
    """The dense path with float32 matrices and CuPy operators (no fused kernels)."""
    from . import model as M

    class Float32Dense(M.MoeModel):
        def _matrix(self, parts):
            if parts[0][2] is None:
                return None
            vals = [v if p is None else v[p] for _, _, v, p in parts]
            return self._dev(vals[0] if len(vals) == 1 else np.concatenate(vals))

        def _fast_ok(self) -> bool:
            return False

    return Float32Dense(weights, use_gpu=True, max_tokens=max_tokens)


def time_dense(model, tokens) -> tuple[list, list]:
    """Per block (after the first): host seconds and CUDA-event milliseconds from resuming the
    generator to its Step, the expert output delivered as zeros."""
    import cupy as cp

    zeros = cp.zeros((1, model.info.hidden), cp.float32)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    host, dev = [], []
    model.reset()
    for t in tokens:
        gen = model.chunk_steps([int(t)])
        start.record()
        t0 = time.perf_counter()
        for i, step in enumerate(gen):
            end.record()
            end.synchronize()
            if i > 0:
                host.append(time.perf_counter() - t0)
                dev.append(cp.cuda.get_elapsed_time(start, end))
            model.deliver(zeros)
            start.record()
            t0 = time.perf_counter()
    return host, dev


def _block(model):
    """The second block's prepared launches (the first also reads the embedding)."""
    if model._plans is None:
        model._plans = model._decode_plans()
    blocks = model._plans[0]
    return blocks[min(1, len(blocks) - 1)]


def graph_block_split(model, reps: int = 50) -> dict:
    """Of one block's CUDA graph (``model`` with graphs on), at the model's last position: the host
    time of a replay (record write + launch, no wait) and the device time per replay of ``reps``
    replays back to back. None figures when the model holds no graph."""
    import cupy as cp

    b = _block(model)
    if b.graph is None:
        return {"issue_us": None, "device_us": None}
    add = cp.zeros(model.info.hidden, cp.float32)
    pos = max(model.pos - 1, 0)
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(s)
    t0 = time.perf_counter()
    for _ in range(reps):  # the same record each time: rewriting it while a replay runs changes nothing
        b.issue(s.ptr, add.data.ptr, pos, 0, pos + 1)
    issue = (time.perf_counter() - t0) / reps
    end.record(s)
    end.synchronize()
    return {"issue_us": 1e6 * issue, "device_us": 1e3 * cp.cuda.get_elapsed_time(start, end) / reps}


def fused_block_split(model, reps: int = 50) -> dict:
    """Of one block's fused launches (attention part and router kernel, no read-back), at the
    model's last position: the host time to issue them, and their device time from a CUDA graph of
    ``reps`` repetitions (no launch or host gap): what a block costs with launch overhead removed."""
    import cupy as cp

    b = _block(model)
    add = cp.zeros(model.info.hidden, cp.float32)
    pos = max(model.pos - 1, 0)
    s = cp.cuda.Stream(non_blocking=True)
    s.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        b.attend(s.ptr, add.data.ptr, pos, 0, pos + 1)
        b.router(s.ptr)
    issue = (time.perf_counter() - t0) / reps
    s.synchronize()
    out = {"issue_us": 1e6 * issue, "device_us": None}
    try:
        with s:
            s.begin_capture()
            for _ in range(reps):
                b.attend(s.ptr, add.data.ptr, pos, 0, pos + 1)
                b.router(s.ptr)
            graph = s.end_capture()
        graph.launch(s)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        graph.launch(s)
        end.record(s)
        end.synchronize()
        out["device_us"] = 1e3 * cp.cuda.get_elapsed_time(start, end) / reps
    except Exception as exc:  # noqa: BLE001 - a capture this CuPy cannot do leaves the figure out
        print(f"bench_dense: no CUDA graph of the block ({exc})", file=sys.stderr)
        if s.is_capturing():
            s.end_capture()
    return out


def time_tokens(model, backend, weights, tokens, chunk: bool = False) -> float:
    """Tokens/s of ``execute.model.run`` with the gpu policy: decode (one token per step), or one
    prefill chunk of all ``tokens`` (``chunk``)."""
    from . import model as M
    from scheduler import Capacity, make_policy

    g = weights.info.geometry()
    policy = make_policy("gpu", g, Capacity.per_layer(g, max(weights.info.num_experts)))
    if chunk:
        inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(int(t) for t in tokens))]
    else:
        inputs = [M.TokenInput(i, 0, i, "decode", int(t)) for i, t in enumerate(tokens)]
    res = M.run(model, backend, policy, inputs)
    return res.tokens_per_s



def summarize(res: dict) -> tuple[dict, dict]:
    """``res`` {path: {"host_us", "event_us", "tokens_per_s", "prompt_tokens_per_s": [per repeat]}}
    for the paths ``float32``, ``fused`` and ``graphs`` -> (per path the medians and the runs,
    ratios: fused / float32 and graphs / fused, each as "how many times faster")."""
    summary = {k: {"dense_host_us_per_block": statistics.median(v["host_us"]),
                   "dense_event_us_per_block": statistics.median(v["event_us"]),
                   "tokens_per_s": statistics.median(v["tokens_per_s"]),
                   "prompt_tokens_per_s": statistics.median(v["prompt_tokens_per_s"]), "runs": v} for k, v in res.items()}
    f, n, g = summary["fused"], summary["float32"], summary["graphs"]
    ratios = {"dense_host": n["dense_host_us_per_block"] / f["dense_host_us_per_block"],
              "dense_events": n["dense_event_us_per_block"] / f["dense_event_us_per_block"],
              "tokens_per_s": f["tokens_per_s"] / n["tokens_per_s"],
              "prompt_tokens_per_s": f["prompt_tokens_per_s"] / n["prompt_tokens_per_s"],
              "graphs_dense_host": f["dense_host_us_per_block"] / g["dense_host_us_per_block"],
              "graphs_dense_events": f["dense_event_us_per_block"] / g["dense_event_us_per_block"],
              "graphs_tokens_per_s": g["tokens_per_s"] / f["tokens_per_s"]}
    return summary, ratios
