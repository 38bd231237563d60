"""Time each one-token (decode) kernel of one block alone, and the block's whole graph, on random
weights of a model's shapes: which kernel is far from the memory bandwidth it could reach.

Method. ``blocks`` blocks of random weights (dense rows as the shape's stored types, one MoE
layer of ``experts`` random Q8_0-style experts in a ``GpuExperts`` arena; every block's router
picks its own experts) are prepared exactly as ``TokenGraph`` prepares them (``GpuDense.decode_block``
and ``GpuExperts.routed_layer``). For each kernel, one CUDA graph holds that kernel's launch for
every block, ``repeat`` times over; its replays are timed with CUDA events (median over
``trials``), so a launch reads weights another launch did not just leave in L2 (blocks x bytes >>
L2), and the time of a launch includes the gap between dependent graph nodes, as in the token's
graph. The block's whole graph (its dense launches, router and experts, ``blocks`` blocks chained
as the token graph chains them) is timed the same way, and again with each kernel left out (the
difference: that kernel's cost inside the graph, where its neighbours may overlap it). The KV
caches of the blocks (``keys`` x 4 KB each at the default shape) stay in L2 when the attention
runs alone, not in the token's graph: its cost inside the graph is the figure to read. Each kernel's bytes (``kernel_bytes``: the
weights and cache it must read) over its time gives GB/s, set against a device-to-device copy
measured in the same run (read + write bytes over time).

Variants (``execute.kernel_variants``): the same weights and inputs run under each; the bench also
reports how far each variant's block outputs are from the first's (a cheap check that they
compute the same thing). Under v3 a kernel's launches overlap one another (programmatic dependent
launch), so its times alone are lower bounds; the block's graph is the figure that counts. Only
the GPU functions import cupy.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass

import numpy as np

from . import quant as Q

__all__ = ["BlockShape", "KERNELS", "copy_ceiling_gbps", "expert_launch_shapes", "format_table", "graph_seconds", "kernel_bytes",
           "report_rows", "summarize", "time_block"]

KERNELS = ("qkv", "qk_rope_kv", "attn_partial", "attn_reduce", "wo", "router", "gate_up", "down_combine")
_CHUNK = 64  # keys per attention block (dense_kernels.cu CHUNK)
_DENSE_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0)


@dataclass(frozen=True)
class BlockShape:
    """One GQA MoE block (defaults: the synthetic qwen3-30b-a3b, F16 dense, F32 router, Q8_0
    experts) and the key count its attention reads."""

    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    ffn: int = 768
    keys: int = 256
    dense_qtype: int = Q.F16
    router_qtype: int = Q.F32
    expert_qtype: int = Q.Q8_0
    blocks: int = 8

    def __post_init__(self) -> None:
        for f in ("hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "ffn", "keys", "blocks"):
            if getattr(self, f) < 1:
                raise ValueError(f"BlockShape.{f}: {getattr(self, f)}, expected >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"BlockShape.heads: {self.heads}, expected a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim > 256:
            raise ValueError(f"BlockShape.head_dim: {self.head_dim}, expected <= 256 (the attention kernel's limit)")
        if not self.top_k <= min(self.experts, 32):
            raise ValueError(f"BlockShape.top_k: {self.top_k}, expected <= experts and <= 32")
        for f in ("hidden", "ffn"):
            if getattr(self, f) % 32:
                raise ValueError(f"BlockShape.{f}: {getattr(self, f)}, expected a multiple of 32")
        for f in ("dense_qtype", "router_qtype"):
            if getattr(self, f) not in _DENSE_TYPES:
                raise ValueError(f"BlockShape.{f}: {getattr(self, f)}, expected one of F32, F16, BF16, Q8_0")
        if self.expert_qtype not in Q.QTYPES:
            raise ValueError(f"BlockShape.expert_qtype: {self.expert_qtype}, expected a type gpu_kernels.cu reads")

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _dense_bytes(qt: int, rows: int, cols: int) -> int:
    """Device bytes of a (rows, cols) matrix as ``gpu_dense.Matrix`` keeps it."""
    if qt == Q.Q8_0:
        return rows * cols + 2 * rows * (cols // 32)
    return rows * cols * {Q.F32: 4, Q.F16: 2, Q.BF16: 2}[qt]


def kernel_bytes(s: BlockShape) -> dict[str, int]:
    """Bytes each kernel of one block must read from memory at least (weights, the KV cache's
    keys, partial results; float32 activations of a few KB included)."""
    f = 4
    splits = -(-s.keys // _CHUNK)
    kv = 2 * s.kv_heads * s.keys * s.head_dim * f
    return {
        "qkv": _dense_bytes(s.dense_qtype, s.q_dim + 2 * s.kv_dim, s.hidden) + 2 * s.hidden * f,
        "qk_rope_kv": (s.q_dim + 2 * s.kv_dim) * f * 2 + 2 * s.head_dim * f,
        "attn_partial": kv + s.q_dim * f,
        "attn_reduce": s.heads * splits * (s.head_dim + 2) * f,
        "wo": _dense_bytes(s.dense_qtype, s.hidden, s.q_dim) + s.q_dim * f + s.hidden * f,
        "router": _dense_bytes(s.router_qtype, s.experts, s.hidden) + 2 * s.hidden * f,
        "gate_up": s.top_k * 2 * s.ffn * Q.row_bytes(s.expert_qtype, s.hidden) + s.hidden * f,
        "down_combine": s.top_k * s.hidden * Q.row_bytes(s.expert_qtype, s.ffn) + s.top_k * s.ffn * f,
    }


def expert_launch_shapes(s: BlockShape, variant: str = "v3") -> dict[str, str]:
    """The expert launches' grid x block as ``GpuExperts.routed_layer`` makes them (4 warps of 2
    rows per block for gate/up; one warp per pair, 2 rows per block for down, 4 under v4)."""
    rpb = 4 if variant == "v4" else 2
    return {"gate_up": f"({-(-s.ffn // 8)},{s.top_k})x128",
            "down_combine": f"({-(-s.hidden // rpb)},1)x{32 * s.top_k}"}


def report_rows(times_us: dict[str, float], nbytes: dict[str, int], ceiling_gbps: float,
                launches: dict[str, str] | None = None, in_graph_us: dict[str, float] | None = None) -> list[dict]:
    """One row per timed kernel: MB, us, GB/s, share of the ceiling, us at the ceiling, the time
    lost against it, and (``in_graph_us``) what leaving it out of the block's graph saves (kernels
    in ``KERNELS`` order, then any others)."""
    if ceiling_gbps <= 0:
        raise ValueError(f"ceiling_gbps: {ceiling_gbps}, expected > 0")
    rows = []
    for name in [k for k in KERNELS if k in times_us] + [k for k in times_us if k not in KERNELS]:
        t, b = float(times_us[name]), int(nbytes.get(name, 0))
        ideal = b / (ceiling_gbps * 1e3)  # us
        gbps = b / (t * 1e3) if t > 0 else 0.0
        rows.append({"kernel": name, "launch": (launches or {}).get(name, ""), "mb": b / 1e6, "us": t,
                     "gbps": gbps, "of_ceiling": gbps / ceiling_gbps, "ideal_us": ideal, "lost_us": t - ideal,
                     "in_graph_us": float((in_graph_us or {}).get(name, float("nan")))})
    return rows


def format_table(rows: list[dict], title: str = "") -> str:
    """A fixed-width text table of ``report_rows`` with a total line."""
    out = [title] if title else []
    out.append(f"{'kernel':<14}{'launch':>22}{'MB':>8}{'us':>9}{'GB/s':>8}{'ceil':>7}{'ideal us':>9}{'lost us':>9}"
               f"{'in graph':>9}")
    for r in rows:
        out.append(f"{r['kernel']:<14}{r['launch']:>22}{r['mb']:8.2f}{r['us']:9.2f}{r['gbps']:8.0f}"
                   f"{100 * r['of_ceiling']:6.0f}%{r['ideal_us']:9.2f}{r['lost_us']:9.2f}{r['in_graph_us']:9.2f}")
    tot = {k: sum(r[k] for r in rows) for k in ("mb", "us", "ideal_us", "lost_us", "in_graph_us")}
    out.append(f"{'sum':<14}{'':>22}{tot['mb']:8.2f}{tot['us']:9.2f}{'':>8}{'':>7}{tot['ideal_us']:9.2f}"
               f"{tot['lost_us']:9.2f}{tot['in_graph_us']:9.2f}")
    return "\n".join(out)


@contextlib.contextmanager
def _variant(v: str):
    old = os.environ.get("MOELAB_DECODE_KERNELS")
    os.environ["MOELAB_DECODE_KERNELS"] = v
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MOELAB_DECODE_KERNELS", None)
        else:
            os.environ["MOELAB_DECODE_KERNELS"] = old


def _time_graph(cp, launches, repeat: int, reps: int, trials: int) -> float:
    """Median us of one pass over ``launches`` (callables of a stream address), from a graph
    holding them ``repeat`` times replayed ``reps`` times per trial."""
    cp.cuda.Device().synchronize()  # the set-up ran on other streams
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for _ in range(repeat):
            for f in launches:
                f(s.ptr)
        g = s.end_capture()
        g.launch(s)  # warm-up
        s.synchronize()
        t0, t1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for _ in range(trials):
            t0.record(s)
            for _ in range(reps):
                g.launch(s)
            t1.record(s)
            t1.synchronize()
            ts.append(1e3 * cp.cuda.get_elapsed_time(t0, t1) / (reps * repeat))
    return float(np.median(ts))


def copy_ceiling_gbps(nbytes: int = 1 << 30, trials: int = 5) -> float:
    """Device-to-device copy bandwidth (read + write bytes over time, median of ``trials``)."""
    import cupy as cp

    a = cp.ones(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    t0, t1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(trials + 1):
        t0.record()
        cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, a.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
        t1.record()
        t1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(t0, t1) * 1e-3)
    return 2 * a.nbytes / float(np.median(ts[1:])) / 1e9


def graph_seconds(call, reps: int) -> float:
    """Seconds of one ``call()`` on the GPU: ``reps`` calls captured in one CUDA graph, the graph's
    median time over 5 launches / ``reps`` (no host launch overhead; plain events around each call
    where capture fails), after one warm-up call. A list of calls: taken in turn (weights in copies
    that together outgrow the L2 cache, so a call reads memory, not what the call before left)."""
    import cupy as cp

    calls = call if isinstance(call, list) else [call]
    for c in calls:
        c()
    try:
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            for i in range(reps):
                calls[i % len(calls)]()
            g = s.end_capture()
        g.launch(s)
        s.synchronize()
        ts = []
        for _ in range(5):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            g.launch(s)
            b.record(s)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3 / reps)
        return float(np.median(ts))
    except Exception as e:  # noqa: BLE001 (capture unsupported: time each call)
        print(f"(graph capture failed: {e}; timing calls one by one)", flush=True)
    ts = []
    for i in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        calls[i % len(calls)]()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return float(np.median(ts))


def time_block(s: BlockShape, variants=("v1", "v2", "v3", "v4"), repeat: int = 4, reps: int = 10, trials: int = 5,
               seed: int = 0) -> dict:
    """Per variant: each kernel's median us per launch, and the whole block's; what leaving each
    kernel out of the block's graph saves per block (its cost there, overlap included); the copy
    ceiling; an empty kernel's us per launch in a chain of them (a graph node's floor); the bytes;
    the dense launches' shapes; each variant's output distance to the first's."""
    import cupy as cp

    from .kernel_rig import Rig

    rng = np.random.default_rng(seed)
    ceiling = copy_ceiling_gbps()
    noop = cp.RawKernel('extern "C" __global__ void noop() {}', "noop")
    node_us = _time_graph(cp, [lambda st: noop((1,), (32,), ())] * s.blocks, repeat, reps, trials)
    rig = Rig(s, rng)
    out = {"shape": asdict(s), "ceiling_gbps": ceiling, "node_us": node_us, "bytes": kernel_bytes(s), "variants": {}}
    first = None
    try:
        for v in variants:
            try:  # a variant that fails (a refused capture, say) is reported, the others still run
                with _variant(v):
                    plan = rig.plan()
                block_us = _time_graph(cp, plan.chain(), 1, reps, trials) / s.blocks
                outputs = rig.outputs()
                times = {k: _time_graph(cp, plan.kernels[k], repeat, reps, trials) / s.blocks for k in KERNELS}
                saved = {k: block_us - _time_graph(cp, plan.chain(k), 1, reps, trials) / s.blocks for k in KERNELS}
            except Exception as exc:  # noqa: BLE001 - recorded in the result
                out["variants"][v] = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())}
                continue
            diff = 0.0 if first is None else max(float(np.max(np.abs(o - f)) / (np.max(np.abs(f)) or 1.0))
                                                 for o, f in zip(outputs, first))
            first = outputs if first is None else first
            out["variants"][v] = {"kernel_us": times, "block_us": block_us, "in_graph_us": saved,
                                  "launches": {**plan.shapes, **expert_launch_shapes(s, v)},
                                  "max_rel_diff_vs_first": diff}
    finally:
        rig.close()
    from . import pdl_launch

    out["programmatic_refused"] = pdl_launch.refused  # a CUDA error: v3 ran as plain launches
    return out


def summarize(result: dict) -> str:
    """``time_block``'s result as text: one table per variant, then the whole block's graph time
    against the sum of its kernels alone, and each kernel's time relative to the first variant."""
    b, ceil = result["bytes"], result["ceiling_gbps"]
    names = [v for v, r in result["variants"].items() if "error" not in r]
    out = [f"copy ceiling {ceil:.0f} GB/s (read + write); bytes per block {sum(b.values()) / 1e6:.1f} MB "
           f"-> {sum(b.values()) / (ceil * 1e3):.1f} us at the ceiling; an empty kernel node in a chain of "
           f"them: {result.get('node_us', float('nan')):.2f} us"]
    for v in names:
        r = result["variants"][v]
        rows = report_rows(r["kernel_us"], b, ceil, r["launches"], r.get("in_graph_us"))
        out += ["", format_table(rows, f"[{v}] each kernel alone, us per launch (median)"),
                f"[{v}] whole block in one graph: {r['block_us']:.2f} us per block (kernels alone sum "
                f"{sum(r['kernel_us'].values()):.2f}); outputs vs {names[0]}: max rel diff "
                f"{r['max_rel_diff_vs_first']:.2e}"]
    out += [f"[{v}] failed: {r['error']}" for v, r in result["variants"].items() if "error" in r]
    if result.get("programmatic_refused") is not None:
        out.append(f"programmatic dependent launch refused (CUDA error {result['programmatic_refused']}): "
                   "v3 ran as plain launches")
    if len(names) > 1:
        base = result["variants"][names[0]]
        out.append("")
        for v in names[1:]:
            r = result["variants"][v]
            ratios = ", ".join(f"{k} {r['kernel_us'][k] / base['kernel_us'][k]:.2f}" for k in r["kernel_us"]
                               if base["kernel_us"].get(k))
            out.append(f"{v} / {names[0]} time: block {r['block_us'] / base['block_us']:.2f}; {ratios}")
    return "\n".join(out)
