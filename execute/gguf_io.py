"""GGUF models in and out: the one module of moelab that imports ``gguf``.

Everything it hands out is in numpy order. **The reversed-dims trap**: GGUF lists a tensor's
dimensions fastest-varying first (``ne[0]`` is the length of a row), numpy lists them slowest first.
A projection ``W`` computing ``y = W @ x`` (``x`` of length ``cols``, ``y`` of length ``rows``) is
stored as GGUF shape ``[cols, rows]`` and is a numpy array ``(rows, cols)``; an expert tensor of GGUF
shape ``[cols, rows, experts]`` is numpy ``(experts, rows, cols)``. Quantized rows are stored as
blocks, so a tensor's bytes are ``uint8`` ``(..., rows, bytes_per_row)``. This module reverses the
shape once, where it parses the tensor table (:class:`TensorEntry` ``.shape`` is numpy order, in
elements), and nobody else sees GGUF order.

Reading is the project's own parser (``execute.gguf_file``: header, metadata and tensor table,
tensor data memory-mapped; re-exported here); gguf-py is used for writing and as the numpy
dequantization reference in tests.

- :func:`read_model_info` reads metadata and the tensor table only (weights stay unread on disk).
- ``execute.gguf_model.load_model`` memory-maps the file: dense weights are dequantized to float32 numpy arrays,
  routed-expert weights stay raw GGUF blocks, as views on the map (no copy), in
  :class:`~execute.experts.LayerExperts`, when the expert kernels read their type; other expert
  types are dequantized to F16 at load (:func:`qtype_paths` says which path runs each type).
- :func:`dequantize` / :func:`quantize` wrap ``gguf.quants`` so that tests and reference code need
  not import gguf.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from . import quant as Q
from .archs import ARCHS, GATING_FUNCS
from .gguf_file import GGUFError, GGUFFile, TensorEntry, _Meta, qtype_name  # noqa: F401  (re-exported)

__all__ = [
    "GGUFError",
    "GGUFFile",
    "ModelInfo",
    "TensorEntry",
    "EXPERT_QTYPES",
    "SUPPORTED_ARCHS",
    "qtype_name",
    "qtype_value",
    "block_shape",
    "read_model_info",
    "llamacpp_problems",
    "dequantize",
    "quantize",
    "TensorSpec",
    "write_gguf",
    "read_tokenizer",
    "iq_grid_bitmaps",
    "qtype_paths",
]

# Quant types a file's routed experts may have: read by the kernels, or dequantized at load (qtype_paths)
EXPERT_QTYPES = tuple(q.name for q in Q.LAYOUTS.values())
# architectures whose llama.cpp loader needs output.weight (no fallback to the token embedding)
_OUTPUT_REQUIRED = ("olmoe",)
SUPPORTED_ARCHS = tuple(ARCHS)


def qtype_value(name: str) -> int:
    """``GGMLQuantizationType`` value of a name (``"Q8_0" -> 8``), case-insensitive."""
    try:
        return int(gguf.GGMLQuantizationType[name.upper()])
    except KeyError:
        raise ValueError(f"unknown GGML quant type {name!r}") from None


def block_shape(qtype: int) -> tuple[int, int]:
    """``(elements per block, bytes per block)`` of a quant type."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(qtype))]


@dataclass(frozen=True)
class ModelInfo:
    """Geometry of a GGUF MoE model, from its metadata and tensor table.

    Per-layer tuples have one entry per block; a dense block has 0 experts and 0 expert bytes.
    ``expert_bytes[l]`` is one expert's gate + up + down bytes in its GGUF type, plus its float32
    gate, up and down biases where the block has all three (what an upload moves). ``ffn`` is the routed experts' hidden width; ``shared_ffn`` the shared expert's (0: none).
    """

    path: str
    arch: str
    num_layers: int
    num_experts: tuple[int, ...]
    top_k: int
    hidden: int
    ffn: int
    dense_ffn: int
    shared_ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    context_length: int
    rope_theta: float
    rms_eps: float
    norm_topk: bool
    qk_norm: bool
    tied_output: bool
    fused_gate_up: bool
    expert_bias: bool
    expert_bytes: tuple[int, ...]
    tensors: tuple[TensorEntry, ...] = field(repr=False, default=())
    gating: str = "softmax"  # see execute.archs
    expert_weights_scale: float = 0.0  # 0: weights not scaled
    expert_groups: int = 1
    expert_groups_used: int = 1
    rope_dims: int = 0  # rotated dims per head (0: head_dim); MLA: the rope part of a key
    rope_scaling: str = "none"  # none, linear, yarn
    rope_factor: float = 1.0
    rope_orig_ctx: int = 0
    yarn_log_mul: float = 0.0
    attn_scale: float = 0.0  # 0: 1/sqrt(key head dim)
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    sliding_window: int = 0
    v_head_dim: int = 0  # 0: head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    leading_dense: int = 0
    num_shared: int = 0

    @property
    def spec(self):
        """The :class:`~execute.archs.ArchSpec` of ``arch``."""
        return ARCHS[self.arch]

    def is_swa(self, layer: int) -> bool:
        """True when block ``layer`` attends through the sliding window."""
        n = self.spec.swa_pattern
        return bool(self.sliding_window) and n > 0 and layer % n < n - 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "hidden", "ffn", "num_heads", "num_kv_heads", "head_dim", "vocab"):
            if getattr(self, name) < 1:
                raise GGUFError(f"{self.path}: {name} = {getattr(self, name)}, expected >= 1")
        if self.num_heads % self.num_kv_heads:
            raise GGUFError(f"{self.path}: head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}")

    @property
    def total_expert_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.num_experts, self.expert_bytes))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l, n in enumerate(self.num_experts) if n)

    def tensor(self, name: str) -> TensorEntry | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    def expert_qtypes(self) -> dict[str, str]:
        """Quant type name of every routed-expert tensor, by tensor name."""
        return {t.name: t.qtype_name for t in self.tensors if "_exps." in t.name}

    def geometry(self):
        """The scheduler's :class:`~scheduler.core.Geometry` of this model."""
        from scheduler import Geometry

        return Geometry(self.num_experts, self.top_k, self.expert_bytes)

    def to_dict(self) -> dict:
        """Plain JSON-able summary (what ``moelab model info --json`` prints)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.qtype_name] = counts.get(t.qtype_name, 0) + 1
        exp_types = sorted(set(self.expert_qtypes().values()))
        return {
            "path": self.path, "arch": self.arch, "num_layers": self.num_layers,
            "num_experts": list(self.num_experts), "top_k": self.top_k, "hidden": self.hidden,
            "ffn": self.ffn, "dense_ffn": self.dense_ffn, "shared_ffn": self.shared_ffn,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab": self.vocab, "context_length": self.context_length, "rope_theta": self.rope_theta,
            "rms_eps": self.rms_eps, "norm_topk": self.norm_topk, "qk_norm": self.qk_norm,
            "tied_output": self.tied_output, "fused_gate_up": self.fused_gate_up,
            "expert_bias": self.expert_bias, "gating": self.gating, "expert_weights_scale": self.expert_weights_scale,
            "expert_groups": [self.expert_groups, self.expert_groups_used], "rope_scaling": self.rope_scaling,
            "sliding_window": self.sliding_window, "leading_dense": self.leading_dense,
            "expert_qtypes": exp_types, "tensor_qtypes": counts,
            "expert_bytes": list(self.expert_bytes), "total_expert_bytes": self.total_expert_bytes,
            "num_tensors": len(self.tensors), "qtype_paths": qtype_paths(self),
        }


def _info_from_reader(reader: GGUFFile, path: str) -> ModelInfo:
    meta = _Meta(reader, path)
    arch = meta.get("general.architecture", required=True)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{path}: general.architecture = {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    spec = ARCHS[arch]
    tensors = reader.tensors
    by_name = {t.name: t for t in tensors}
    num_layers = meta.int(f"{arch}.block_count", required=True)
    hidden = meta.int(f"{arch}.embedding_length", required=True)
    num_heads = meta.int(f"{arch}.attention.head_count", required=True)
    num_kv = meta.int(f"{arch}.attention.head_count_kv", num_heads)
    head_dim = meta.int(f"{arch}.attention.key_length", hidden // num_heads)
    vdim = meta.int(f"{arch}.attention.value_length", head_dim)
    if spec.attn == "mla":  # newer deepseek2 files give the per-head sizes separately
        head_dim = meta.int(f"{arch}.attention.key_length_mla", head_dim)
        vdim = meta.int(f"{arch}.attention.value_length_mla", vdim)
    if vdim != head_dim and spec.attn != "mla":
        raise GGUFError(f"{path}: attention.value_length {vdim} != key_length {head_dim}, not supported")
    emb = by_name.get("token_embd.weight")
    if emb is None:
        raise GGUFError(f"{path}: tensor 'token_embd.weight' missing")
    num_experts, expert_bytes, ffn, fused, bias = _expert_table(path, by_name, num_layers)
    if not any(num_experts):
        raise GGUFError(f"{path}: no block has routed-expert tensors (blk.N.ffn_gate_exps.weight ...): "
                        "not a MoE model, or experts stored per expert (old Mixtral layout), not supported")
    top_k = meta.int(f"{arch}.expert_used_count", required=True)
    counts = set(n for n in num_experts if n)
    declared = meta.int(f"{arch}.expert_count", required=True)
    if counts and counts != {declared}:
        raise GGUFError(f"{path}: {arch}.expert_count = {declared} but expert tensors have {sorted(counts)} experts")
    shexp = next((by_name[f"blk.{l}.ffn_gate_shexp.weight"] for l in range(num_layers)
                  if f"blk.{l}.ffn_gate_shexp.weight" in by_name), None)
    gating = spec.gating
    if meta.get(f"{arch}.expert_gating_func") is not None:
        code = meta.int(f"{arch}.expert_gating_func")
        if code not in GATING_FUNCS:
            raise GGUFError(f"{path}: {arch}.expert_gating_func = {code}; supported: {GATING_FUNCS}")
        gating = GATING_FUNCS[code]
    groups = meta.int(f"{arch}.expert_group_count", 1) or 1
    if groups > 1 and (declared % groups or not 1 <= meta.int(f"{arch}.expert_group_used_count", 1) <= groups):
        raise GGUFError(f"{path}: {arch}.expert_group_count = {groups} (used "
                        f"{meta.int(f'{arch}.expert_group_used_count', 1)}) does not fit {declared} experts")
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type = {scaling!r}; supported: none, linear, yarn")
    f = lambda key, default: float(meta.get(key, default))  # noqa: E731
    return ModelInfo(
        path=str(path), arch=arch, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
        hidden=hidden, ffn=ffn or meta.int(f"{arch}.expert_feed_forward_length", 0),
        dense_ffn=meta.int(f"{arch}.feed_forward_length", 0), shared_ffn=shexp.shape[0] if shexp else 0,
        num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, vocab=emb.shape[0],
        context_length=meta.int(f"{arch}.context_length", 0),
        rope_theta=f(f"{arch}.rope.freq_base", 10000.0),
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", required=True)),
        norm_topk=bool(meta.get(f"{arch}.expert_weights_norm", spec.norm_topk)),
        qk_norm="blk.0.attn_q_norm.weight" in by_name, tied_output="output.weight" not in by_name,
        fused_gate_up=fused, expert_bias=bias, expert_bytes=expert_bytes, tensors=tensors,
        gating=gating, expert_weights_scale=f(f"{arch}.expert_weights_scale", 0.0),
        expert_groups=groups, expert_groups_used=meta.int(f"{arch}.expert_group_used_count", 1) if groups > 1 else 1,
        rope_dims=meta.int(f"{arch}.rope.dimension_count", 0), rope_scaling=scaling,
        rope_factor=f(f"{arch}.rope.scaling.factor", 1.0), rope_orig_ctx=meta.int(f"{arch}.rope.scaling.original_context_length", 0),
        yarn_log_mul=f(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0),
        attn_scale=f(f"{arch}.attention.scale", 0.0), embedding_scale=f(f"{arch}.embedding_scale", 0.0) or 1.0,
        residual_scale=f(f"{arch}.residual_scale", 0.0) or 1.0, logit_scale=f(f"{arch}.logit_scale", 0.0) or 1.0,
        sliding_window=meta.int(f"{arch}.attention.sliding_window", 0), v_head_dim=vdim,
        q_lora_rank=meta.int(f"{arch}.attention.q_lora_rank", 0), kv_lora_rank=meta.int(f"{arch}.attention.kv_lora_rank", 0),
        leading_dense=meta.int(f"{arch}.leading_dense_block_count", 0), num_shared=meta.int(f"{arch}.expert_shared_count", 0),
    )


def _expert_names(by_name: dict, layer: int) -> dict[str, str] | None:
    """GGUF names of a layer's gate/up/down expert tensors (fused gate-up: both 'gate_up')."""
    p = f"blk.{layer}."
    if p + "ffn_gate_up_exps.weight" in by_name:
        return {"gate": p + "ffn_gate_up_exps.weight", "up": p + "ffn_gate_up_exps.weight", "down": p + "ffn_down_exps.weight"}
    if p + "ffn_gate_exps.weight" in by_name or p + "ffn_up_exps.weight" in by_name:
        return {k: f"{p}ffn_{k}_exps.weight" for k in ("gate", "up", "down")}
    return None


def _expert_table(path, by_name: dict, num_layers: int):
    num_experts, expert_bytes, ffns = [], [], set()
    fused = bias = False
    for l in range(num_layers):
        names = _expert_names(by_name, l)
        if names is None:
            num_experts.append(0)
            expert_bytes.append(0)
            continue
        ents = {}
        for k, n in names.items():
            if n not in by_name:
                raise GGUFError(f"{path}: tensor {n!r} missing (layer {l} has other expert tensors)")
            ents[k] = by_name[n]
        fused = fused or names["gate"] == names["up"]
        bias = bias or any(f"blk.{l}.ffn_{k}_exps.bias" in by_name for k in ("gate", "up", "down", "gate_up"))
        for k, t in ents.items():
            if len(t.shape) != 3:
                raise GGUFError(f"{path}: tensor {t.name!r}: shape {t.shape} (numpy order), expected (experts, rows, cols)")
            if t.qtype_name not in EXPERT_QTYPES:
                raise GGUFError(f"{path}: tensor {t.name!r} has quant type {t.qtype_name}; experts may be "
                                f"{', '.join(EXPERT_QTYPES)}")
        e = ents["down"].shape[0]
        ffn = ents["down"].shape[2]
        ffns.add(ffn)
        if any(t.shape[0] != e for t in ents.values()):
            raise GGUFError(f"{path}: layer {l}: expert tensors disagree on the expert count "
                            f"{[t.shape[0] for t in ents.values()]}")
        per = ents["down"].nbytes // e + (ents["gate"].nbytes // e if fused else (ents["gate"].nbytes + ents["up"].nbytes) // e)
        if all(f"blk.{l}.ffn_{k}_exps.bias" in by_name for k in ("gate", "up", "down")):
            per += 4 * (2 * ffn + ents["down"].shape[1])  # float32 biases travel with the expert
        num_experts.append(e)
        expert_bytes.append(per)
    if len(ffns) > 1:
        raise GGUFError(f"{path}: expert ffn widths differ between layers {sorted(ffns)}, not supported")
    return tuple(num_experts), tuple(expert_bytes), (ffns.pop() if ffns else 0), fused, bias


def llamacpp_problems(path: str | os.PathLike) -> list[str]:
    """Where the file's metadata disagrees with its tensors in a way llama.cpp's loader refuses
    (``check_tensor_dims``: wrong shape) or its context creation aborts on; [] when none is found.

    Checked: the width llama.cpp takes for the routed experts (``ArchSpec.expert_width``), for
    dense blocks and for the shared expert; q widths of loaders that size q by
    ``embedding_length``; MLA's layout keys (``attn_k_b``/``attn_v_b`` need ``key_length_mla`` and
    ``value_length_mla``, one kv head and ``key_length`` = kv_lora + rope; ``attn_kv_b`` needs
    neither key and ``head_count_kv`` = ``head_count``). The file must read as a model
    (:func:`read_model_info`'s errors otherwise)."""
    reader = GGUFFile(path)
    info = _info_from_reader(reader, str(path))
    meta, a, spec = _Meta(reader, str(path)), info.arch, info.spec
    out = []

    def width(key: str) -> int:
        return meta.int(f"{a}.{key}", 0) if meta.get(f"{a}.{key}") is not None else 0

    def check(tensor: str, dim: int, want: int, why: str) -> None:
        t = info.tensor(tensor)
        if t is not None and t.shape[dim] != want:
            out.append(f"{path}: {tensor} has shape {t.shape} (numpy order) but llama.cpp expects {want} "
                       f"at axis {dim} from {why}")

    ff, exp, moe = width("feed_forward_length"), width("expert_feed_forward_length"), info.moe_layers[0]
    if spec.expert_width == "ffn":
        want, why = ff, f"{a}.feed_forward_length = {ff}"
    elif spec.expert_width == "expert" or exp:
        want, why = exp, f"{a}.expert_feed_forward_length = {exp or 'missing'}"
    else:
        want, why = ff // info.top_k, f"{a}.feed_forward_length / expert_used_count = {ff} / {info.top_k}"
    check(f"blk.{moe}.ffn_down_exps.weight", 2, want, why)  # every MoE block has one width (_expert_table)
    if info.leading_dense:
        check("blk.0.ffn_gate.weight", 0, ff, f"{a}.feed_forward_length = {ff}")
    if spec.shared == "gated":
        sh = width("expert_shared_feed_forward_length") or ff
        check(f"blk.{moe}.ffn_gate_shexp.weight", 0, sh, f"{a}.expert_shared_feed_forward_length (else feed_forward_length) = {sh}")
    elif spec.shared == "plain":
        n = width("expert_shared_count")
        check(f"blk.{moe}.ffn_gate_shexp.weight", 0, exp * n, f"expert_feed_forward_length x expert_shared_count = {exp} x {n}")
    if spec.q_width == "hidden":
        check("blk.0.attn_q.weight", 0, info.hidden, f"{a}.embedding_length = {info.hidden}")
    if spec.attn == "mla":
        out += _mla_problems(path, info, meta)
    if info.tied_output and a in _OUTPUT_REQUIRED:
        out.append(f"{path}: no output.weight (the output head is tied to token_embd); llama.cpp's {a} loader "
                   "requires output.weight")
    return out


def qtype_paths(info: ModelInfo) -> dict[str, str]:
    """Which path runs each quant type present, by type name: the routed experts' types (CPU pool
    kernel, GPU expert kernel, or dequantized to F16 at load, see ``execute.gguf_model.load_model``: a run without
    a GPU loads with ``cpu_only``) and the
    dense tensors' (dequantized to float32 at load; F32, F16, BF16 and Q8_0 matrices are also
    read by the GPU's fused dense path as stored)."""
    experts = {t.qtype for t in info.tensors if "_exps.weight" in t.name}
    dense = {t.qtype for t in info.tensors if "_exps." not in t.name and len(t.shape) == 2}
    out = {}
    for qt in sorted(experts | dense):
        parts = []
        if qt in experts:
            if qt in Q.QTYPES:
                parts.append("experts: CPU kernel, GPU kernel")
            elif qt in Q.CPU_QTYPES and qt in Q.GPU_EXPERT_QTYPES:
                parts.append("experts: CPU kernel, generic GPU kernel (no token graph)")
            elif qt in Q.CPU_QTYPES:
                parts.append("experts: CPU kernel on host-only runs, else dequantized to F16 at load")
            else:
                parts.append("experts: dequantized to F16 at load")
        if qt in dense:
            gpu = ", GPU fused dense kernel as stored" if qt in Q.GPU_DENSE_QTYPES else ""
            parts.append(f"dense: dequantized to float32 at load{gpu}")
        out[qtype_name(qt)] = "; ".join(parts)
    return out


def _mla_problems(path, info: ModelInfo, meta: _Meta) -> list[str]:
    a, out = info.arch, []
    mla_keys = [k for k in ("key_length_mla", "value_length_mla") if meta.get(f"{a}.attention.{k}") is not None]
    kv_heads = meta.int(f"{a}.attention.head_count_kv", info.num_heads)
    if info.tensor("blk.0.attn_k_b.weight") is not None:
        if len(mla_keys) < 2:
            out.append(f"{path}: attn_k_b/attn_v_b layout without {a}.attention.key_length_mla and value_length_mla: "
                       "llama.cpp then looks for attn_kv_b and refuses the file")
        klen, vlen = meta.int(f"{a}.attention.key_length", 0), meta.int(f"{a}.attention.value_length", 0)
        want = (info.kv_lora_rank + info.rope_dims, info.kv_lora_rank, 1)
        if (klen, vlen, kv_heads) != want:
            out.append(f"{path}: attn_k_b/attn_v_b layout with key_length {klen}, value_length {vlen}, head_count_kv "
                       f"{kv_heads}; llama.cpp's cache expects {want[0]}, {want[1]}, {want[2]} (kv_lora + rope, kv_lora, 1)")
    elif info.tensor("blk.0.attn_kv_b.weight") is not None:
        if mla_keys:
            out.append(f"{path}: attn_kv_b layout with {a}.attention.{mla_keys[0]}: llama.cpp then looks for "
                       "attn_k_b/attn_v_b and refuses the file")
        if kv_heads != info.num_heads:
            out.append(f"{path}: attn_kv_b layout with head_count_kv {kv_heads} != head_count {info.num_heads}: "
                       "llama.cpp builds keys for every head and aborts at context creation")
    return out


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    """Geometry, quant types and expert sizes of a GGUF model, from metadata and the tensor table.

    Raises :class:`GGUFError` (naming file and key/tensor) on an unreadable or unsupported file."""
    return _info_from_reader(GGUFFile(path), str(path))


# quant wrappers ----------------------------------------------------------------------------------
def dequantize(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Blocks of ``qtype`` (uint8 rows, or the native float array for F32/F16) -> float32.

    The last axis of ``raw`` is bytes (or native elements); the result's last axis is elements."""
    qt = gguf.GGMLQuantizationType(int(qtype))
    arr = np.ascontiguousarray(raw)
    if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) and arr.dtype == np.uint8:
        arr = arr.view(np.float32 if qt == gguf.GGMLQuantizationType.F32 else np.float16)
    try:
        out = gguf.quants.dequantize(arr, qt)
    except NotImplementedError:
        raise GGUFError(f"no dequantizer for quant type {qt.name}") from None
    return np.asarray(out, dtype=np.float32)


def quantize(values: np.ndarray, qtype: int) -> np.ndarray:
    """float32 ``(..., n)`` -> ``qtype`` blocks as uint8 ``(..., bytes)`` via ``gguf.quants.quantize``.

    Raises ``NotImplementedError`` for types gguf-py cannot quantize (Q4_K, Q6_K)."""
    qt = gguf.GGMLQuantizationType(int(qtype))
    out = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qt)
    return np.ascontiguousarray(out).view(np.uint8).reshape(*values.shape[:-1], -1)


def iq_grid_bitmaps() -> dict[str, str]:
    """gguf-py's IQ grids as ``execute.iq_grids`` stores them: per grid, the base64 of a bitmap
    over the codes of its lattice (entry k of a grid of ``dim`` values from a map of ``base``
    levels is the code sum(level_i * base**i); bit c set when code c is in the grid; the grids
    are sorted by code, so the bitmap gives them back in order). IQ1_M shares IQ1_S's grid."""
    import base64

    out = {}
    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"):
        cls = getattr(gguf.quants, name)
        cls.init_grid()
        levels = np.asarray(cls.grid_map, np.float32)
        grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
        idx = np.searchsorted(levels, grid).astype(np.int64)
        code = (idx * len(levels) ** np.arange(grid.shape[1], dtype=np.int64)).sum(axis=1)
        bits = np.zeros(len(levels) ** grid.shape[1], np.uint8)
        bits[code] = 1
        out[name] = base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode()
    return out


# writing ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: numpy-order ``shape`` in elements, ``qtype``, and ``make()`` returning its
    data (uint8 blocks ``(..., bytes)`` for quantized types, the native array for F32/F16), called
    once, when the tensor is written, so a writer holds one tensor in memory at a time."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    make: object  # () -> np.ndarray

    @property
    def nbytes(self) -> int:
        block, size = block_shape(self.qtype)
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        if self.shape[-1] % block:
            raise ValueError(f"tensor {self.name}: row length {self.shape[-1]} is not a multiple of "
                             f"{qtype_name(self.qtype)}'s block size {block}")
        return rows * (self.shape[-1] // block) * size


_VTYPES = {
    "u32": gguf.GGUFValueType.UINT32, "i32": gguf.GGUFValueType.INT32, "f32": gguf.GGUFValueType.FLOAT32,
    "bool": gguf.GGUFValueType.BOOL, "str": gguf.GGUFValueType.STRING,
}


def _add_kv(writer: gguf.GGUFWriter, key: str, value, kind: str) -> None:
    """``kind``: u32/i32/f32/bool/str for scalars, ``[u32]``-style for arrays."""
    if kind.startswith("["):
        if not len(value):
            raise ValueError(f"metadata {key}: empty array (gguf-py drops empty arrays)")
        writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=_VTYPES[kind[1:-1]])
    else:
        writer.add_key_value(key, value, _VTYPES[kind])


def write_gguf(path: str | os.PathLike, arch: str, metadata: list[tuple[str, object, str]],
               tensors: list[TensorSpec], progress=None) -> None:
    """Write a GGUF file atomically (temporary file beside ``path``, then rename).

    ``metadata``: ``(key, value, kind)`` triples (``general.architecture`` is added from ``arch``).
    Tensors are produced one at a time by their ``make``; ``progress(i, n, name)`` is called before
    each. The data of every tensor is checked against its declared size."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(None, arch)
    try:
        for key, value, kind in metadata:
            _add_kv(writer, key, value, kind)
        for t in tensors:
            # GGUFWriter takes numpy order and writes it reversed (GGUF order), see the module docstring.
            writer.add_tensor_info(t.name, tuple(t.shape), np.dtype(np.float32), t.nbytes, gguf.GGMLQuantizationType(t.qtype))
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            if progress is not None:
                progress(i, len(tensors), t.name)
            data = np.ascontiguousarray(t.make())
            if data.nbytes != t.nbytes:
                raise ValueError(f"tensor {t.name}: made {data.nbytes} bytes, expected {t.nbytes}")
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            writer.close()
        except OSError:  # the failure was the disk's: closing flushes into it again
            pass
        if tmp.exists():
            tmp.unlink()
        raise


# tokenizer metadata -------------------------------------------------------------------------------
_TOKENIZER_KEYS = {
    "model": "tokenizer.ggml.model", "pre": "tokenizer.ggml.pre", "tokens": "tokenizer.ggml.tokens",
    "token_type": "tokenizer.ggml.token_type", "scores": "tokenizer.ggml.scores", "merges": "tokenizer.ggml.merges",
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id", "eot": "tokenizer.ggml.eot_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "add_bos": "tokenizer.ggml.add_bos_token",
    "add_space_prefix": "tokenizer.ggml.add_space_prefix", "chat_template": "tokenizer.chat_template",
}


def read_tokenizer(path: str | os.PathLike) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file as plain Python values, keyed by short names
    (model, pre, tokens, token_type, scores, merges, bos, eos, eot, unk, add_bos, add_space_prefix,
    chat_template); absent keys are None. GGUFError when the file has no vocabulary."""
    f = GGUFFile(path)
    out = {k: f.value(key) for k, key in _TOKENIZER_KEYS.items()}
    if out["model"] is None or not out["tokens"]:
        raise GGUFError(f"{path}: no vocabulary (metadata keys 'tokenizer.ggml.model' and 'tokenizer.ggml.tokens' needed)")
    return out
