"""Where a prefill chunk's time goes: the stages of one block of the chunk path, counted and timed.

A chunk of T tokens runs, per block (``execute.model.MoeModel.chunk_steps`` with the GPU dense path
``execute.gpu_dense`` and the batched experts ``execute.prefill``):

- ``attn_norm``, ``qk_norm_rope``, ``attention``, ``residual``, ``ffn_norm``: CuPy array expressions,
  one kernel per elementwise operation or reduction;
- ``qkv_proj``, ``o_proj``, ``router_proj``: ``GpuDense.matmul``, each a ``dequant_rows`` launch that
  expands the stored matrix to a float32 tile, a float32 cuBLAS product and a copy into the output;
- ``route_host``: the router logits copied to the host (the block's host wait), top-k in float64
  numpy (``batch_route.route_rows``) and the Step (``merge_rows``);
- ``plan``: the policy's decision and the audit's record of it (``scheduler.drive``, ``Audit``);
- ``experts``: ``BatchedExperts.run_layer``: pair sort and metadata copy on the host, ``pf_split``,
  ``pf_mm`` gate/up, ``pf_split``, ``pf_mm`` down, ``moe_combine``.

That is the CuPy path (``MOELAB_PREFILL_DENSE=0``); :func:`fused_costs` counts the default GPU path's
stages that replace it (``execute.prefill_dense``: one launch per norm, F16 products on tensor cores,
routing on the device, attention in four launches).

:func:`stage_costs` counts each stage's kernel launches, device bytes and FLOPs at a geometry from
the code as written (launch counts of the CuPy expressions are read off the code, so they are
estimates within a launch or two); :func:`host_costs` measures, on any machine, the host-only work
of a block (routing, Step, policy plan, audit) at the real geometry on synthetic logits;
``execute.prefill_timing.time_stages`` (GPU) times each stage on one block of a synthetic model at the real shapes with
CUDA events (``experiments/bench_prefill_stages.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkShape", "Stage", "stage_costs", "fused_costs", "cost_rows", "expected_tiles", "host_costs", "table"]

_Q8_BYTES = 34 / 32  # bytes per weight of Q8_0
TILE_ROWS = 32  # execute.prefill's BM


@dataclass(frozen=True)
class ChunkShape:
    """The geometry of one block and the chunk's token count ``tokens`` (keys = ``pos + tokens``)."""

    tokens: int = 256
    pos: int = 0
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    ffn: int = 768
    dense_bytes_per_weight: float = _Q8_BYTES  # the stored dense matrices (Q8_0)
    expert_bytes_per_weight: float = _Q8_BYTES

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChunkShape.{name}: {getattr(self, name)}, expected >= 1")
        if self.pos < 0 or self.top_k > self.experts or self.heads % self.kv_heads:
            raise ValueError(f"ChunkShape: pos {self.pos}, top_k {self.top_k} of {self.experts} experts, "
                             f"{self.heads} heads over {self.kv_heads} kv heads: expected pos >= 0, top_k <= experts, "
                             "kv_heads dividing heads")


@dataclass(frozen=True)
class Stage:
    """One stage of a block: kernel launches, device bytes read + written, FLOPs, host waits."""

    name: str
    launches: int
    bytes: float
    flops: float
    host_waits: int = 0
    note: str = ""


def expected_tiles(tokens: int, experts: int, top_k: int, rows: int = TILE_ROWS) -> float:
    """Expected number of ``rows``-row tiles over the experts when each of ``tokens`` tokens picks
    ``top_k`` distinct experts uniformly: sum over experts of E[ceil(c / rows)], c ~ Binomial(tokens,
    top_k / experts)."""
    from math import comb

    p = top_k / experts
    c = np.arange(tokens + 1)
    pmf = np.array([comb(tokens, int(i)) * p ** i * (1 - p) ** (tokens - i) for i in c], np.float64)
    return float(experts * (pmf * np.ceil(c / rows)).sum())


def _matmul(name: str, t: int, rows: int, cols: int, bpw: float, note: str) -> Stage:
    """GpuDense.matmul of (t, cols) by (rows, cols): dequant_rows (read stored, write f32 tile),
    sgemm (read tile and x, write y), copy into the output; cp.empty costs no launch."""
    tile = 4.0 * rows * cols
    return Stage(name, 3, rows * cols * bpw + tile + (tile + 4.0 * t * cols + 4.0 * t * rows) + 8.0 * t * rows,
                 2.0 * t * rows * cols, 0, note)


def stage_costs(s: ChunkShape) -> list[Stage]:
    """The stages of one block of a chunk (module docstring) at ``s``, in the order they run."""
    t, h, nh, nkv, hd = s.tokens, s.hidden, s.heads, s.kv_heads, s.head_dim
    keys = s.pos + t
    act = 4.0 * t * h  # one float32 (T, hidden) array
    qkv_rows = (nh + 2 * nkv) * hd
    qk = 4.0 * t * (nh + nkv) * hd
    scores = 4.0 * nh * t * keys  # (kv, T * group, keys) float32
    pairs = t * s.top_k
    tiles = expected_tiles(t, s.experts, s.top_k)
    w_expert = 3 * h * s.ffn * s.expert_bytes_per_weight
    # pf_mm reads an expert's weights once per tile and column group; activations as hi/lo f16
    exp_bytes = tiles * w_expert + pairs * (2 * 4 * h + 4 * h) + pairs * s.ffn * (4 + 4 + 4) + act * (s.top_k + 1)
    return [
        Stage("attn_norm", 7, 7 * 2 * act, 5.0 * t * h, 0, "x*x, mean, +eps, sqrt, 1/, *, *w"),
        _matmul("qkv_proj", t, qkv_rows, h, s.dense_bytes_per_weight, "f32 tile of q|k|v dequantized per product"),
        Stage("qk_norm_rope", 7 + 5 + 2, 14 * 2 * qk, 12.0 * t * (nh + nkv) * hd, 0,
              "per-head RMSNorm (7), RoPE concat/mul/mul/add (5), K and V cache writes (2)"),
        Stage("attention", 13, 2 * 4.0 * t * nh * hd + 8 * 2 * scores + 2 * 4.0 * nkv * keys * hd, 4.0 * nh * t * keys * hd,
              0, "mask upload, q copy, QK^T, *scale, repeat, where, max, sub, exp, PV, sum, /, o copy"),
        _matmul("o_proj", t, h, nh * hd, s.dense_bytes_per_weight, "f32 tile of wo dequantized per product"),
        Stage("residual", 2, 3 * act, 2.0 * t * h, 0, "rs*y, x+"),
        Stage("ffn_norm", 7, 7 * 2 * act, 5.0 * t * h, 0, "as attn_norm"),
        _matmul("router_proj", t, s.experts, h, 4.0, "router F32: a copy of it, then the product"),
        Stage("route_host", 0, 4.0 * t * s.experts, 0.0, 1, "logits to the host (wait), top-k float64, Step"),
        Stage("plan", 0, 0.0, 0.0, 0, "policy plan + commit, audit record (host only)"),
        Stage("experts", 6, exp_bytes, 2 * 2.0 * pairs * 3 * h * s.ffn, 0,
              f"meta copy, pf_split, pf_mm g/u, pf_split, pf_mm down, combine; ~{tiles:.0f} tiles of 32 rows, "
              "FLOPs doubled by the hi/lo halves"),
        Stage("expert_residual", 3, 3 * 2 * act, 3.0 * t * h, 0, "out + 0.0 (no shared expert), rs*, x+"),
    ]


def fused_costs(s: ChunkShape) -> list[Stage]:
    """The stages of the default GPU chunk path (``execute.prefill_dense``, F16 dense matrices) that
    replace :func:`stage_costs`' CuPy expressions and float32-tile products, at ``s``."""
    t, h, nh, nkv, hd = s.tokens, s.hidden, s.heads, s.kv_heads, s.head_dim
    keys = s.pos + t
    act = 4.0 * t * h
    qkv_rows = (nh + 2 * nkv) * hd
    scores = 4.0 * nh * t * keys

    def f16(name: str, rows: int, cols: int) -> Stage:
        # pf_split (read x, write hi, lo), two GEMMs (each: the f16 matrix and one half; y written,
        # then read and written again), the row scale (read and write y)
        return Stage(name, 4, 4.0 * t * cols + 4.0 * t * cols + 2 * (2.0 * rows * cols + 2.0 * t * cols)
                     + 3 * 4.0 * t * rows + 8.0 * t * rows, 2 * 2.0 * t * rows * cols, 0,
                     "pf_split halves, two cuBLAS f16 GEMMs into f32, row scale")

    return [
        Stage("attn_norm_fused", 1, 2 * act, 3.0 * t * h, 0, "pd_rmsnorm"),
        f16("qkv_proj_f16", qkv_rows, h),
        Stage("qk_rope_kv_fused", 1, 2 * 4.0 * t * qkv_rows, 8.0 * t * (nh + nkv) * hd, 0,
              "pd_qk_rope_kv: q in the product's layout, K and V into the cache"),
        Stage("attention_fused", 4, 4.0 * t * nh * hd + 3 * scores + 2 * 4.0 * nkv * keys * hd + 3 * 4.0 * t * nh * hd,
              4.0 * nh * t * keys * hd, 0, "QK^T (cuBLAS), pd_softmax (scale, mask, sinks), PV (cuBLAS), o copy"),
        f16("o_proj_f16", h, nh * hd),
        Stage("ffn_norm_fused", 1, 2 * act, 3.0 * t * h, 0, "pd_rmsnorm"),
        Stage("route_gpu", 3, 4.0 * t * s.experts + 12.0 * t * s.top_k, 0.0, 1,
              "pd_route (float64 top-k and weights), one copy of ids + weights, one wait"),
    ]


def host_costs(s: ChunkShape, layers: int = 48, policy: str = "gpu", repeats: int = 3, seed: int = 0) -> dict:
    """Median host seconds per block of the host-only work of a chunk at ``s``: ``route_s`` (float64
    top-k of synthetic router logits, ``route_rows``), ``step_s`` (``merge_rows``), ``plan_s`` (the
    policy's plan and commit through ``scheduler.drive``, the audit's record of each item as
    ``moelab run`` keeps it). ``policy``: 'gpu' (every expert resident) or 'cpu'."""
    from types import SimpleNamespace

    from scheduler import Capacity, Geometry, Token, drive, make_policy
    from scheduler.audit import Audit

    from .batch_route import merge_rows, route_rows

    if policy not in ("gpu", "cpu"):
        raise ValueError(f"host_costs policy: {policy!r}, expected 'gpu' or 'cpu'")
    info = SimpleNamespace(expert_groups=1, gating="softmax", top_k=s.top_k, norm_topk=True, expert_weights_scale=0.0)
    rng = np.random.default_rng(seed)
    logits = [rng.standard_normal((s.tokens, s.experts)) for _ in range(layers)]
    geo = Geometry((s.experts,) * layers, s.top_k, (int(3 * s.hidden * s.ffn * s.expert_bytes_per_weight),) * layers)
    out = {"route_s": [], "step_s": [], "plan_s": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        routed = [route_rows(info, lg) for lg in logits]
        t1 = time.perf_counter()
        steps = [merge_rows(l, ids, w) for l, (ids, w) in enumerate(routed)]
        t2 = time.perf_counter()
        cap = Capacity.per_layer(geo, [s.experts] * layers if policy == "gpu" else 0)
        pol = make_policy(policy, geo, cap)
        audit = Audit(geo, profile_residents=pol.cache.slot.keys(), keep_log=True, record_routes=True)
        t3 = time.perf_counter()
        for item in drive(pol, [Token(0, 0, 0, "prefill", iter(steps), s.tokens)], 1):
            audit.observe(item)
        t4 = time.perf_counter()
        for k, v in (("route_s", t1 - t0), ("step_s", t2 - t1), ("plan_s", t4 - t3)):
            out[k].append(v / layers)
    return {k: float(np.median(v)) for k, v in out.items()}


def table(rows: list[dict]) -> str:
    """A Markdown table of stage rows (keys: stage and any of launches, MB, GFLOP, device_ms, host_ms,
    GB/s, TFLOP/s, note), columns in that order where present."""
    cols = [c for c in ("stage", "launches", "host_waits", "MB", "GFLOP", "device_ms", "host_ms", "GB/s", "TFLOP/s",
                        "note") if any(c in r for r in rows)]

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if c in ("stage", "note") else "---:" for c in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def cost_rows(s: ChunkShape) -> list[dict]:
    """:func:`stage_costs` as table rows (MB, GFLOP), with a total row."""
    rows = [{"stage": st.name, "launches": st.launches, "host_waits": st.host_waits, "MB": st.bytes / 1e6,
             "GFLOP": st.flops / 1e9, "note": st.note} for st in stage_costs(s)]
    rows.append({"stage": "block total", "launches": sum(r["launches"] for r in rows),
                 "host_waits": sum(r["host_waits"] for r in rows), "MB": sum(r["MB"] for r in rows),
                 "GFLOP": sum(r["GFLOP"] for r in rows), "note": ""})
    return rows

