"""Synthetic qwen3moe GGUF models with random weights, of any geometry and expert quant type.

The file is a complete model in llama.cpp's layout: ``general.*`` and ``qwen3moe.*`` metadata, a
byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``: the 256 byte tokens, merges, and the
Qwen control tokens), and every tensor llama.cpp's qwen3moe loader asks for, with its shapes.

Weights are random, deterministic given the seed: each tensor draws from its own generator,
``np.random.default_rng([seed, tensor_index])``, so a tensor does not depend on the order others
are made in. Quantized expert tensors are drawn directly as blocks (random quants, random scales
sized so that a weight has standard deviation about ``1/sqrt(cols)``), which is as fast as writing
bytes; float types are Gaussian values converted to the type. Tensors are produced one at a time
while the file is written (``gguf_io.write_gguf``), so a model of tens of GB needs one tensor of
memory. Norm weights are ``1 + 0.1 * N(0, 1)`` in F32, the router F32, other dense matrices in
``dense_quant`` (F16 by default).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import gguf_io
from .gguf_io import TensorSpec, qtype_value

__all__ = ["SynthConfig", "synth_model", "random_blocks", "tensor_specs", "metadata", "vocabulary", "config_from_preset", "PRESETS"]

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_NORMAL, _CONTROL = 1, 3  # llama.cpp token types
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18, "BF16": 32}

# Geometry presets (``moelab model synth --preset NAME``); fields not given keep SynthConfig's defaults.
PRESETS = {
    "tiny": dict(num_layers=2, num_experts=8, top_k=2, hidden=64, ffn=32, num_heads=4, num_kv_heads=2, vocab=320),
    "qwen3-30b-a3b": dict(num_layers=48, num_experts=128, top_k=8, hidden=2048, ffn=768, num_heads=32,
                          num_kv_heads=4, head_dim=128, vocab=151936, dense_ffn=6144, context_length=40960),
}


@dataclass(frozen=True)
class SynthConfig:
    """Geometry and types of a synthetic model (``head_dim`` 0: ``hidden // num_heads``)."""

    arch: str = "qwen3moe"
    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    hidden: int = 64
    ffn: int = 32
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0
    vocab: int = 320
    dense_ffn: int = 0  # metadata only (qwen3moe has no dense FFN); 0: ffn * top_k
    context_length: int = 4096
    quant: str = "Q8_0"
    dense_quant: str = "F16"
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in gguf_io.SUPPORTED_ARCHS:
            raise ValueError(f"SynthConfig.arch: {self.arch!r}, supported: {', '.join(gguf_io.SUPPORTED_ARCHS)}")
        for name in ("num_layers", "num_experts", "top_k", "hidden", "ffn", "num_heads", "num_kv_heads", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"SynthConfig.{name}: {getattr(self, name)}, expected >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"SynthConfig.top_k: {self.top_k} > num_experts {self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"SynthConfig.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.head_dim == 0:
            if self.hidden % self.num_heads:
                raise ValueError(f"SynthConfig.head_dim: 0 needs hidden {self.hidden} divisible by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"SynthConfig.head_dim: {self.head_dim}, expected an even number >= 2 (RoPE pairs)")
        if self.vocab < 256 + len(CONTROL_TOKENS) + 1:
            raise ValueError(f"SynthConfig.vocab: {self.vocab}, expected >= {256 + len(CONTROL_TOKENS) + 1} "
                             "(256 byte tokens, one merge, the control tokens)")
        if self.quant.upper() not in gguf_io.EXPERT_QTYPES:
            raise ValueError(f"SynthConfig.quant: {self.quant!r}, expected one of {', '.join(gguf_io.EXPERT_QTYPES)}")
        if self.dense_quant.upper() not in ("F32", "F16", "BF16", "Q8_0"):
            raise ValueError(f"SynthConfig.dense_quant: {self.dense_quant!r}, expected F32, F16, BF16 or Q8_0")
        object.__setattr__(self, "quant", self.quant.upper())
        object.__setattr__(self, "dense_quant", self.dense_quant.upper())
        block = gguf_io.block_shape(qtype_value(self.quant))[0]
        for name in ("hidden", "ffn"):
            if getattr(self, name) % block:
                raise ValueError(f"SynthConfig.{name}: {getattr(self, name)} is not a multiple of {self.quant}'s "
                                 f"block size {block} (expert rows are {name} long)")
        dblock = gguf_io.block_shape(qtype_value(self.dense_quant))[0]
        for name, n in (("hidden", self.hidden), ("num_heads*head_dim", self.num_heads * self.head_dim)):
            if n % dblock:
                raise ValueError(f"SynthConfig.dense_quant: {self.dense_quant} needs {name} ({n}) a multiple of {dblock}")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down) in the expert quant type."""
        block, size = gguf_io.block_shape(qtype_value(self.quant))
        return 3 * self.ffn * self.hidden // block * size


# random weights -----------------------------------------------------------------------------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random ``(rows, cols)`` weights of type ``qtype`` as uint8 ``(rows, bytes_per_row)``.

    Quants are uniform and scales vary per block (x0.5..1.5), sized so that the dequantized weights
    have standard deviation about ``std`` and mean about 0. F32/F16/BF16: Gaussian values."""
    qtype = qtype.upper()
    if qtype in ("F32", "F16", "BF16"):
        vals = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        if qtype == "F32":
            return vals.view(np.uint8)
        if qtype == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return gguf_io.quantize(vals, qtype_value("BF16"))
    block, size = gguf_io.block_shape(qtype_value(qtype))
    n = rows * cols // block
    jitter = rng.uniform(0.5, 1.5, n).astype(np.float32)
    out = np.empty((n, size), dtype=np.uint8)
    if qtype == "Q8_0":  # d f16 | qs int8[32]; w = d * q
        out[:, :2] = _f16_bytes(jitter * std / 73.3)  # std of uniform -127..127
        out[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    elif qtype == "Q4_0":  # d f16 | qs u8[16] (two 4-bit quants); w = d * (q - 8)
        out[:, :2] = _f16_bytes(jitter * std / 4.32)  # quants 1..15 (mean 8, std 4.32)
        out[:, 2:] = rng.integers(1, 16, (n, 16), dtype=np.uint8) | (rng.integers(1, 16, (n, 16), dtype=np.uint8) << 4)
    elif qtype == "Q4_K":  # d, dmin f16 | 12 bytes of 6-bit scales and mins | qs u8[128]
        sc = rng.integers(4, 9, (n, 8), dtype=np.uint8)
        m = np.rint(7.5 * sc).astype(np.uint8)  # w = d*sc*q - dmin*m, dmin = d: mean ~0
        d = _f16_bytes(jitter * std / (6.0 * 4.61))
        out[:, 0:2] = d
        out[:, 2:4] = d
        out[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
        out[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
        out[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
        out[:, 16:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    elif qtype == "Q6_K":  # ql u8[128] | qh u8[64] | scales i8[16] | d f16; w = d * sc * (q - 32)
        out[:, :192] = rng.integers(0, 256, (n, 192), dtype=np.uint8)
        out[:, 192:208] = rng.integers(8, 17, (n, 16), dtype=np.int8).view(np.uint8)
        out[:, 208:210] = _f16_bytes(jitter * std / (12.0 * 18.5))  # std of uniform -32..31
    else:
        raise ValueError(f"random_blocks: no generator for quant type {qtype}")
    return out.reshape(rows, -1)


def _matrix(seed: int, index: int, qtype: str, shape: tuple[int, ...]):
    def make():
        rng = np.random.default_rng([seed, index])
        rows = int(np.prod(shape[:-1]))
        return random_blocks(rng, qtype, rows, shape[-1], 1.0 / np.sqrt(shape[-1])).reshape(*shape[:-1], -1)
    return make


def _norm(seed: int, index: int, n: int):
    def make():
        rng = np.random.default_rng([seed, index])
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    return make


def _embedding(seed: int, index: int, qtype: str, shape: tuple[int, int]):
    def make():
        rng = np.random.default_rng([seed, index])
        return random_blocks(rng, qtype, shape[0], shape[1], 1.0)
    return make


def tensor_specs(cfg: SynthConfig) -> list[TensorSpec]:
    """Every tensor of the model, named and shaped (numpy order) as llama.cpp's qwen3moe loader asks."""
    h, hd, e, f = cfg.hidden, cfg.head_dim, cfg.num_experts, cfg.ffn
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    dq, xq, f32 = qtype_value(cfg.dense_quant), qtype_value(cfg.quant), qtype_value("F32")
    specs: list[TensorSpec] = []

    def add(name, shape, qtype, kind):
        i = len(specs)
        qn = gguf_io.qtype_name(qtype)
        make = {"norm": lambda: _norm(cfg.seed, i, shape[0]), "mat": lambda: _matrix(cfg.seed, i, qn, shape),
                "emb": lambda: _embedding(cfg.seed, i, qn, shape)}[kind]()
        specs.append(TensorSpec(name, shape, qtype, make))

    add("token_embd.weight", (cfg.vocab, h), dq, "emb")
    add("output_norm.weight", (h,), f32, "norm")
    add("output.weight", (cfg.vocab, h), dq, "mat")
    for l in range(cfg.num_layers):
        p = f"blk.{l}."
        add(p + "attn_norm.weight", (h,), f32, "norm")
        add(p + "attn_q.weight", (q, h), dq, "mat")
        add(p + "attn_k.weight", (kv, h), dq, "mat")
        add(p + "attn_v.weight", (kv, h), dq, "mat")
        add(p + "attn_output.weight", (h, q), dq, "mat")
        add(p + "attn_q_norm.weight", (hd,), f32, "norm")
        add(p + "attn_k_norm.weight", (hd,), f32, "norm")
        add(p + "ffn_norm.weight", (h,), f32, "norm")
        add(p + "ffn_gate_inp.weight", (e, h), f32, "mat")
        add(p + "ffn_gate_exps.weight", (e, f, h), xq, "mat")
        add(p + "ffn_up_exps.weight", (e, f, h), xq, "mat")
        add(p + "ffn_down_exps.weight", (e, h, f), xq, "mat")
    return specs


# metadata and vocabulary --------------------------------------------------------------------------
def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes map to themselves, the rest above 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def vocabulary(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)``: the 256 byte tokens, ``vocab - 259`` merged tokens (merge i
    joins token ``i // 256`` with byte token ``i % 256``; all distinct), then the control tokens."""
    tokens = _byte_chars()
    merges = []
    for i in range(vocab - 256 - len(CONTROL_TOKENS)):
        left, right = tokens[i // 256], tokens[i % 256]
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types = [_NORMAL] * len(tokens) + [_CONTROL] * len(CONTROL_TOKENS)
    return tokens + list(CONTROL_TOKENS), types, merges


def metadata(cfg: SynthConfig) -> list[tuple[str, object, str]]:
    """The ``(key, value, kind)`` metadata of the model (``general.architecture`` added by the writer)."""
    a = cfg.arch
    tokens, types, merges = vocabulary(cfg.vocab)
    eos = cfg.vocab - 1  # <|im_end|>
    pad = cfg.vocab - len(CONTROL_TOKENS)  # <|endoftext|>
    return [
        ("general.name", f"moelab synthetic {a} L{cfg.num_layers} E{cfg.num_experts} k{cfg.top_k} {cfg.quant} seed {cfg.seed}", "str"),
        ("general.file_type", _FILE_TYPES[cfg.quant], "u32"),
        ("general.quantization_version", 2, "u32"),
        (f"{a}.block_count", cfg.num_layers, "u32"),
        (f"{a}.context_length", cfg.context_length, "u32"),
        (f"{a}.embedding_length", cfg.hidden, "u32"),
        (f"{a}.feed_forward_length", cfg.dense_ffn or cfg.ffn * cfg.top_k, "u32"),
        (f"{a}.expert_feed_forward_length", cfg.ffn, "u32"),
        (f"{a}.attention.head_count", cfg.num_heads, "u32"),
        (f"{a}.attention.head_count_kv", cfg.num_kv_heads, "u32"),
        (f"{a}.attention.key_length", cfg.head_dim, "u32"),
        (f"{a}.attention.value_length", cfg.head_dim, "u32"),
        (f"{a}.rope.freq_base", float(cfg.rope_theta), "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_eps), "f32"),
        (f"{a}.expert_count", cfg.num_experts, "u32"),
        (f"{a}.expert_used_count", cfg.top_k, "u32"),
        ("tokenizer.ggml.model", "gpt2", "str"),
        ("tokenizer.ggml.pre", "qwen2", "str"),
        ("tokenizer.ggml.tokens", tokens, "[str]"),
        ("tokenizer.ggml.token_type", types, "[i32]"),
        ("tokenizer.ggml.merges", merges, "[str]"),
        ("tokenizer.ggml.eos_token_id", eos, "u32"),
        ("tokenizer.ggml.padding_token_id", pad, "u32"),
        ("tokenizer.ggml.bos_token_id", pad, "u32"),
        ("tokenizer.ggml.add_bos_token", False, "bool"),
    ]


class _Progress:
    """Tensor-count and byte progress on stderr, at most every ~5% of the bytes."""

    def __init__(self, specs: list[TensorSpec], stream=sys.stderr):
        self.sizes = {s.name: s.nbytes for s in specs}
        self.total = sum(self.sizes.values())
        self.done = self.shown = 0
        self.stream = stream

    def __call__(self, i: int, n: int, name: str) -> None:
        big = self.total >= 64 * 2**20
        if (big and self.done - self.shown >= self.total / 20) or i == n - 1:
            print(f"synth: tensor {i + 1}/{n} ({name}), {self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB",
                  file=self.stream, flush=True)
            self.shown = self.done
        self.done += self.sizes[name]


def synth_model(path: str | Path, cfg: SynthConfig, progress: bool = False) -> Path:
    """Write the synthetic model ``cfg`` to ``path`` (atomically); returns the path."""
    specs = tensor_specs(cfg)
    gguf_io.write_gguf(path, cfg.arch, metadata(cfg), specs, _Progress(specs) if progress else None)
    return Path(path)


def config_from_preset(name: str, **overrides) -> SynthConfig:
    """A :class:`SynthConfig` from ``PRESETS[name]`` with ``overrides`` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: expected one of {', '.join(PRESETS)}")
    return SynthConfig(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}})
