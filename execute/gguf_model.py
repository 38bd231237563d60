"""A GGUF model's weights: dense weights as float32, routed experts as raw blocks on the memory map.

Built on ``execute.gguf_io`` (the model's metadata and the one module that imports gguf). Shapes
are numpy order (the reversed-dims trap: ``execute.gguf_io``'s docstring).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from . import quant as Q
from .experts import ExpertTensor, LayerExperts
from .gguf_file import GGUFError, GGUFFile, TensorEntry
from .gguf_io import ModelInfo, _expert_names, _info_from_reader

__all__ = ["DenseLayer", "ModelWeights", "StoredDense", "load_model", "stored_matrix"]


class StoredDense:
    """A 2-D dense matrix left as the file stores it (rows of raw bytes on the memory map),
    dequantized to float32 only when read: ``np.asarray(m)`` gives every row, ``m[rows]`` (an int, a
    slice or an index array over the rows) only those. ``load_model(lazy_dense=True)`` gives the
    large matrices this way, so a GPU run, whose kernels read them as stored, never expands them
    (and a token's embedding costs one row). Nothing is cached: each read dequantizes again."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, raw: np.ndarray, qtype: int, shape: tuple[int, int]):
        self.raw, self.qtype, self.shape = raw.reshape(shape[0], -1), qtype, (int(shape[0]), int(shape[1]))

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __len__(self) -> int:
        return self.shape[0]

    def _rows(self, raw: np.ndarray) -> np.ndarray:
        return Q.dequantize(raw, self.qtype, self.shape[1]).reshape(-1, self.shape[1])

    def __array__(self, dtype=None, copy=None):
        w = self._rows(self.raw)
        return w if dtype is None else w.astype(dtype, copy=False)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self._rows(self.raw[idx])[0]
        if isinstance(idx, slice) or (not isinstance(idx, tuple) and np.ndim(idx) == 1):
            return self._rows(np.ascontiguousarray(self.raw[idx]))
        return np.asarray(self)[idx]


@dataclass(frozen=True)
class DenseLayer:
    """One block's non-expert weights, float32, numpy order (``W`` is ``(out, in)``)."""

    attn_norm: np.ndarray  # (hidden,)
    wq: np.ndarray | None  # (heads*head_dim, hidden); None with MLA
    wk: np.ndarray | None  # (kv_heads*head_dim, hidden)
    wv: np.ndarray | None  # (kv_heads*head_dim, hidden)
    wo: np.ndarray  # (hidden, heads*head_dim)
    q_norm: np.ndarray | None  # (head_dim,), or (heads*head_dim,) for a full-width norm (olmoe)
    k_norm: np.ndarray | None  # (head_dim,), or (kv_heads*head_dim,)
    ffn_norm: np.ndarray  # (hidden,)
    router: np.ndarray | None  # (experts, hidden); None on a dense block
    shared: dict | None = None  # gate (sf, hidden), up (sf, hidden), down (hidden, sf), gate_inp (hidden,) or None
    expert_bias: dict | None = None  # gate/up (experts, ffn), down (experts, hidden) when present
    dense_ffn: dict | None = None  # gate/up/down of a dense block
    attn_bias: dict | None = None  # q (heads*head_dim,), k, v (kv*head_dim,), o (hidden,): those present
    sinks: np.ndarray | None = None  # (heads,) attention-sink logits (gpt-oss)
    router_bias: np.ndarray | None = None  # (experts,) added to the router logits (gpt-oss)
    exp_probs_b: np.ndarray | None = None  # (experts,) selection-only bias (deepseek V3)
    mla: dict | None = None  # deepseek2: q or q_a/q_a_norm/q_b, kv_a, kv_a_norm, kv_b (heads*(nope+v), kv_lora)


@dataclass(frozen=True)
class ModelWeights:
    """A loaded model: float32 dense weights and raw routed experts (views on the memory map)."""

    info: ModelInfo
    token_embd: np.ndarray  # (vocab, hidden)
    output_norm: np.ndarray  # (hidden,)
    output: np.ndarray  # (vocab, hidden); token_embd when the output is tied
    layers: tuple[DenseLayer, ...]
    experts: tuple[LayerExperts | None, ...]  # per block; None on a dense block
    reader: GGUFFile | None = field(repr=False, default=None)  # keeps the memory map alive


def _expert_tensor(reader: GGUFFile, t: TensorEntry, part: str, ffn: int, keep) -> ExpertTensor:
    """Routed-expert projection ``part`` (gate/up/down) from tensor ``t``, its bytes as uint8
    ``(experts, bytes_per_expert)``: a view on the map when its type is in ``keep``, else its
    weights dequantized to F16 (a copy).

    A fused gate-up tensor is numpy ``(experts, 2*ffn, hidden)``, gate rows first, then up rows."""
    e, rows, cols = t.shape
    raw = reader.raw(t).reshape(e, -1)
    if part in ("gate", "up") and rows == 2 * ffn and "gate_up" in t.name:
        half = raw.shape[1] // 2
        raw = raw[:, :half] if part == "gate" else raw[:, half:]
        rows = ffn
    name = f"{t.name}[{part}]" if "gate_up" in t.name else t.name
    if t.qtype in keep:
        return ExpertTensor(raw, t.qtype, rows, cols, name=name)
    f16 = np.empty((e, rows * cols), np.float16)
    for x in range(e):  # one expert at a time: the float32 copy stays small
        f16[x] = Q.dequantize(raw[x], t.qtype, cols).reshape(-1)
    return ExpertTensor(f16.view(np.uint8), Q.F16, rows, cols, name=name)


def _dense(reader: GGUFFile, t: TensorEntry, lazy: bool = False) -> np.ndarray | StoredDense:
    """Tensor ``t`` dequantized to float32 in numpy order (``lazy``: a 2-D tensor of a block or
    float type as a :class:`StoredDense`)."""
    if lazy and len(t.shape) == 2 and t.qtype in Q.LAYOUTS:
        return StoredDense(reader.raw(t), t.qtype, t.shape)
    if t.qtype in Q.LAYOUTS:
        return Q.dequantize(reader.raw(t), t.qtype, t.shape[-1]).reshape(t.shape)
    from .gguf_io import dequantize  # integer and float64 tensors: gguf-py's conversion

    return dequantize(reader.raw(t), t.qtype).reshape(t.shape)


def _layer_experts(info: ModelInfo, l: int, reader: GGUFFile, tens: dict, names: dict,
                   bias: dict | None, keep) -> LayerExperts:
    """Block ``l``'s routed experts: raw projections (see _expert_tensor), float32 biases (when the
    file has all three: the expert kernels take all or none) and the architecture's activation."""
    parts = (_expert_tensor(reader, tens[names[k]], k, info.ffn, keep) for k in ("gate", "up", "down"))
    b = {}
    if bias and all(k in bias for k in ("gate", "up", "down")):
        b = {f"{k}_bias": np.ascontiguousarray(bias[k], np.float32) for k in ("gate", "up", "down")}
    return LayerExperts(l, *parts, **b, activation=info.spec.activation)


def load_model(path: str | os.PathLike, cpu_only: bool = False, lazy_dense: bool = False,
               timings: dict | None = None) -> ModelWeights:
    """Memory-map a GGUF model: dense weights as float32, routed experts as raw blocks (no copy)
    when every expert path reads their type (the CPU pool's ``quant.CPU_QTYPES`` that the GPU
    expert path also reads, ``quant.GPU_EXPERT_QTYPES``; with ``cpu_only``, experts never run on
    the GPU: every CPU type), else dequantized to F16 at load. The returned
    ``info.expert_bytes`` are the loaded experts' sizes (what moves), not the file's.

    ``lazy_dense``: the embedding, the head and the blocks' projection matrices (q, k, v, output;
    shared and dense FFNs) stay stored, as :class:`StoredDense` (norms, router, biases and MLA
    weights are float32 arrays either way). ``timings``: a dict that receives the seconds spent
    dequantizing dense tensors (``dense_dequantize_s``), converting experts to F16
    (``expert_convert_s``) and the rest (``model_open_s``: parsing, mapping).

    Raises :class:`GGUFError` naming the file and the first tensor the architecture needs and the
    file lacks."""
    import time

    t_start = time.perf_counter()
    spent = {"dense": 0.0, "experts": 0.0}
    keep = Q.CPU_QTYPES if cpu_only else {t: q for t, q in Q.CPU_QTYPES.items() if t in Q.GPU_EXPERT_QTYPES}
    reader = GGUFFile(path)
    info = _info_from_reader(reader, str(path))
    tens = {t.name: t for t in reader.tensors}

    def need(name: str, lazy: bool = False):
        if name not in tens:
            raise GGUFError(f"{path}: tensor {name!r} missing ({info.arch} needs it)")
        t0 = time.perf_counter()
        v = _dense(reader, tens[name], lazy and lazy_dense)
        spent["dense"] += time.perf_counter() - t0
        return v

    def opt(name: str, lazy: bool = False):
        return need(name, lazy) if name in tens else None

    layers, experts = [], []
    for l in range(info.num_layers):
        names = _expert_names(tens, l)
        layers.append(_dense_layer(info, l, names is not None, need, opt))
        if names:
            t0 = time.perf_counter()
            experts.append(_layer_experts(info, l, reader, tens, names, layers[-1].expert_bias, keep))
            spent["experts"] += time.perf_counter() - t0
        else:
            experts.append(None)
    emb = need("token_embd.weight", True)
    out = opt("output.weight", True)
    sizes = tuple(0 if x is None else x.expert_bytes for x in experts)
    if sizes != info.expert_bytes:  # some experts were dequantized at load
        info = dataclasses.replace(info, expert_bytes=sizes)
    weights = ModelWeights(info, emb, need("output_norm.weight"), emb if out is None else out,
                           tuple(layers), tuple(experts), reader)
    if timings is not None:
        timings["dense_dequantize_s"] = spent["dense"]
        timings["expert_convert_s"] = spent["experts"]
        timings["model_open_s"] = time.perf_counter() - t_start - spent["dense"] - spent["experts"]
    return weights


def _mla(info: ModelInfo, p: str, need, opt) -> dict:
    """deepseek2 attention weights; ``kv_b`` rebuilt from ``attn_k_b``/``attn_v_b`` when split."""
    m = {"kv_a": need(p + "attn_kv_a_mqa.weight"), "kv_a_norm": need(p + "attn_kv_a_norm.weight")}
    if info.q_lora_rank:
        m.update(q_a=need(p + "attn_q_a.weight"), q_a_norm=need(p + "attn_q_a_norm.weight"), q_b=need(p + "attn_q_b.weight"))
    else:
        m["q"] = need(p + "attn_q.weight")
    kv_b = opt(p + "attn_kv_b.weight")
    if kv_b is None:  # newer files: k_b (heads, kv_lora, nope) and v_b (heads, v, kv_lora)
        k_b, v_b = need(p + "attn_k_b.weight"), need(p + "attn_v_b.weight")
        h, r = info.num_heads, info.kv_lora_rank
        if r < 1 or k_b.size % (h * r) or v_b.size % (h * r):
            raise GGUFError(f"{info.path}: {p}attn_k_b {k_b.shape} / attn_v_b {v_b.shape} (numpy order) do not split "
                            f"into head_count {h} x kv_lora_rank {r}")
        k_b = k_b.reshape(h, r, -1).transpose(0, 2, 1)  # (heads, nope, kv_lora)
        kv_b = np.concatenate([k_b, v_b.reshape(h, -1, r)], axis=1).reshape(-1, r)
    m["kv_b"] = kv_b  # (heads*(nope+v), kv_lora): per head, nope rows then v rows
    return m


def _dense_layer(info: ModelInfo, l: int, moe: bool, need, opt) -> DenseLayer:
    spec, p = info.spec, f"blk.{l}."
    shared = None
    if spec.shared != "none" and moe:
        shared = {k: need(f"{p}ffn_{k}_shexp.weight", True) for k in ("gate", "up", "down")}
        shared["gate_inp"] = need(p + "ffn_gate_inp_shexp.weight").reshape(-1) if spec.shared == "gated" else None
    bias = {k: opt(f"{p}ffn_{k}_exps.bias") for k in ("gate", "up", "down")}
    bias = {k: v for k, v in bias.items() if v is not None}
    if spec.activation == "swiglu_oai" and moe and len(bias) != 3:
        need(p + "ffn_gate_exps.bias"), need(p + "ffn_up_exps.bias"), need(p + "ffn_down_exps.bias")
    attn_bias = {k: opt(f"{p}attn_{n}.bias") for k, n in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))}
    mla = _mla(info, p, need, opt) if spec.attn == "mla" else None
    gqa = mla is None
    qk = spec.qk_norm != "none"
    return DenseLayer(
        attn_norm=need(p + "attn_norm.weight"), wq=need(p + "attn_q.weight", True) if gqa else None,
        wk=need(p + "attn_k.weight", True) if gqa else None, wv=need(p + "attn_v.weight", True) if gqa else None,
        wo=need(p + "attn_output.weight", True), q_norm=need(p + "attn_q_norm.weight") if qk else None,
        k_norm=need(p + "attn_k_norm.weight") if qk else None, ffn_norm=need(f"{p}{spec.ffn_norm}.weight"),
        router=need(p + "ffn_gate_inp.weight") if moe else None, shared=shared, expert_bias=bias or None,
        dense_ffn=None if moe else {k: need(f"{p}ffn_{k}.weight", True) for k in ("gate", "up", "down")},
        attn_bias={k: v for k, v in attn_bias.items() if v is not None} or None,
        sinks=need(p + "attn_sinks.weight") if spec.sinks else None,
        router_bias=opt(p + "ffn_gate_inp.bias") if moe else None,
        exp_probs_b=opt(p + "exp_probs_b.bias") if moe else None, mla=mla)


# GGUF tensor of each stored-matrix key (``stored_matrix``); "{p}" is the block prefix "blk.N."
_STORED = {"wq": "{p}attn_q.weight", "wk": "{p}attn_k.weight", "wv": "{p}attn_v.weight",
           "wo": "{p}attn_output.weight", "router": "{p}ffn_gate_inp.weight",
           "shared.gate": "{p}ffn_gate_shexp.weight", "shared.up": "{p}ffn_up_shexp.weight",
           "shared.down": "{p}ffn_down_shexp.weight", "dense_ffn.gate": "{p}ffn_gate.weight",
           "dense_ffn.up": "{p}ffn_up.weight", "dense_ffn.down": "{p}ffn_down.weight"}


def stored_matrix(weights: ModelWeights, layer: int | None, key: str) -> tuple[np.ndarray, int] | None:
    """A 2-D dense matrix as the file stores it: its rows as uint8 ``(rows, row_bytes)`` (a view on
    the map) and its quant type, or None when the file lacks it. ``key``: a DenseLayer field of
    block ``layer`` (wq, wk, wv, wo, router, shared.gate/up/down, dense_ffn.gate/up/down), or
    ``"output"`` with layer None (the tied token embedding when the file has no output)."""
    if weights.reader is None:
        return None
    tens = {t.name: t for t in weights.reader.tensors}
    if key == "output":
        t = tens.get("output.weight", tens.get("token_embd.weight"))
    else:
        t = tens.get(_STORED[key].format(p=f"blk.{layer}."))
    if t is None or len(t.shape) != 2:
        return None
    return weights.reader.raw(t), t.qtype
