"""GGUF models in and out: the one module of moelab that imports ``gguf``.

Everything it hands out is in numpy order. **The reversed-dims trap**: GGUF lists a tensor's
dimensions fastest-varying first (``ne[0]`` is the length of a row), numpy lists them slowest first.
A projection ``W`` computing ``y = W @ x`` (``x`` of length ``cols``, ``y`` of length ``rows``) is
stored as GGUF shape ``[cols, rows]`` and is a numpy array ``(rows, cols)``; an expert tensor of GGUF
shape ``[cols, rows, experts]`` is numpy ``(experts, rows, cols)``. Quantized rows are stored as
blocks, so a tensor's bytes are ``uint8`` ``(..., rows, bytes_per_row)``. This module reverses the
shape once, where it parses the tensor table (:class:`TensorEntry` ``.shape`` is numpy order, in
elements), and nobody else sees GGUF order.

Reading is this module's own parser (:class:`GGUFFile`: header, metadata and tensor table, tensor
data memory-mapped); gguf-py is used for writing, quant type names and sizes, and as the numpy
dequantization reference.

- :func:`read_model_info` reads metadata and the tensor table only (weights stay unread on disk).
- :func:`load_model` memory-maps the file: dense weights are dequantized to float32 numpy arrays,
  routed-expert weights stay raw GGUF blocks, as views on the map (no copy), in
  :class:`~execute.experts.LayerExperts`.
- :func:`dequantize` / :func:`quantize` wrap ``gguf.quants`` so that tests and reference code need
  not import gguf.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from .archs import ARCHS, GATING_FUNCS
from .experts import ExecutorError, ExpertTensor, LayerExperts

__all__ = [
    "GGUFError",
    "GGUFFile",
    "ModelInfo",
    "TensorEntry",
    "DenseLayer",
    "ModelWeights",
    "EXPERT_QTYPES",
    "SUPPORTED_ARCHS",
    "qtype_name",
    "qtype_value",
    "block_shape",
    "read_model_info",
    "llamacpp_problems",
    "load_model",
    "dequantize",
    "quantize",
    "stored_matrix",
    "TensorSpec",
    "write_gguf",
    "read_tokenizer",
    "iq_grid_bitmaps",
]

# Quant types the expert kernels read directly; any other expert type is an error.
EXPERT_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")
SUPPORTED_ARCHS = tuple(ARCHS)


class GGUFError(ExecutorError, ValueError):
    """A GGUF file that is unreadable, incomplete or unsupported; the message names file and field."""


def qtype_name(qtype: int) -> str:
    """Name of a ``GGMLQuantizationType`` value (``8 -> "Q8_0"``)."""
    try:
        return gguf.GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return f"type{int(qtype)}"


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
class TensorEntry:
    """One row of the tensor table. ``shape`` is numpy order, in elements (GGUF order reversed);
    ``data_offset`` is where its bytes start in the file."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int = field(default=0, repr=False)

    @property
    def qtype_name(self) -> str:
        return qtype_name(self.qtype)


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
            "num_tensors": len(self.tensors),
        }


# reading ------------------------------------------------------------------------------------------
# GGUF value types: (struct code, size) of the scalars; 8 is a string, 9 an array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
            10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
_QUANT_SIZES = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


class _Corrupt(Exception):
    """A read past the end of the file or a malformed entry, while parsing one section."""


class GGUFFile:
    """A GGUF file parsed by this module (little-endian v2/v3): header, metadata and tensor table.

    ``gguf.GGUFReader`` builds Python objects for every metadata element, which takes seconds for a
    150k-entry vocabulary; here each key's value type and offset are recorded in one pass and a
    value is decoded when :meth:`value` asks for it. ``data`` is the whole file as a read-only
    uint8 array on a memory map; ``tensors`` the tensor table as :class:`TensorEntry` rows (numpy
    order, ``data_offset`` absolute in the file, checked to lie inside it); :meth:`raw` a tensor's
    bytes as a view on the map. Parsing checks every length and offset against the file's size, so a
    truncated or corrupt file is a :class:`GGUFError` naming the file and the section."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.is_file():
            raise GGUFError(f"{p}: no such file")
        self.path = str(path)
        try:
            with open(p, "rb") as fh:
                self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap of an empty file
            raise GGUFError(f"{p}: empty file, not a GGUF file") from None
        except OSError as exc:
            raise GGUFError(f"{p}: cannot read ({exc.strerror or exc})") from None
        self.data = np.frombuffer(self._buf, np.uint8)
        self._values: dict = {}
        pos = self._header()
        try:
            self.fields, pos = self._fields(pos)
        except (_Corrupt, struct.error, OverflowError) as exc:
            raise GGUFError(f"{self.path}: metadata section truncated or corrupt ({exc})") from None
        try:
            self.tensors = self._tensor_table(pos)
        except (_Corrupt, struct.error, OverflowError) as exc:
            raise GGUFError(f"{self.path}: tensor table truncated or corrupt ({exc})") from None

    def _header(self) -> int:
        buf = self._buf
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise GGUFError(f"{self.path}: not a little-endian GGUF v2/v3 file (starts with {bytes(buf[:4])!r})")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version not in (2, 3):
            swapped = struct.unpack_from(">I", buf, 4)[0]
            kind = "a big-endian GGUF file" if swapped in (2, 3) else f"GGUF version {version}"
            raise GGUFError(f"{self.path}: {kind}; supported: little-endian GGUF v2/v3")
        self.version = version
        self.num_tensors, self.num_kv = struct.unpack_from("<QQ", buf, 8)
        return 24

    def _end(self, pos: int, n: int, what: str) -> int:
        """``pos + n``, after checking that ``n`` bytes of ``what`` at ``pos`` lie inside the file."""
        if n < 0 or pos + n > len(self._buf):
            raise _Corrupt(f"{what}: {n} bytes at offset {pos} run past the end of the file ({len(self._buf)} bytes)")
        return pos + n

    def _string(self, pos: int, what: str) -> tuple[bytes, int]:
        n = struct.unpack_from("<Q", self._buf, pos)[0]
        end = self._end(pos + 8, n, what)
        return self._buf[pos + 8:end], end

    def _skip(self, vtype: int, pos: int, what: str) -> int:
        """The offset after a value of ``vtype`` at ``pos`` (arrays walked, not decoded)."""
        if vtype in _SCALARS:
            return self._end(pos, _SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self._string(pos, what)[1]
        if vtype != _ARRAY:
            raise _Corrupt(f"{what}: value type {vtype} unknown")
        itype, n = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if itype in _SCALARS:
            return self._end(pos, n * _SCALARS[itype][1], what)
        self._end(pos, 8 * n if itype == _STRING else 4 * n, what)  # every element takes at least that
        if itype == _STRING:
            buf, unpack, size = self._buf, struct.unpack_from, len(self._buf)
            for _ in range(n):
                pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > size:
                raise _Corrupt(f"{what}: a string runs past the end of the file ({size} bytes)")
            return pos
        for _ in range(n):
            pos = self._skip(itype, pos, what)
        return pos

    def _decode(self, vtype: int, pos: int):
        """The value of ``vtype`` at ``pos`` as Python values (arrays as lists, strings UTF-8)."""
        buf = self._buf
        if vtype in _SCALARS:
            return struct.unpack_from("<" + _SCALARS[vtype][0], buf, pos)[0]
        if vtype == _STRING:
            return self._string(pos, "string")[0].decode("utf-8", "replace")
        itype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _SCALARS:
            return np.frombuffer(buf, np.dtype("<" + _SCALARS[itype][0]), n, pos).tolist()
        out = []
        for _ in range(n):
            if itype == _STRING:
                m = struct.unpack_from("<Q", buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + m].decode("utf-8", "replace"))
                pos += 8 + m
            else:
                out.append(self._decode(itype, pos))
                pos = self._skip(itype, pos, "array")
        return out

    def _fields(self, pos: int) -> tuple[dict, int]:
        self._end(pos, 12 * self.num_kv, f"{self.num_kv} metadata entries")  # a key length and a type each
        fields = {}
        for i in range(self.num_kv):
            raw, pos = self._string(pos, f"key of metadata entry {i}")
            key = raw.decode("utf-8", "replace")
            if key in fields:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            vtype = struct.unpack_from("<I", self._buf, pos)[0]
            fields[key] = (vtype, pos + 4)
            pos = self._skip(vtype, pos + 4, f"metadata key {key!r}")
        return fields, pos

    def _tensor_table(self, pos: int) -> tuple[TensorEntry, ...]:
        self._end(pos, 24 * self.num_tensors, f"{self.num_tensors} tensor entries")  # name length, dims, type, offset
        rows = []
        for i in range(self.num_tensors):
            raw, pos = self._string(pos, f"name of tensor {i}")
            name = raw.decode("utf-8", "replace")
            n_dims = struct.unpack_from("<I", self._buf, pos)[0]
            if not 1 <= n_dims <= _MAX_DIMS:
                raise _Corrupt(f"tensor {name!r}: {n_dims} dimensions, expected 1..{_MAX_DIMS}")
            self._end(pos + 4, 8 * n_dims + 12, f"tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)  # GGUF order: ne[0] (a row's length) first
            qtype, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 16 + 8 * n_dims
            if qtype not in _QUANT_SIZES:
                raise _Corrupt(f"tensor {name!r}: quant type {qtype} unknown")
            block, size = _QUANT_SIZES[qtype]
            if not all(dims) or dims[0] % block:
                raise _Corrupt(f"tensor {name!r}: dimensions {list(dims)} (GGUF order), expected >= 1 each and a "
                               f"row length that is a multiple of {qtype_name(qtype)}'s block of {block}")
            nbytes = math.prod(dims) // block * size
            # the reversed-dims trap, undone here once: numpy order is GGUF order reversed
            rows.append(TensorEntry(name, qtype, tuple(reversed(dims)), nbytes, offset))
        if len({t.name for t in rows}) != len(rows):
            seen = set()
            dup = next(t.name for t in rows if t.name in seen or seen.add(t.name))
            raise _Corrupt(f"tensor {dup!r} appears twice")
        if self.fields.get("general.alignment", (_UINT32,))[0] != _UINT32:
            raise _Corrupt(f"general.alignment has value type {self.fields['general.alignment'][0]}, expected uint32")
        align = self.value("general.alignment", 32)
        if align < 1 or align & (align - 1):
            raise _Corrupt(f"general.alignment = {align}, expected a power of two")
        start = -(-pos // align) * align
        out = []
        for t in rows:
            at = start + t.data_offset
            if at + t.nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: tensor data truncated: tensor {t.name!r}'s {t.nbytes} bytes at offset "
                                f"{at} run past the end of the file ({len(self._buf)} bytes; an incomplete copy?)")
            out.append(TensorEntry(t.name, t.qtype, t.shape, t.nbytes, at))
        return tuple(out)

    def value(self, key: str, default=None):
        """The value of metadata ``key`` (numbers, str, lists for arrays), or ``default``."""
        if key not in self.fields:
            return default
        if key not in self._values:
            vtype, pos = self.fields[key]
            self._values[key] = self._decode(vtype, pos)
        return self._values[key]

    def raw(self, t: TensorEntry) -> np.ndarray:
        """Tensor ``t``'s bytes as uint8 ``(*shape[:-1], row_bytes)``, a view on the map."""
        return self.data[t.data_offset:t.data_offset + t.nbytes].reshape(*t.shape[:-1], -1)


class _Meta:
    """Typed access to a file's key/value metadata, with errors naming file and key."""

    def __init__(self, reader: GGUFFile, path: str):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None, required: bool = False):
        if key not in self.reader.fields:
            if required:
                raise GGUFError(f"{self.path}: metadata key {key!r} missing")
            return default
        return self.reader.value(key)

    def int(self, key: str, default=None, required: bool = False) -> int:
        v = self.get(key, default, required)
        if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): all equal supported here
            if len(set(v)) != 1:
                raise GGUFError(f"{self.path}: metadata key {key!r} varies per layer {v[:8]}..., not supported")
            v = v[0]
        if v is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} missing")
        return int(v)


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
                raise GGUFError(f"{path}: tensor {t.name!r} has quant type {t.qtype_name}; the expert kernels read "
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


# weights ------------------------------------------------------------------------------------------
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


def _expert_tensor(reader: GGUFFile, t: TensorEntry, part: str, ffn: int) -> ExpertTensor:
    """Routed-expert projection ``part`` (gate/up/down) from tensor ``t``, its bytes as uint8
    ``(experts, bytes_per_expert)``, a view on the map.

    A fused gate-up tensor is numpy ``(experts, 2*ffn, hidden)``, gate rows first, then up rows."""
    e, rows, cols = t.shape
    raw = reader.raw(t).reshape(e, -1)
    if part in ("gate", "up") and rows == 2 * ffn and "gate_up" in t.name:
        half = raw.shape[1] // 2
        raw = raw[:, :half] if part == "gate" else raw[:, half:]
        rows = ffn
    return ExpertTensor(raw, t.qtype, rows, cols, name=f"{t.name}[{part}]" if "gate_up" in t.name else t.name)


def _dense(reader: GGUFFile, t: TensorEntry) -> np.ndarray:
    """Tensor ``t`` dequantized to float32 in numpy order."""
    return dequantize(reader.raw(t), t.qtype).reshape(t.shape)


def _layer_experts(info: ModelInfo, l: int, reader: GGUFFile, tens: dict, names: dict,
                   bias: dict | None) -> LayerExperts:
    """Block ``l``'s routed experts: raw projections, float32 biases (when the file has all three:
    the expert kernels take all or none) and the architecture's activation."""
    parts = (_expert_tensor(reader, tens[names[k]], k, info.ffn) for k in ("gate", "up", "down"))
    b = {}
    if bias and all(k in bias for k in ("gate", "up", "down")):
        b = {f"{k}_bias": np.ascontiguousarray(bias[k], np.float32) for k in ("gate", "up", "down")}
    return LayerExperts(l, *parts, **b, activation=info.spec.activation)


def load_model(path: str | os.PathLike) -> ModelWeights:
    """Memory-map a GGUF model: dense weights as float32, routed experts as raw blocks (no copy).

    Raises :class:`GGUFError` naming the file and the first tensor the architecture needs and the
    file lacks."""
    reader = GGUFFile(path)
    info = _info_from_reader(reader, str(path))
    tens = {t.name: t for t in reader.tensors}

    def need(name: str):
        if name not in tens:
            raise GGUFError(f"{path}: tensor {name!r} missing ({info.arch} needs it)")
        return _dense(reader, tens[name])

    def opt(name: str):
        return _dense(reader, tens[name]) if name in tens else None

    layers, experts = [], []
    for l in range(info.num_layers):
        names = _expert_names(tens, l)
        layers.append(_dense_layer(info, l, names is not None, need, opt))
        if names:
            experts.append(_layer_experts(info, l, reader, tens, names, layers[-1].expert_bias))
        else:
            experts.append(None)
    emb = need("token_embd.weight")
    out = opt("output.weight")
    return ModelWeights(info, emb, need("output_norm.weight"), emb if out is None else out,
                        tuple(layers), tuple(experts), reader)


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
        shared = {k: need(f"{p}ffn_{k}_shexp.weight") for k in ("gate", "up", "down")}
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
        attn_norm=need(p + "attn_norm.weight"), wq=need(p + "attn_q.weight") if gqa else None,
        wk=need(p + "attn_k.weight") if gqa else None, wv=need(p + "attn_v.weight") if gqa else None,
        wo=need(p + "attn_output.weight"), q_norm=need(p + "attn_q_norm.weight") if qk else None,
        k_norm=need(p + "attn_k_norm.weight") if qk else None, ffn_norm=need(f"{p}{spec.ffn_norm}.weight"),
        router=need(p + "ffn_gate_inp.weight") if moe else None, shared=shared, expert_bias=bias or None,
        dense_ffn=None if moe else {k: need(f"{p}ffn_{k}.weight") for k in ("gate", "up", "down")},
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
        writer.close()
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
