"""Stage by stage: how far a prefill chunk's GPU arithmetic is from float64, against each stage's
rounding bound.

One chunk of T tokens (positions 0 .. T-1) runs block by block through a float64 reference
(:func:`reference_block`, every weight dequantized exactly) and through the GPU's chunk path
(``execute.prefill_dense.ChunkDense``: norms, F16-halves projections, q/k norm + RoPE + KV append,
attention, router; ``execute.prefill``'s ``pf_split`` + ``pf_mm``/``pf_mm2`` expert tiles and
``moe_combine``), and a few of its tokens through the one-token (decode) kernels of
``execute.gpu_dense``. Both get the same input per block (the reference's, rounded to float32), and
in the ``isolated`` comparison each GPU stage gets the reference's input of that stage too, so each
error is the stage's own; the ``chained`` comparison runs the GPU stages of a block one after
another from the block's input (the error a block adds). The experts always take the reference's
routes (routing disagreements are counted on their own, with their margins).

The chunk path's arithmetic, stage by stage (u = 2^-24, float32's unit roundoff):

| stage | inputs enter as | accumulation, order |
| --- | --- | --- |
| RMSNorm (``pd_rmsnorm``) | float32 | float32 FMA per thread, warp tree, then warps in order; 1/sqrt |
| qkv, wo (``ChunkDense.matmul``) | x: f16 hi + lo of a row scaled by 2^p (~22 bits); F16 weights exact; Q8_0/BF16 weights dequantized (exact) and split per row, three products hi.hi, lo.hi, hi.lo | tensor cores (cuBLAS gemmEx, f16 in, COMPUTE_32F), the products summed in float32 |
| q/k norm + RoPE (``pd_qk_rope_kv``) | float32; cos/sin tables float32 (from float64 angles) | as RMSNorm over head_dim; x c + x' s rounded per operation |
| scores, values (``_bgemm``) | float32 (no TF32: COMPUTE_32F, default math mode) | cuBLAS SGEMM order |
| softmax (``pd_softmax``) | float32 scores times scale | max, expf, block tree sum, times 1/sum |
| router logits | float32 (CuPy matmul, no TF32) | cuBLAS SGEMM order; top-k and weights in float64 |
| gate/up, down (``pf_mm``/``pf_mm2``) | x: f16 halves as above; quants exact in f16 | mma.sync m16n8k16 f32 per 32-weight block, times the f16 block scale, summed in float32 |
| combine (``moe_combine``) | float32 pair rows, float32 weights | rank order, FMA |

Error of a stage: per row (token, or (token, expert) pair), ``|got - ref| / |ref|`` (Euclidean
norms, float64). Bounds (typical sizes, random-sign rounding, not worst cases):

- product of inner length K: ``2^-22 + sqrt(K) u`` with f16 activation halves (tiles, chunk dense
  projections), ``sqrt(K) u`` in float32 (router, decode GEMVs);
- RMSNorm over n: ``(3 + sqrt(n) / 2) u``; q/k norm + RoPE over head_dim d: ``(6 + sqrt(d) / 2) u``;
- attention of a query over n keys: ``(4 + a sqrt(d) + sqrt(n)) u`` with ``a`` its largest scaled
  score's magnitude (a score's rounding enters exp() as an absolute error);
- SiLU(g) u: ``2 b + 4 u`` with ``b`` the product bound; combine of k pairs: ``(2 + sqrt(k)) u``.

A ratio of the median row's error to its bound far above 1 marks a stage that departs beyond its
tiles' precision. :func:`compare` returns one record per (block, path, mode, stage).
"""
from __future__ import annotations

import numpy as np

from . import quant as Q
from .archs import rope_angles

__all__ = ["U", "HALVES", "product_bound", "norm_bound", "row_errors", "reference_block", "compare", "supported",
           "GpuBlock", "block_records", "table", "time_products"]

U = 2.0 ** -24
HALVES = 2.0 ** -22  # the f16 activation halves' relative precision


def product_bound(k: int, halves: bool = True) -> float:
    """The typical relative rounding of a product of inner length ``k`` (module docstring)."""
    return (HALVES if halves else 0.0) + float(np.sqrt(k)) * U


def norm_bound(n: int) -> float:
    return (3.0 + float(np.sqrt(n)) / 2) * U


def row_errors(got, ref) -> np.ndarray:
    """Per row of ``(rows, ...)`` arrays: ``|got - ref| / |ref|`` in float64 (rows of zeros: 0)."""
    g = np.asarray(got, np.float64).reshape(len(ref), -1)
    r = np.asarray(ref, np.float64).reshape(len(ref), -1)
    num, den = np.linalg.norm(g - r, axis=1), np.linalg.norm(r, axis=1)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), num)


def supported(weights) -> str | None:
    """Why the comparison cannot take this model, or None: GQA with NeoX RoPE, softmax routing,
    routed experts only (no shared experts, no expert biases), SiLU."""
    info = weights.info
    if info.spec.attn == "mla" or info.spec.rope != "neox":
        return f"{info.arch}: the comparison takes GQA with NeoX RoPE only"
    if info.gating not in ("softmax", "softmax_topk") or info.expert_groups > 1:
        return f"{info.arch}: the comparison takes softmax routing without expert groups only"
    for lw, lx in zip(weights.layers, weights.experts):
        if lw.router is None or lw.shared is not None or lx is None or lx.has_bias or lx.activation != "silu":
            return f"{info.arch}: the comparison takes SiLU routed experts only (no dense or shared FFN, no biases)"
        if lw.attn_bias or lw.router_bias is not None or lw.exp_probs_b is not None or lw.sinks is not None:
            return f"{info.arch}: the comparison takes attention and routers without biases or sinks only"
    return None


def _f64(a):
    return np.asarray(a, np.float64)


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _rms(x, w, eps: float):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * _f64(w)


def _rope(x, ang):
    """NeoX RoPE of x (T, heads, d) at angles (T, d/2)."""
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _route(info, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids (T, k), weights (T, k), selection values (T, E)) by execute.archs' softmax rules."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    sel = p if info.gating == "softmax" else logits
    ids = np.argsort(-sel, axis=1, kind="stable")[:, :info.top_k]
    w = np.take_along_axis(sel, ids, axis=1)
    if info.gating == "softmax_topk":
        w = np.exp(w - w[:, :1])
        w = w / w.sum(axis=1, keepdims=True)
    if info.norm_topk:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids, w, sel


class _Experts64:
    """A block's experts dequantized to float64 on first use."""

    def __init__(self, lx):
        self.lx, self._cache = lx, {}

    def __call__(self, e: int):
        if e not in self._cache:
            lx = self.lx
            self._cache[e] = tuple(_f64(Q.dequantize(t.data[e], t.qtype, t.cols)).reshape(t.rows, t.cols)
                                   for t in (lx.gate, lx.up, lx.down))
        return self._cache[e]


def reference_block(weights, l: int, x: np.ndarray, kq_scale: float, experts=None) -> dict:
    """Block ``l`` of ``weights`` on ``x (T, hidden)`` float64 at positions 0 .. T-1, every stage's
    result (float64): h, qkv, q (T, heads, d), k, v (T, kv, d), o (T, heads d), att, x1, hn,
    logits, ids, w, sel, pairs (token, rank), act (pairs, ffn), y (pairs, hidden), moe, out."""
    info, lw = weights.info, weights.layers[l]
    ex = experts or _Experts64(weights.experts[l])
    nh, nkv, hd, eps, rs = info.num_heads, info.num_kv_heads, info.head_dim, info.rms_eps, info.residual_scale
    T = len(x)
    r = {"x": x, "h": _rms(x, lw.attn_norm, eps)}
    wqkv = np.concatenate([_f64(lw.wq), _f64(lw.wk), _f64(lw.wv)])
    r["qkv"] = qkv = r["h"] @ wqkv.T
    q, k = qkv[:, :nh * hd], qkv[:, nh * hd:(nh + nkv) * hd]
    if info.spec.qk_norm == "full":
        q, k = _rms(q, lw.q_norm, eps), _rms(k, lw.k_norm, eps)
    q, k = q.reshape(T, nh, hd), k.reshape(T, nkv, hd)
    if info.spec.qk_norm == "head":
        q, k = _rms(q, lw.q_norm, eps), _rms(k, lw.k_norm, eps)
    ang = rope_angles(np.arange(T), hd, info.rope_theta, info.rope_scaling, info.rope_factor, info.rope_orig_ctx)
    r["q"], r["k"] = _rope(q, ang), _rope(k, ang)
    r["v"] = qkv[:, (nh + nkv) * hd:].reshape(T, nkv, hd)
    g = nh // nkv
    kk, vv = np.repeat(r["k"], g, axis=1), np.repeat(r["v"], g, axis=1)
    s = np.einsum("thd,uhd->htu", r["q"], kk) * kq_scale  # (heads, T, T)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    r["score_max"] = np.abs(np.where(np.isfinite(s), s, 0.0)).max(axis=(0, 2))  # (T,)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    r["o"] = np.einsum("htu,uhd->thd", e / e.sum(axis=-1, keepdims=True), vv).reshape(T, nh * hd)
    r["att"] = r["o"] @ _f64(lw.wo).T
    r["x1"] = x + rs * r["att"]
    r["hn"] = _rms(r["x1"], lw.ffn_norm, eps)
    r["logits"] = r["hn"] @ _f64(lw.router).T
    r["ids"], r["w"], r["sel"] = _route(info, r["logits"])
    kx = r["ids"].shape[1]
    r["pairs"] = np.stack([np.repeat(np.arange(T), kx), np.tile(np.arange(kx), T)], axis=1)  # token-major
    act = np.empty((T * kx, weights.experts[l].ffn))
    y = np.empty((T * kx, info.hidden))
    flat = r["ids"].reshape(-1)
    for e in np.unique(flat):  # the pairs of one expert as matrix products
        p = np.flatnonzero(flat == e)
        wg, wu, wd = ex(int(e))
        hv = r["hn"][r["pairs"][p, 0]]
        gv, uv = hv @ wg.T, hv @ wu.T
        act[p] = gv / (1.0 + np.exp(-gv)) * uv
        y[p] = act[p] @ wd.T
    r["act"], r["y"] = act, y
    r["moe"] = (y.reshape(T, kx, -1) * r["w"][:, :, None]).sum(axis=1)
    r["out"] = r["x1"] + rs * r["moe"]
    return r


def _record(rows: list, block: int, path: str, mode: str, stage: str, got, ref, bound) -> None:
    err = row_errors(got, ref)
    b = np.broadcast_to(np.asarray(bound, np.float64), err.shape)
    ratio = err / b
    rows.append({"block": block, "path": path, "mode": mode, "stage": stage, "rows": int(len(err)),
                 "rel_median": float(np.median(err)), "rel_max": float(err.max()), "bound_median": float(np.median(b)),
                 "ratio_median": float(np.median(ratio)), "ratio_max": float(ratio.max())})


class GpuBlock:
    """The GPU side of one block's comparison: the chunk path's stages and the decode kernels."""

    def __init__(self, model, l: int):
        import cupy as cp

        from .gpu_host import cuda_module
        from .prefill import _tiles
        from .prefill_mm2 import kernel as mm2_kernel, kernel_for

        self.cp, self.model, self.l, self.w = cp, model, l, model.layers[l]
        self.pd, self.info = model.pd, model.info
        lx = model.weights.experts[l]
        self.lx = lx
        pf = cuda_module("prefill_kernels.cu")
        self.split = pf.get_function("pf_split")
        self.mm = mm2_kernel() if kernel_for(lx) == "pf_mm2" else pf.get_function("pf_mm")
        self.combine = cuda_module("gpu_kernels.cu", "expert_kernels_v4.cu").get_function("moe_combine")
        self.tiles = _tiles
        self.offs = lx.device_offsets()
        self.slot = -(-lx.expert_bytes // 256) * 256
        self._arena = None

    def dev(self, a):
        return self.cp.asarray(np.ascontiguousarray(a, np.float32))

    # dense stages of the chunk ------------------------------------------------------------------
    def rms(self, x, key: str):
        return self.pd.rms(x, self.w[key], self.info.rms_eps)

    def proj(self, x, key: str):
        return self.model._proj(x, self.w[key])

    def qk_rope(self, qkv):
        """q (T, heads, d) after norm + RoPE; the cache's k (T, kv, d) and v."""
        m, l, info = self.model, self.l, self.info
        q = self.pd.qk_rope_kv(m, l, qkv)  # (kv, T, g, d)
        t = int(qkv.shape[0])
        q = q.transpose(1, 0, 2, 3).reshape(t, info.num_heads, info.head_dim)
        return q, m.k_cache[l][:, :t].transpose(1, 0, 2), m.v_cache[l][:, :t].transpose(1, 0, 2)

    def set_cache(self, k, v) -> None:
        """Keys and values (T, kv, d) into positions 0 .. T-1 of the block's cache."""
        m, l, t = self.model, self.l, int(k.shape[0])
        k, v = self.cp.ascontiguousarray(k), self.cp.ascontiguousarray(v)  # k may be a view of the cache
        m.k_cache[l][:, :t] = k.transpose(1, 0, 2)
        m.v_cache[l][:, :t] = v.transpose(1, 0, 2)

    def route(self, logits):
        """The device's top-k (``pd_route``): ids and weights (T, k), or None."""
        return self.pd.route(logits, None, self.info)

    def attend(self, q, k, v):
        """Attention of q (T, heads, d) with k, v (T, kv, d) written to the cache first."""
        m, l, info = self.model, self.l, self.info
        t, g = int(q.shape[0]), info.num_heads // info.num_kv_heads
        self.set_cache(k, v)
        qq = self.cp.ascontiguousarray(q.reshape(t, info.num_kv_heads, g, info.head_dim).transpose(1, 0, 2, 3))
        return self.pd.attend(m, l, qq, t)

    # experts --------------------------------------------------------------------------------------
    def arena(self, experts: np.ndarray) -> dict[int, int]:
        """Device addresses of ``experts`` (gate | up | down as stored, 256-byte slots)."""
        cp, lx = self.cp, self.lx
        key = tuple(int(e) for e in experts)
        if self._arena is not None and self._arena[0] == key:
            return self._arena[1]
        parts = [np.pad(np.concatenate([lx.gate.data[e], lx.up.data[e], lx.down.data[e]]), (0, self.slot - lx.expert_bytes))
                 for e in experts]
        dev = cp.asarray(np.concatenate(parts))
        self._arena = (key, {e: dev.data.ptr + i * self.slot for i, e in enumerate(key)}, dev)
        return self._arena[1]

    def _halves(self, v, rows=None):
        cp = self.cp
        n = int(v.shape[0]) if rows is None else int(rows.size)
        c = int(v.shape[1])
        hi, lo, inv = cp.empty((n, c), cp.uint16), cp.empty((n, c), cp.uint16), cp.empty(n, cp.float32)
        self.split((n,), (256,), (v, rows if rows is not None else np.uint64(0), np.int32(c), hi, lo, inv))
        return hi, lo, inv

    def experts(self, hn, ids: np.ndarray, weights: np.ndarray, act_in=None, y_in=None):
        """The tiles' pair outputs for routes ``ids`` (T, k) on input ``hn`` (T, hidden): act (pairs,
        ffn) and y (pairs, hidden) in token-major pair order, and the combine (T, hidden).
        ``act_in`` / ``y_in`` (token-major pairs): the down product's / the combine's input instead
        of the GPU's own (the isolated comparison)."""
        from .prefill_mm2 import launch

        cp, lx = self.cp, self.lx
        T, k = ids.shape
        H, F = lx.hidden, lx.ffn
        flat = ids.reshape(-1)
        used = np.unique(flat)
        base = self.arena(used)
        order = np.argsort(flat, kind="stable")  # rows: pairs by expert, tokens ascending
        counts = np.bincount(np.searchsorted(used, flat), minlength=len(used))
        trow, tn, tg, _ = self.tiles(counts)
        tiles = tuple(cp.asarray(a) for a in (trow, tn, tg))
        d_base = cp.asarray(np.array([base[int(e)] for e in used], np.uint64))
        tok = cp.asarray((order // k).astype(np.int32))
        off_g, off_u, off_d = self.offs
        rb_g, rb_d = Q.row_bytes(lx.gate.qtype, H), Q.row_bytes(lx.down.qtype, F)
        a = self._halves(hn, tok)
        act = cp.empty((T * k, F), cp.float32)
        launch(self.mm, d_base, tiles, a, H, F, off_g, off_u, rb_g, 0, act, lx.gate.qtype)
        src = act if act_in is None else self.dev(act_in[order])
        y = cp.empty((T * k, H), cp.float32)
        launch(self.mm, d_base, tiles, self._halves(src), F, H, off_d, 0, rb_d, 1, y, lx.down.qtype)
        inv = np.empty(T * k, np.int64)
        inv[order] = np.arange(T * k)
        ysrc = y if y_in is None else self.dev(y_in[order])
        out = cp.empty((T, H), cp.float32)
        self.combine((T,), (256,), (ysrc, cp.asarray(inv.astype(np.int32)), self.dev(weights.reshape(-1)), out,
                                    np.int32(k), np.int32(H)))
        back = cp.asarray(inv)
        return act[back], y[back], out

    # decode ---------------------------------------------------------------------------------------
    def decode_attend(self, q_row, pos: int):
        """The one-token attention kernels for a query (heads, d) at ``pos`` over the cache (which
        holds keys and values 0 .. pos)."""
        gd, m = self.model.gd, self.model
        gd.q.set(np.ascontiguousarray(q_row, np.float32).reshape(-1))
        gd.attention(m.k_cache[self.l], m.v_cache[self.l], 0, pos + 1, float(m.kq_scale), None)
        return gd.o.get()  # (heads d,)


def compare(weights, tokens: int = 256, seed: int = 0, decode_positions=(1, 64, -1), blocks=None,
            progress=None, rows: list | None = None) -> list[dict]:
    """The stage records of one chunk of ``tokens`` random token ids (``seed``) through every block
    (or ``blocks``) of ``weights`` (module docstring), appended to ``rows`` (a new list by default)
    block by block; ``progress(str)`` gets a line per block."""
    import cupy as cp

    from .model import MoeModel

    why = supported(weights)
    if why:
        raise ValueError(f"prefill_precision: {why}")
    info = weights.info
    model = MoeModel(weights, use_gpu=True, max_tokens=tokens)
    if model.pd is None or model.gd is None:
        raise ValueError("prefill_precision: the chunk's dense path is off (MOELAB_PREFILL_DENSE=0) or has no GPU")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, info.vocab, tokens)
    x = _f64(weights.token_embd[ids]) * info.embedding_scale
    kq = float(model.kq_scale)
    dpos = sorted({p % tokens for p in decode_positions})
    rows = [] if rows is None else rows
    for l in range(info.num_layers):
        ref = reference_block(weights, l, x, kq)
        if blocks is None or l in blocks:
            block_records(rows, GpuBlock(model, l), l, ref, dpos)
            if progress is not None:
                progress(f"block {l}: " + ", ".join(
                    f"{r['path']} {r['mode']} {r['stage']} " + (f"{r['ratio_median']:.3g}" if "ratio_median" in r
                                                                else str(r.get("differ", r.get("error"))))
                    for r in rows if r["block"] == l))
        x = ref["out"]
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _guard(rows: list, l: int, path: str, mode: str, fn):
    """``fn()``, or a record of its error (the other stages still run)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a device run records what failed and goes on
        rows.append({"block": l, "path": path, "mode": mode, "stage": "error", "error": f"{type(exc).__name__}: {exc}"})
        return None


def block_records(rows: list, g, l: int, ref: dict, dpos: list[int]) -> None:
    """Append block ``l``'s records to ``rows``: ``g`` carries out the stages (:class:`GpuBlock`'s
    methods) on inputs ``ref`` (:func:`reference_block`); ``dpos``: the decode rows."""
    for mode in ("isolated", "chained"):
        hn = _guard(rows, l, "chunk", mode, lambda: _dense(rows, g, l, ref, mode))
        if hn is not None or mode == "isolated":
            _guard(rows, l, "chunk", mode, lambda: _experts(rows, g, l, ref, mode, hn))
    _guard(rows, l, "decode", "isolated", lambda: _decode(rows, g, l, ref, dpos))


def _bounds(g, ref: dict) -> dict:
    info, lx = g.info, g.lx
    H, hd, nh = info.hidden, info.head_dim, info.num_heads
    T, k = len(ref["x"]), ref["ids"].shape[1]
    return {"norm": norm_bound(H), "qkv": product_bound(H), "wo": product_bound(nh * hd),
            "rope": (6.0 + np.sqrt(hd) / 2) * U, "router": product_bound(H, halves=False),
            "att": (4.0 + ref["score_max"] * np.sqrt(hd) + np.sqrt(np.arange(1, T + 1))) * U,
            "gate_up": 2 * product_bound(H) + 4 * U, "down": product_bound(lx.ffn), "combine": (2.0 + np.sqrt(k)) * U}


def _dense(rows: list, g, l: int, ref: dict, mode: str):
    """The chunk's dense stages of block ``l``; -> the GPU's normed MoE input (chained) or the
    reference's (isolated), and the residual after attention."""
    info, f32, b = g.info, g.dev, _bounds(g, ref)
    iso = mode == "isolated"

    def take(name, got):  # a stage's input: the reference's (isolated) or the GPU's own (chained)
        return f32(ref[name]) if iso else got

    def rec(stage, got, want, bound):
        _record(rows, l, "chunk", mode, stage, got, want, bound)

    h = g.rms(f32(ref["x"]), "attn_norm")
    rec("attn_norm", _host(h), ref["h"], b["norm"])
    qkv = g.proj(take("h", h), "wqkv")
    rec("qkv", _host(qkv), ref["qkv"], b["qkv"])
    q, kc, vc = g.qk_rope(take("qkv", qkv))
    rec("q_norm_rope", _host(q), ref["q"], b["rope"])
    rec("k_norm_rope", _host(kc), ref["k"], b["rope"])
    if iso:
        o = g.attend(f32(ref["q"]), f32(ref["k"]), f32(ref["v"]))
    else:
        o = g.attend(q, kc, vc)
    rec("attention", _host(o), ref["o"], b["att"])
    att = g.proj(take("o", o), "wo")
    rec("wo", _host(att), ref["att"], b["wo"])
    x1 = take("x1", f32(ref["x"]) + att * np.float32(info.residual_scale))
    hn = g.rms(x1, "ffn_norm")
    rec("ffn_norm", _host(hn), ref["hn"], b["norm"])
    logits = g.proj(take("hn", hn), "router")
    rec("router_logits", _host(logits), ref["logits"], b["router"])
    routed = g.route(logits)
    k = ref["ids"].shape[1]
    sel = ref["sel"]
    margin = (np.take_along_axis(sel, ref["ids"][:, -1:], axis=1)[:, 0]
              - (np.sort(sel, axis=1)[:, -k - 1] if sel.shape[1] > k else 0.0))  # k-th minus (k+1)-th
    diff = (np.zeros(len(sel), bool) if routed is None
            else (np.sort(routed[0], axis=1) != np.sort(ref["ids"], axis=1)).any(axis=1))
    rows.append({"block": l, "path": "chunk", "mode": mode, "stage": "routes", "rows": int(len(sel)),
                 "device_route": routed is not None, "differ": int(diff.sum()), "min_margin": float(margin.min()),
                 "margins_of_differing": [float(v) for v in margin[diff][:8]]})
    return hn, x1


def _experts(rows: list, g, l: int, ref: dict, mode: str, dense) -> None:
    """The tiles and the combine of block ``l`` on the reference's routes."""
    info, f32, b = g.info, g.dev, _bounds(g, ref)
    iso = mode == "isolated"
    hn = f32(ref["hn"]) if iso else dense[0]
    act, y, moe = g.experts(hn, ref["ids"], np.asarray(ref["w"], np.float32), ref["act"] if iso else None,
                            ref["y"] if iso else None)
    _record(rows, l, "chunk", mode, "expert_gate_up", _host(act), ref["act"], b["gate_up"])
    _record(rows, l, "chunk", mode, "expert_down", _host(y), ref["y"], b["down"])
    _record(rows, l, "chunk", mode, "combine", _host(moe), ref["moe"], b["combine"])
    if not iso:
        out = dense[1] + moe * np.float32(info.residual_scale)
        _record(rows, l, "chunk", mode, "block_out", _host(out), ref["out"], product_bound(info.hidden))


def _decode(rows: list, g, l: int, ref: dict, dpos: list[int]) -> None:
    """Rows ``dpos`` of the reference's stage inputs through the one-token kernels (the cache holds
    the reference's keys and values)."""
    f32, b = g.dev, _bounds(g, ref)
    H = g.info.hidden
    g.set_cache(f32(ref["k"]), f32(ref["v"]))
    got = {"qkv": [], "attention": [], "wo": [], "router_logits": []}
    for p in dpos:
        got["qkv"].append(_host(g.proj(f32(ref["h"][p:p + 1]), "wqkv"))[0])
        got["attention"].append(g.decode_attend(ref["q"][p], p))
        got["wo"].append(_host(g.proj(f32(ref["o"][p:p + 1]), "wo"))[0])
        got["router_logits"].append(_host(g.proj(f32(ref["hn"][p:p + 1]), "router"))[0])
    bounds = {"qkv": product_bound(H, False), "attention": b["att"][dpos],
              "wo": product_bound(g.info.num_heads * g.info.head_dim, False), "router_logits": b["router"]}
    keys = {"qkv": "qkv", "attention": "o", "wo": "att", "router_logits": "logits"}
    for stage, vals in got.items():
        _record(rows, l, "decode", "isolated", stage, np.array(vals), ref[keys[stage]][dpos], bounds[stage])


def time_products(weights, tokens: int = 256, splits=(256, 0), reps: int = 20, seed: int = 0) -> list[dict]:
    """The chunk path's f16 products of block 0 (qkv, wo) and the head on ``tokens`` random rows,
    each K-slice of ``splits`` (``ChunkDense.split_k``; 0: one product) timed with CUDA events
    (median of ``reps`` calls, ms), side by side in one process."""
    import cupy as cp

    from .model import MoeModel

    model = MoeModel(weights, use_gpu=True, max_tokens=tokens)
    rng = np.random.default_rng(seed)
    out = []
    for name, m in (("qkv", model.layers[0]["wqkv"]), ("wo", model.layers[0]["wo"]), ("head", model.output)):
        x = cp.asarray(rng.standard_normal((tokens, m.cols)).astype(np.float32))
        for split in splits:
            model.pd.split_k = split
            for _ in range(3):
                model._proj(x, m)
            ev = [cp.cuda.Event() for _ in range(2 * reps)]
            for i in range(reps):
                ev[2 * i].record()
                model._proj(x, m)
                ev[2 * i + 1].record()
            ev[-1].synchronize()
            ms = [cp.cuda.get_elapsed_time(ev[2 * i], ev[2 * i + 1]) for i in range(reps)]
            out.append({"matrix": name, "rows": m.rows, "cols": m.cols, "tokens": tokens, "split_k": split,
                        "ms": float(np.median(ms))})
    return out


def table(rows: list[dict]) -> str:
    """The records as a fixed-width text table (routing rows as counts)."""
    out = [f"{'block':>5} {'path':6} {'mode':8} {'stage':15} {'rows':>5} {'rel median':>10} {'rel max':>10} "
           f"{'bound':>9} {'ratio med':>9} {'ratio max':>9}"]
    for r in rows:
        if r["stage"] == "error":
            out.append(f"{r['block']:>5} {r['path']:6} {r['mode']:8} error: {r['error'][:200]}")
            continue
        if r["stage"] == "routes":
            out.append(f"{r['block']:>5} {r['path']:6} {r['mode']:8} {'routes':15} {r['rows']:>5} "
                       f"differ {r['differ']}, smallest k-th margin {r['min_margin']:.3g}")
            continue
        out.append(f"{r['block']:>5} {r['path']:6} {r['mode']:8} {r['stage']:15} {r['rows']:>5} "
                   f"{r['rel_median']:>10.3g} {r['rel_max']:>10.3g} {r['bound_median']:>9.3g} "
                   f"{r['ratio_median']:>9.3g} {r['ratio_max']:>9.3g}")
    return "\n".join(out)
