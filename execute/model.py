"""The qwen3moe forward pass, written once against the array API (``xp`` = numpy or cupy).

One decode step per token: a token runs embeddings, then per block RMSNorm -> attention (GQA,
per-head q/k RMSNorm, NeoX RoPE, KV cache) -> residual -> RMSNorm -> router -> routed experts ->
residual, then the output norm and head. Prefill runs the same way, one token at a time (a chunk of
one; multi-token steps are a later issue).

The experts are not computed here. :meth:`Qwen3Moe.token_steps` is a generator that yields one
scheduler :class:`~scheduler.core.Step` per MoE block (the router's top-k, or a trace's ids) and,
before resuming, expects the combined expert output of that block through :meth:`Qwen3Moe.deliver`.
A :class:`scheduler.core.Token` whose ``steps`` is this generator is driven by ``scheduler.drive``:
the policy plans each step as it is routed, the executor (``execute.run``) runs the layer as
decided and delivers the output, and the generator continues with the next block. So routing is
computed lazily, and decisions are exactly the scheduler's.

Router: softmax over the block's experts (on the host, float64, from float32 logits), top-k by probability (ties: lower id first),
weights renormalised to sum 1 when ``info.norm_topk`` (qwen3moe: yes). With a route override (trace
replay) the trace's ids replace the top-k; the trace's weights are used when it has them, else the
router's own probabilities of those ids, renormalised the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from scheduler import Step

from .experts import ExecutorError
from .gguf_io import ModelWeights

__all__ = ["Qwen3Moe", "Route", "TokenInput", "RunResult", "NumpyExperts", "EngineExperts", "run", "check_trace", "fold_trace", "trace_inputs", "array_module", "softmax_topk"]


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


@dataclass(frozen=True, slots=True)
class Route:
    """A forced routing for one block: expert ids in rank order, and weights when known."""

    experts: tuple[int, ...]
    weights: tuple[float, ...] | None = None


class Qwen3Moe:
    """Dense path and KV cache of a qwen3moe model on ``xp``; experts come back through ``deliver``.

    State: the KV cache of the current sequence (``reset`` starts a new one) and ``pos``, the
    number of tokens in it. After a token's generator is exhausted, ``logits`` holds its
    ``(vocab,)`` output on ``xp``.
    """

    def __init__(self, weights: ModelWeights, use_gpu: bool = False, max_tokens: int = 256):
        info = weights.info
        if info.arch != "qwen3moe":
            raise ExecutorError(f"{info.path}: architecture {info.arch!r}, this forward pass is qwen3moe's")
        if info.expert_bias:
            raise ExecutorError(f"{info.path}: routed-expert biases are not supported by the expert kernels yet")
        self.xp = xp = array_module(use_gpu)
        self.info = info
        self.weights = weights
        self.token_embd = weights.token_embd  # stays on the host: one row per token is copied
        dev = lambda a: None if a is None else xp.asarray(a, dtype=xp.float32)  # noqa: E731
        self.layers = [self._dense_layer(l, dev) for l in weights.layers]
        self.shared = [None if l.shared is None else {k: dev(v) for k, v in l.shared.items()} for l in weights.layers]
        self.output_norm = dev(weights.output_norm)
        self.output = dev(weights.output)
        hd = info.head_dim
        self.inv_freq = info.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)  # (hd/2,)
        self._alloc(max(int(max_tokens), 1))
        self.pos = 0
        self.logits = None
        self._out = None

    def _dense_layer(self, l, dev) -> dict:
        """Device weights of one block; q, k, v stacked into one matrix, q/k norms into one
        ``(heads + kv_heads, head_dim)`` weight so that both are normed and rotated in one go."""
        info = self.info
        w = {k: dev(getattr(l, k)) for k in ("attn_norm", "wo", "ffn_norm", "router")}
        w["wqkv"] = dev(np.concatenate([l.wq, l.wk, l.wv]))  # (q + 2 kv, hidden)
        w["qk_norm"] = None if l.q_norm is None else dev(np.concatenate(
            [np.tile(l.q_norm, (info.num_heads, 1)), np.tile(l.k_norm, (info.num_kv_heads, 1))]))
        return w

    # state -------------------------------------------------------------------------------------
    def _alloc(self, n: int) -> None:
        """KV cache for ``n`` positions, ``(kv_heads, n, head_dim)`` per block, and RoPE tables."""
        xp, info = self.xp, self.info
        shape = (info.num_kv_heads, n, info.head_dim)
        self.k_cache = [xp.zeros(shape, xp.float32) for _ in range(info.num_layers)]
        self.v_cache = [xp.zeros(shape, xp.float32) for _ in range(info.num_layers)]
        ang = np.arange(n)[:, None] * self.inv_freq[None, :]  # (n, hd/2)
        self.rope_cos = xp.asarray(np.concatenate([np.cos(ang), np.cos(ang)], axis=1), dtype=xp.float32)  # (n, hd)
        self.rope_sin = xp.asarray(np.concatenate([-np.sin(ang), np.sin(ang)], axis=1), dtype=xp.float32)

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
        """NeoX RoPE: dims i and i + d/2 form a pair rotated by pos * theta^(-2i/d)."""
        h = x.shape[-1] // 2
        swapped = self.xp.concatenate([x[..., h:], x[..., :h]], axis=-1)  # (x2, x1)
        return x * self.rope_cos[pos] + swapped * self.rope_sin[pos]  # (x1 c - x2 s, x2 c + x1 s)

    def _attention(self, l: int, x):
        xp, info, w = self.xp, self.info, self.layers[l]
        nh, nkv, hd, pos = info.num_heads, info.num_kv_heads, info.head_dim, self.pos
        qkv = (w["wqkv"] @ x).reshape(nh + 2 * nkv, hd)  # rows: q heads, k heads, v heads
        qk = qkv[: nh + nkv]
        if w["qk_norm"] is not None:
            qk = self._rms(qk, w["qk_norm"])
        qk = self._rope(qk, pos)  # (heads + kv, hd)
        self.k_cache[l][:, pos] = qk[nh:]
        self.v_cache[l][:, pos] = qkv[nh + nkv:]
        q = qk[:nh].reshape(nkv, nh // nkv, hd)  # (kv, group, hd)
        keys, vals = self.k_cache[l][:, : pos + 1], self.v_cache[l][:, : pos + 1]  # (kv, t, hd)
        s = (q @ keys.transpose(0, 2, 1)) * np.float32(1.0 / np.sqrt(hd))  # (kv, group, t)
        s = xp.exp(s - s.max(axis=-1, keepdims=True))
        o = ((s / s.sum(axis=-1, keepdims=True)) @ vals).reshape(nh * hd)  # (kv, group, hd) -> (q,)
        return w["wo"] @ o

    def _route(self, l: int, hn, forced: Route | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
        logits = _host(self.layers[l]["router"] @ hn).astype(np.float64)  # (experts,): the host needs the ids
        e = np.exp(logits - logits.max())
        probs = e / e.sum()
        if forced is None:
            ids, w = softmax_topk(probs, self.info.top_k, self.info.norm_topk)
        else:
            ids = np.asarray(forced.experts, dtype=np.int64)
            if forced.weights is not None:
                w = np.asarray(forced.weights, dtype=np.float64)
            else:
                w = probs[ids]
                w = w / w.sum() if self.info.norm_topk else w
        return tuple(int(i) for i in ids), tuple(float(v) for v in w)

    def _shared(self, l: int, hn):
        sh = self.shared[l]
        if sh is None:
            return 0.0
        xp = self.xp
        g = sh["gate"] @ hn
        y = sh["down"] @ (g / (1.0 + xp.exp(-g)) * (sh["up"] @ hn))
        if sh.get("gate_inp") is not None:
            y = y / (1.0 + xp.exp(-(sh["gate_inp"] @ hn)))
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
        x = xp.asarray(self.token_embd[token_id], dtype=xp.float32)  # (hidden,)
        for l in range(info.num_layers):
            w = self.layers[l]
            x = x + self._attention(l, self._rms(x, w["attn_norm"]))
            hn = self._rms(x, w["ffn_norm"])
            if w["router"] is None:
                raise ExecutorError(f"block {l} is dense; dense FFN blocks are not supported by qwen3moe")
            ids, weights = self._route(l, hn, None if routes is None else routes[l])
            self.last_input = hn
            self._out = None
            yield Step(l, ids, None, weights)
            if self._out is None:
                raise ExecutorError(f"block {l}: no expert output was delivered for the step")
            x = x + self._out + self._shared(l, hn)
        self.logits = self.output @ self._rms(x, self.output_norm)  # (vocab,)
        self.pos += 1


# expert backends without a GPU -------------------------------------------------------------------
def _cpu_only(item) -> None:
    d = item.decision
    if d.hits or d.uploads or d.streams or d.promotions:
        raise ExecutorError(f"layer {d.layer}: the policy put experts on the GPU (hits {len(d.hits)}, uploads "
                            f"{len(d.uploads)}, streams {len(d.streams)}); without a GPU only policy 'cpu' runs")


class NumpyExperts:
    """Reference expert backend: dequantizes each expert (``gguf_io.dequantize``) and runs it in
    float32 numpy. CPU-only: a decision that puts experts on the GPU is an error."""

    def __init__(self, weights: ModelWeights):
        self.experts = weights.experts

    def _expert(self, t, e: int) -> np.ndarray:
        from .gguf_io import dequantize

        return dequantize(t.data[e], t.qtype).reshape(t.rows, t.cols)

    def run_layer(self, item, x, weights: Sequence[float]):
        """Combined output ``sum_i w_i * expert_i(x)`` of the step's experts, ``(hidden,)``."""
        _cpu_only(item)
        layer = self.experts[item.step.layer]
        xh = _host(x).astype(np.float32)
        y = np.zeros(layer.hidden, np.float32)
        for e, w in zip(item.step.experts, weights):
            g, u = self._expert(layer.gate, e) @ xh, self._expert(layer.up, e) @ xh
            y += np.float32(w) * (self._expert(layer.down, e) @ (g / (1.0 + np.exp(-g)) * u))
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
        if use_gpu:
            array_module(True)  # a clear error when cupy is missing
        from .engine import ExpertEngine

        self.engine = ExpertEngine(weights.experts, capacity, threads, use_gpu, timeout_s)
        self._first = next((l for l in weights.experts if l is not None), None)

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


def _tokens(model: Qwen3Moe, inputs) -> Iterator:
    """scheduler Tokens whose steps run the model lazily; a new sequence resets the KV cache."""
    from scheduler import Token

    seq = None
    for t in inputs:
        if t.seq != seq or t.pos == 0:
            model.reset()
            seq = t.seq
        yield Token(t.index, t.seq, t.pos, t.phase, model.token_steps(t.token_id, t.routes))


def run(model: Qwen3Moe, backend, policy, inputs, lag_tokens: int = 1, audit=None,
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

