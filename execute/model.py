"""The MoE forward pass of every supported architecture, written once against the array API
(``xp`` = numpy or cupy).

One decode step per token: embeddings, then per block RMSNorm -> attention (GQA with optional
biases, q/k norms, sinks and a sliding window; or deepseek2's MLA) -> residual -> RMSNorm ->
router -> routed experts (+ shared expert) -> residual, then the output norm and head. A dense
block (deepseek2's leading blocks) runs its SwiGLU FFN instead of the router. Prefill runs the same
way, one token at a time (a chunk of one; multi-token steps are a later issue). What differs between
architectures is read from ``info.spec`` (``execute.archs``) and the file's metadata.

The experts are not computed here. :meth:`MoeModel.token_steps` is a generator that yields one
scheduler :class:`~scheduler.core.Step` per MoE block (the router's top-k, or a trace's ids) and,
before resuming, expects the combined expert output of that block through :meth:`MoeModel.deliver`.
A :class:`scheduler.core.Token` whose ``steps`` is this generator is driven by ``scheduler.drive``:
the policy plans each step as it is routed, the executor (``execute.run``) runs the layer as
decided and delivers the output, and the generator continues with the next block. So routing is
computed lazily, and decisions are exactly the scheduler's.

Router: on the host in float64 from float32 logits, as ``execute.archs`` describes (ties: lower id
first). With a route override (trace replay) the trace's ids replace the top-k; the trace's weights
are used when it has them, else the router's own weights of those ids, computed the same way.

RoPE of type ``norm`` (pairs (2i, 2i+1)) is run as ``neox`` (pairs (i, i + d/2)) on q and k rows
permuted the same way inside each head at load time: attention scores are dot products of q and k,
so the shared permutation leaves them unchanged (the reference rotates the pairs directly).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from scheduler import Step

from .archs import rope_angles, yarn_mscale
from .experts import ExecutorError
from .gguf_io import ModelWeights

__all__ = ["MoeModel", "Qwen3Moe", "Route", "TokenInput", "RunResult", "NumpyExperts", "EngineExperts", "run",
           "check_trace", "fold_trace", "trace_inputs", "array_module", "softmax_topk", "route_weights",
           "expert_ffn"]


def array_module(use_gpu: bool):
    """numpy, or cupy when ``use_gpu`` (imported only then)."""
    if not use_gpu:
        return np
    try:
        import cupy
    except ImportError as exc:
        raise ExecutorError(f"use_gpu needs cupy ({exc}); install moelab[gpu] or run with --policy cpu") from None
    return cupy


def _host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def softmax_topk(probs: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` ids of a probability vector (descending, ties: lower id first) and their weights."""
    ids = np.argsort(-probs, kind="stable")[:k]
    w = probs[ids]
    return ids, (w / w.sum() if norm else w)


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _group_mask(scores: np.ndarray, groups: int, used: int) -> np.ndarray:
    """``scores`` with the experts outside the ``used`` best groups set to -inf; a group's score
    is the sum of its two best expert scores (llama.cpp / DeepSeek V3)."""
    g = scores.reshape(groups, -1)
    best = -np.sort(-g, axis=1)[:, : min(2, g.shape[1])].sum(axis=1)  # (groups,)
    keep = np.argsort(-best, kind="stable")[:used]
    out = np.full_like(g, -np.inf)
    out[keep] = g[keep]
    return out.reshape(-1)


def route_weights(info, logits: np.ndarray, exp_probs_b=None, forced: "Route | None" = None):
    """Expert ids (rank order) and weights of one token at one block from its router logits
    (float64, bias already added), by ``info.gating`` (see ``execute.archs``)."""
    if info.gating == "softmax":
        probs = _softmax(logits)
    elif info.gating == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:  # softmax_topk: select on the logits, softmax over the selected ones
        probs = logits
    if forced is not None:
        ids = np.asarray(forced.experts, dtype=np.int64)
        if forced.weights is not None:
            return ids, np.asarray(forced.weights, dtype=np.float64)
    else:
        sel = probs if exp_probs_b is None else probs + exp_probs_b
        if info.expert_groups > 1:
            sel = _group_mask(sel, info.expert_groups, info.expert_groups_used)
        ids = np.argsort(-sel, kind="stable")[: info.top_k]
    w = probs[ids]
    if info.gating == "softmax_topk":
        w = _softmax(w)
    if info.norm_topk:
        w = w / max(w.sum(), 6.103515625e-5)
    if info.expert_weights_scale:
        w = w * info.expert_weights_scale
    return ids, w


def expert_ffn(xp, activation: str, g, u):
    """The expert nonlinearity on gate and up projections (biases already added)."""
    if activation == "swiglu_oai":
        g = xp.minimum(g, 7.0)
        u = xp.clip(u, -7.0, 7.0)
        return g / (1.0 + xp.exp(-1.702 * g)) * (u + 1.0)
    return g / (1.0 + xp.exp(-g)) * u


@dataclass(frozen=True, slots=True)
class Route:
    """A forced routing for one block: expert ids in rank order, and weights when known."""

    experts: tuple[int, ...]
    weights: tuple[float, ...] | None = None


def _rope_perm(n_heads: int, hd: int, lo: int, rd: int) -> np.ndarray:
    """Row order that turns pairs (2i, 2i+1) of dims lo..lo+rd of each head into (i, i + rd/2)."""
    head = np.arange(hd)
    head[lo:lo + rd] = lo + np.concatenate([np.arange(0, rd, 2), np.arange(1, rd, 2)])
    return (np.arange(n_heads)[:, None] * hd + head[None, :]).reshape(-1)


class MoeModel:
    """Dense path and KV cache of a MoE model on ``xp``; experts come back through ``deliver``.

    State: the KV cache of the current sequence (``reset`` starts a new one) and ``pos``, the
    number of tokens in it. After a token's generator is exhausted, ``logits`` holds its
    ``(vocab,)`` output on ``xp``.
    """

    def __init__(self, weights: ModelWeights, use_gpu: bool = False, max_tokens: int = 256):
        info = weights.info
        self.spec = spec = info.spec
        self.xp = xp = array_module(use_gpu)
        self.info = info
        self.weights = weights
        self.mla = spec.attn == "mla"
        self.rd = info.rope_dims or info.head_dim
        if not self.mla and self.rd != info.head_dim:
            raise ExecutorError(f"{info.path}: rope.dimension_count {self.rd} != head_dim {info.head_dim} "
                                "(partial rotary embeddings are not supported)")
        self.token_embd = weights.token_embd  # stays on the host: one row per token is copied
        self._dev = lambda a: None if a is None else xp.asarray(a, dtype=xp.float32)  # noqa: E731
        self.layers = [self._dense_layer(l) for l in weights.layers]
        self.output_norm = self._dev(weights.output_norm)
        self.output = self._dev(weights.output)
        factor = info.rope_factor if info.rope_scaling == "yarn" else 1.0
        self.kq_scale = info.attn_scale or 1.0 / np.sqrt(info.head_dim)
        if self.mla:  # llama.cpp: rope magnitude 1, kq scaled by mscale^2 (DeepSeek's YaRN)
            self.rope_mag = 1.0
            self.kq_scale = yarn_mscale(factor, info.yarn_log_mul or 1.0) ** 2 / np.sqrt(info.head_dim)
        else:
            self.rope_mag = yarn_mscale(factor)
        self._alloc(max(int(max_tokens), 1))
        self.pos = 0
        self.logits = None
        self._out = None

    # weights -----------------------------------------------------------------------------------
    def _dense_layer(self, lw) -> dict:
        """Device weights of one block. GQA: q, k, v stacked into one matrix (biases likewise);
        per-head q/k norms tiled into one ``(heads + kv_heads, head_dim)`` weight."""
        info, dev, norm_rope = self.info, self._dev, self.spec.rope == "norm"
        w = {k: dev(getattr(lw, k)) for k in ("attn_norm", "wo", "ffn_norm", "router", "sinks")}
        w["bo"] = dev((lw.attn_bias or {}).get("o"))
        w["router_bias"] = None if lw.router_bias is None else np.asarray(lw.router_bias, np.float64)
        w["exp_probs_b"] = None if lw.exp_probs_b is None else np.asarray(lw.exp_probs_b, np.float64)
        w["shared"] = None if lw.shared is None else {k: dev(v) for k, v in lw.shared.items()}
        w["dense_ffn"] = None if lw.dense_ffn is None else {k: dev(v) for k, v in lw.dense_ffn.items()}
        if self.mla:
            w["mla"] = self._mla_weights(lw.mla, norm_rope)
            return w
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        pq = _rope_perm(nh, hd, 0, hd) if norm_rope else np.arange(nh * hd)
        pk = _rope_perm(nkv, hd, 0, hd) if norm_rope else np.arange(nkv * hd)
        w["wqkv"] = dev(np.concatenate([lw.wq[pq], lw.wk[pk], lw.wv]))  # (q + 2 kv, hidden)
        b = lw.attn_bias or {}
        if any(k in b for k in ("q", "k", "v")):
            z = lambda k, n: np.asarray(b[k]) if k in b else np.zeros(n, np.float32)  # noqa: E731
            w["bqkv"] = dev(np.concatenate([z("q", nh * hd)[pq], z("k", nkv * hd)[pk], z("v", nkv * hd)]))
        else:
            w["bqkv"] = None
        w["q_norm_full"] = w["k_norm_full"] = w["qk_norm"] = None
        if self.spec.qk_norm == "full":
            w["q_norm_full"], w["k_norm_full"] = dev(lw.q_norm[pq]), dev(lw.k_norm[pk])
        elif self.spec.qk_norm == "head":
            ph = _rope_perm(1, hd, 0, hd) if norm_rope else np.arange(hd)
            w["qk_norm"] = dev(np.concatenate([np.tile(lw.q_norm[ph], (nh, 1)), np.tile(lw.k_norm[ph], (nkv, 1))]))
        return w

    def _mla_weights(self, m: dict, norm_rope: bool) -> dict:
        info, dev = self.info, self._dev
        nh, hk, rd, kvr = info.num_heads, info.head_dim, self.rd, info.kv_lora_rank
        pq = _rope_perm(nh, hk, hk - rd, rd) if norm_rope else np.arange(nh * hk)
        pkv = _rope_perm(1, kvr + rd, kvr, rd) if norm_rope else np.arange(kvr + rd)
        out = {"kv_a": dev(m["kv_a"][pkv]), "kv_a_norm": dev(m["kv_a_norm"]), "kv_b": dev(m["kv_b"])}
        if "q" in m:
            out["q"] = dev(m["q"][pq])
        else:
            out.update(q_a=dev(m["q_a"]), q_a_norm=dev(m["q_a_norm"]), q_b=dev(m["q_b"][pq]))
        return out

    # state -------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> None:
        """KV cache for ``n`` positions per block, ``(kv_heads, n, head_dim)`` (MLA: per head, keys
        ``(heads, n, nope + rope)``, values ``(heads, n, v_head_dim)``), and RoPE tables."""
        xp, info = self.xp, self.info
        if self.mla:
            kshape, vshape = (info.num_heads, n, info.head_dim), (info.num_heads, n, info.v_head_dim)
        else:
            kshape = vshape = (info.num_kv_heads, n, info.head_dim)
        self.k_cache = [xp.zeros(kshape, xp.float32) for _ in range(info.num_layers)]
        self.v_cache = [xp.zeros(vshape, xp.float32) for _ in range(info.num_layers)]
        ang = rope_angles(np.arange(n), self.rd, info.rope_theta, info.rope_scaling, info.rope_factor,
                          info.rope_orig_ctx)  # (n, rd/2)
        m = self.rope_mag
        self.rope_cos = xp.asarray(m * np.concatenate([np.cos(ang), np.cos(ang)], axis=1), dtype=xp.float32)  # (n, rd)
        self.rope_sin = xp.asarray(m * np.concatenate([-np.sin(ang), np.sin(ang)], axis=1), dtype=xp.float32)

    def _grow(self) -> None:
        old_k, old_v, n = self.k_cache, self.v_cache, self.k_cache[0].shape[1]
        self._alloc(2 * n)
        for l in range(self.info.num_layers):
            self.k_cache[l][:, :n] = old_k[l]
            self.v_cache[l][:, :n] = old_v[l]

    def reset(self) -> None:
        """Start a new sequence (the KV cache is reused, its contents ignored)."""
        self.pos = 0
        self.logits = None

    def deliver(self, y) -> None:
        """The combined expert output ``(hidden,)`` of the block the generator last yielded."""
        self._out = y

    # pieces ------------------------------------------------------------------------------------
    def _rms(self, x, w):
        xp = self.xp
        return x * (1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + self.info.rms_eps)) * w

    def _rope(self, x, pos: int):
        """NeoX RoPE on the last axis: dims i and i + d/2 form a pair."""
        h = x.shape[-1] // 2
        swapped = self.xp.concatenate([x[..., h:], x[..., :h]], axis=-1)  # (x2, x1)
        return x * self.rope_cos[pos] + swapped * self.rope_sin[pos]  # (x1 c - x2 s, x2 c + x1 s)

    def _softmax_attend(self, l: int, q, keys, vals):
        """q (kv, group, d) against keys (kv, t, d): softmax (with sinks) -> (kv, group, dv)."""
        xp, w = self.xp, self.layers[l]
        s = (q @ keys.transpose(0, 2, 1)) * np.float32(self.kq_scale)  # (kv, group, t)
        m = s.max(axis=-1, keepdims=True)
        if w["sinks"] is not None:
            sink = w["sinks"].reshape(q.shape[0], q.shape[1], 1)
            m = xp.maximum(m, sink)
            e = xp.exp(s - m)
            return (e @ vals) / (e.sum(axis=-1, keepdims=True) + xp.exp(sink - m))
        e = xp.exp(s - m)
        return (e @ vals) / e.sum(axis=-1, keepdims=True)

    def _attention(self, l: int, x):
        info, w, pos = self.info, self.layers[l], self.pos
        nh, nkv, hd = info.num_heads, info.num_kv_heads, info.head_dim
        qkv = w["wqkv"] @ x  # (q + 2 kv,)
        if w["bqkv"] is not None:
            qkv = qkv + w["bqkv"]
        if w["q_norm_full"] is not None:
            qk = self.xp.concatenate([self._rms(qkv[: nh * hd], w["q_norm_full"]),
                                      self._rms(qkv[nh * hd:(nh + nkv) * hd], w["k_norm_full"])])
            qk = qk.reshape(nh + nkv, hd)
        else:
            qk = qkv[: (nh + nkv) * hd].reshape(nh + nkv, hd)
        if w["qk_norm"] is not None:
            qk = self._rms(qk, w["qk_norm"])
        qk = self._rope(qk, pos)  # (heads + kv, hd)
        self.k_cache[l][:, pos] = qk[nh:]
        self.v_cache[l][:, pos] = qkv[(nh + nkv) * hd:].reshape(nkv, hd)
        lo = max(0, pos + 1 - info.sliding_window) if info.is_swa(l) else 0
        q = qk[:nh].reshape(nkv, nh // nkv, hd)  # (kv, group, hd)
        o = self._softmax_attend(l, q, self.k_cache[l][:, lo: pos + 1], self.v_cache[l][:, lo: pos + 1])
        y = w["wo"] @ o.reshape(nh * hd)
        return y if w["bo"] is None else y + w["bo"]

    def _attention_mla(self, l: int, x):
        """deepseek2 attention, keys and values decompressed per head (no absorption)."""
        xp, info, m, pos = self.xp, self.info, self.layers[l]["mla"], self.pos
        nh, hk, rd, kvr, vd = info.num_heads, info.head_dim, self.rd, info.kv_lora_rank, info.v_head_dim
        nope = hk - rd
        q = m["q"] @ x if "q" in m else m["q_b"] @ self._rms(m["q_a"] @ x, m["q_a_norm"])
        q = q.reshape(nh, hk)
        kva = m["kv_a"] @ x  # (kv_lora + rd,)
        kv = (m["kv_b"] @ self._rms(kva[:kvr], m["kv_a_norm"])).reshape(nh, nope + vd)
        k_pe = self._rope(kva[kvr:].reshape(1, rd), pos)  # (1, rd)
        q = xp.concatenate([q[:, :nope], self._rope(q[:, nope:], pos)], axis=1)  # (nh, hk)
        self.k_cache[l][:, pos] = xp.concatenate([kv[:, :nope], xp.broadcast_to(k_pe, (nh, rd))], axis=1)
        self.v_cache[l][:, pos] = kv[:, nope:]
        o = self._softmax_attend(l, q.reshape(nh, 1, hk), self.k_cache[l][:, : pos + 1], self.v_cache[l][:, : pos + 1])
        return self.layers[l]["wo"] @ o.reshape(nh * vd)

    def _route(self, l: int, hn, forced: Route | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
        w = self.layers[l]
        logits = _host(w["router"] @ hn).astype(np.float64)  # (experts,): the host needs the ids
        if w["router_bias"] is not None:
            logits = logits + w["router_bias"]
        ids, wts = route_weights(self.info, logits, w["exp_probs_b"], forced)
        return tuple(int(i) for i in ids), tuple(float(v) for v in wts)

    def _ffn(self, f: dict, hn):
        g = f["gate"] @ hn
        return f["down"] @ (g / (1.0 + self.xp.exp(-g)) * (f["up"] @ hn))

    def _shared(self, l: int, hn):
        sh = self.layers[l]["shared"]
        if sh is None:
            return 0.0
        y = self._ffn(sh, hn)
        if sh.get("gate_inp") is not None:
            y = y / (1.0 + self.xp.exp(-(sh["gate_inp"] @ hn)))
        return y

    # the token ---------------------------------------------------------------------------------
    def token_steps(self, token_id: int, routes: Sequence[Route | None] | None = None) -> Iterator[Step]:
        """Run token ``token_id`` at position ``pos``; yield each MoE block's Step (see the module
        docstring); ``self.last_input`` holds the block's normed input ``(hidden,)`` meanwhile.

        ``routes[l]`` forces block l's routing (None: the router's own)."""
        xp, info = self.xp, self.info
        if not 0 <= token_id < info.vocab:
            raise ExecutorError(f"token id {token_id} out of range 0..{info.vocab - 1}")
        if self.pos >= self.k_cache[0].shape[1]:
            self._grow()
        rs = np.float32(info.residual_scale)
        x = xp.asarray(self.token_embd[token_id], dtype=xp.float32) * np.float32(info.embedding_scale)  # (hidden,)
        for l in range(info.num_layers):
            w = self.layers[l]
            h = self._rms(x, w["attn_norm"])
            x = x + rs * (self._attention_mla(l, h) if self.mla else self._attention(l, h))
            hn = self._rms(x, w["ffn_norm"])
            if w["router"] is None:
                x = x + rs * self._ffn(w["dense_ffn"], hn)
                continue
            ids, weights = self._route(l, hn, None if routes is None else routes[l])
            self.last_input = hn
            self._out = None
            yield Step(l, ids, None, weights)
            if self._out is None:
                raise ExecutorError(f"block {l}: no expert output was delivered for the step")
            x = x + rs * (self._out + self._shared(l, hn))
        self.logits = (self.output @ self._rms(x, self.output_norm)) / np.float32(info.logit_scale)  # (vocab,)
        self.pos += 1


Qwen3Moe = MoeModel  # the first architecture's name, kept for existing callers


# expert backends without a GPU -------------------------------------------------------------------
def _cpu_only(item) -> None:
    d = item.decision
    if d.hits or d.uploads or d.streams or d.promotions:
        raise ExecutorError(f"layer {d.layer}: the policy put experts on the GPU (hits {len(d.hits)}, uploads "
                            f"{len(d.uploads)}, streams {len(d.streams)}); without a GPU only policy 'cpu' runs")


class NumpyExperts:
    """Reference expert backend: dequantizes each expert (``gguf_io.dequantize``) and runs it in
    float32 numpy, with the architecture's activation and expert biases. CPU-only: a decision that
    puts experts on the GPU is an error."""

    def __init__(self, weights: ModelWeights):
        self.experts = weights.experts
        self.bias = [l.expert_bias or {} for l in weights.layers]
        self.activation = weights.info.spec.activation

    def _expert(self, t, e: int) -> np.ndarray:
        from .gguf_io import dequantize

        return dequantize(t.data[e], t.qtype).reshape(t.rows, t.cols)

    def run_layer(self, item, x, weights: Sequence[float]):
        """Combined output ``sum_i w_i * expert_i(x)`` of the step's experts, ``(hidden,)``."""
        _cpu_only(item)
        l = item.step.layer
        layer, b = self.experts[l], self.bias[l]
        xh = _host(x).astype(np.float32)
        y = np.zeros(layer.hidden, np.float32)
        for e, w in zip(item.step.experts, weights):
            g, u = self._expert(layer.gate, e) @ xh, self._expert(layer.up, e) @ xh
            if b:
                g, u = g + b["gate"][e], u + b["up"][e]
            d = self._expert(layer.down, e) @ expert_ffn(np, self.activation, g, u)
            y += np.float32(w) * (d + b["down"][e] if b else d)
        return y

    def start_background(self, moves) -> None:
        if moves:
            raise ExecutorError("background copies need a GPU; without a GPU only policy 'cpu' runs")

    def await_background(self, moves) -> None:
        pass

    def close(self) -> None:
        pass


class EngineExperts:
    """The expert engine (``execute.engine.ExpertEngine``: GPU arena and kernels, Numba CPU pool) as
    a ``run`` backend; one token per step (decode, and prefill in chunks of one)."""

    def __init__(self, weights: ModelWeights, capacity, threads: int, use_gpu: bool, timeout_s: float = 60.0):
        info = weights.info
        if info.spec.activation != "silu" or info.expert_bias:
            raise ExecutorError(
                f"{info.path}: {info.arch} experts use {info.spec.activation} with expert biases; the expert kernels "
                "(CPU pool and GPU) compute silu(gate x) * (up x) without biases, so this architecture runs only "
                "with the numpy expert backend (--backend numpy, policy cpu)")
        if use_gpu:
            array_module(True)  # a clear error when cupy is missing
        from threadpoolctl import threadpool_limits

        from .engine import ExpertEngine

        self.engine = ExpertEngine(weights.experts, capacity, threads, use_gpu, timeout_s)
        self._first = next((l for l in weights.experts if l is not None), None)
        # numpy's BLAS threads spin-wait after each dense product and starve the Numba pool's
        # thread team (a 2-core layer call went from 0.5 ms to 19 ms); one-token products gain
        # nothing from BLAS threads, so they are limited to one while this backend lives.
        self._blas = threadpool_limits(limits=1, user_api="blas")

    def prepare(self, policy) -> None:
        """Compile the CPU kernels (first use) and upload the experts the policy placed at
        construction (profile pre-population, or all of them for ``gpu``)."""
        if self._first is not None:
            self.engine.pool.warmup(self._first)
        self.engine.load_residents(dict(policy.cache.slot))

    def run_layer(self, item, x, weights: Sequence[float]):
        ids = np.asarray([item.step.experts], dtype=np.int64)  # (1, k)
        w = np.asarray([weights], dtype=np.float32)  # (1, k)
        y = self.engine.run_layer(item, x.reshape(1, -1), ids, w)[0]
        if self.engine.gpu is not None:
            # the next block's router reads back to the host and would wait for this anyway;
            # waiting here charges the layer's GPU expert work to "experts", not to "dense"
            self.engine.gpu.compute.synchronize()
        return y

    def start_background(self, moves) -> None:
        self.engine.start_background(moves)

    def await_background(self, moves) -> None:
        self.engine.await_background(moves)

    def close(self) -> None:
        self.engine.close()
        self._blas.restore_original_limits()


# the driver loop ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenInput:
    """One token to run: its trace identity, the input token id, and optional forced routes."""

    index: int
    seq: int
    pos: int
    phase: str
    token_id: int
    routes: tuple | None = None  # per block: Route or None


@dataclass
class RunResult:
    """What a run measured. Times are host wall-clock seconds, summed over tokens."""

    audit: object
    tokens: int
    wall_s: float
    dense_s: np.ndarray  # (layers,) attention + router, per block
    experts_s: np.ndarray  # (layers,) the backend's run_layer, per block
    other_s: float  # head, background starts and waits, bookkeeping
    logits: list  # host (vocab,) arrays when kept

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        per = max(self.tokens, 1)
        return {"tokens": self.tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "dense_ms_per_token": 1e3 * float(self.dense_s.sum()) / per,
                "experts_ms_per_token": 1e3 * float(self.experts_s.sum()) / per,
                "other_ms_per_token": 1e3 * self.other_s / per,
                "per_layer_ms_per_token": [{"layer": l, "dense": 1e3 * float(d) / per, "experts": 1e3 * float(e) / per}
                                           for l, (d, e) in enumerate(zip(self.dense_s, self.experts_s))]}


def _tokens(model: MoeModel, inputs) -> Iterator:
    """scheduler Tokens whose steps run the model lazily; a new sequence resets the KV cache."""
    from scheduler import Token

    seq = None
    for t in inputs:
        if t.seq != seq or t.pos == 0:
            model.reset()
            seq = t.seq
        yield Token(t.index, t.seq, t.pos, t.phase, model.token_steps(t.token_id, t.routes))


def run(model: MoeModel, backend, policy, inputs, lag_tokens: int = 1, audit=None,
        keep_logits: bool = False, progress=None) -> RunResult:
    """Drive ``policy`` over ``inputs`` (TokenInputs) with real compute: the model's dense path and
    ``backend`` for the experts (``run_layer(item, x, weights) -> y``, ``start_background``,
    ``await_background``, optionally ``prepare(policy)`` before the first item). Every driver item is also given to ``audit`` (an ``Audit``) if any."""
    import time

    from scheduler import drive
    from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground

    n_layers = model.info.num_layers
    dense, experts = np.zeros(n_layers), np.zeros(n_layers)
    logits, tokens = [], 0
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(policy)
    t0 = mark = time.perf_counter()
    other = 0.0
    for item in drive(policy, _tokens(model, inputs), lag_tokens):
        now = time.perf_counter()
        kind = type(item)
        if kind is RunLayer:
            l = item.step.layer
            dense[l] += now - mark
            y = backend.run_layer(item, model.last_input, item.step.weights)
            model.deliver(y)
            mark = time.perf_counter()
            experts[l] += mark - now
        else:
            other += now - mark
            if kind is StartBackground:
                backend.start_background(item.moves)
            elif kind is AwaitBackground:
                backend.await_background(item.moves)
            elif kind is EndToken:
                tokens += 1
                if keep_logits:
                    logits.append(_host(model.logits).copy())
                if progress is not None:
                    progress(tokens)
            mark = time.perf_counter()
            other += mark - now
        if audit is not None:
            audit.observe(item)
    return RunResult(audit, tokens, time.perf_counter() - t0, dense, experts, other, logits)


# traces --------------------------------------------------------------------------------------------
def check_trace(trace, info) -> None:
    """Raise ExecutorError unless ``trace`` routes this model's geometry exactly."""
    if tuple(trace.num_experts) != tuple(info.num_experts) or trace.top_k != info.top_k:
        raise ExecutorError(
            f"trace geometry ({trace.num_layers} layers, experts {_short(trace.num_experts)}, top-{trace.top_k}) "
            f"differs from the model's {info.path} ({info.num_layers} layers, experts {_short(info.num_experts)}, "
            f"top-{info.top_k}); pass --map to fold the trace's layer and expert ids onto the model")


def _short(ns) -> str:
    ns = list(ns)
    return f"{ns[0]} x {len(ns)}" if len(set(ns)) == 1 else str(ns)


def fold_trace(trace, info):
    """A trace of the model's geometry made from another one (``--map``).

    Model block ``m`` takes the trace's layer ``m % L_trace``; each expert id ``e`` becomes
    ``e % E_model``; duplicates that folding creates are dropped (first in rank order kept), and
    the first ``top_k`` (the model's) remaining ids are kept. Weights, when the trace has them,
    follow their ids and are renormalised to sum 1 over the kept ids when the model renormalises
    its top-k. Sequence, position and phase are unchanged."""
    from traces import Trace

    lt = trace.num_layers
    src = [m % lt for m in range(info.num_layers)]
    ids = np.asarray(trace.expert_ids)[:, src, :].astype(np.int64)  # (T, L, k_t)
    e_model = np.asarray(info.num_experts, dtype=np.int64)[None, :, None]
    ids = np.where((ids >= 0) & (e_model > 0), ids % np.maximum(e_model, 1), -1)
    for j in range(1, ids.shape[2]):
        dup = (ids[:, :, :j] == ids[:, :, j:j + 1]).any(axis=2)
        ids[:, :, j][dup] = -1
    order = np.argsort(ids < 0, axis=2, kind="stable")  # valid ids first, rank order kept
    k = min(info.top_k, ids.shape[2])
    ids = np.take_along_axis(ids, order, axis=2)[:, :, :k]
    weights = None
    if trace.weights is not None:
        w = np.take_along_axis(np.asarray(trace.weights, dtype=np.float64)[:, src, :], order, axis=2)[:, :, :k]
        w = np.where(ids >= 0, w, np.nan)
        if info.norm_topk:
            w = w / np.nansum(w, axis=2, keepdims=True)
        weights = w.astype(np.float32)
    meta = dict(trace.meta, folded_from=trace.model)
    return Trace(f"{trace.model} folded onto {Path(info.path).name}", info.num_experts, k, ids, trace.seq,
                 trace.pos, trace.phase, weights, meta)


def trace_inputs(trace, info, phase: str | None = None, start: int = 0, limit: int | None = None,
                 seed: int = 0) -> Iterator[TokenInput]:
    """TokenInputs replaying ``trace`` rows: routes forced to the trace's steps (a block the row
    does not route uses the model's router), input token ids drawn uniformly from the vocabulary
    by ``np.random.default_rng(seed)`` (a trace holds routing, not text)."""
    rng = np.random.default_rng(seed)
    for tok in trace.tokens(phase, start, limit):
        routes = [None] * info.num_layers
        for s in tok.steps:
            routes[s.layer] = Route(s.experts, s.weights)
        yield TokenInput(tok.index, tok.seq, tok.pos, tok.phase, int(rng.integers(info.vocab)), tuple(routes))

