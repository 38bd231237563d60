"""Synthetic GGUF MoE models with random weights, of any supported architecture, geometry and
expert quant type.

The file is a complete model in llama.cpp's layout: ``general.*`` and ``{arch}.*`` metadata, a
vocabulary, a chat template, and every tensor llama.cpp's loader of that architecture asks for,
with its shapes (:data:`execute.archs.ARCHS`). Vocabularies: byte-level BPE
(``tokenizer.ggml.model = "gpt2"``: the 256 byte tokens, merges, control tokens) for every
architecture but ``llama``, which gets a SentencePiece vocabulary (``"llama"``: ``<unk>``, ``<s>``,
``</s>``, 256 byte-fallback tokens, single characters and scored merged pieces). The chat template
is ChatML, Mistral's ``[INST]`` form (llama) or gpt-oss's harmony form, each the short common shape
``execute.tokenizer`` recognises, not a vendor's full template.

Architecture traits of the tiny models: qwen2moe has q/k/v biases and a gated shared expert;
olmoe full-width q/k norms (so kv heads = heads); granitemoe its four multipliers and a tied
output; gpt-oss attention biases, sinks, a sliding window on even blocks, YaRN RoPE, a router bias
and expert biases; deepseek2 MLA (q_lora and kv_lora ranks of hidden/2, rope half of a key head), a
leading dense block, one shared expert and grouped sigmoid routing with a selection bias. MLA is
written in current llama.cpp's layout (``attn_k_b``/``attn_v_b`` in F32, one kv head) unless
``mla="kv_b"`` asks for the older ``attn_kv_b``; one seed gives the same model in both.

Metadata is what llama.cpp's loader of the architecture sizes the tensors by
(``ArchSpec.expert_width``): ``feed_forward_length`` is the routed experts' width for llama, olmoe
and granitemoe, the dense width (``dense_ffn``) for the others.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import gguf_io
from . import quant as Q
from .gguf_io import TensorSpec, qtype_value

__all__ = ["SynthConfig", "synth_model", "random_blocks", "tensor_specs", "metadata", "vocabulary", "config_from_preset", "PRESETS"]

from .archs import ARCHS

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
HARMONY_TOKENS = ("<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>")
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # llama.cpp token types
CHAT_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "mistral": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
                "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "harmony": ("{% for message in messages %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + "
                "'<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"),
}
# llama.cpp's general.file_type of a file whose experts are of a type (the K types: its _M preset)
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12,
               "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XXS": 23, "IQ1_S": 24,
               "IQ4_NL": 25, "IQ3_S": 26, "IQ2_S": 28, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "MXFP4": 38}

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
    dense_ffn: int = 0  # width of dense blocks (deepseek2's leading one; metadata only elsewhere); 0: ffn * top_k
    context_length: int = 4096
    quant: str = "Q8_0"
    dense_quant: str = "F16"
    down_quant: str = ""  # the experts' down projection's type ("": quant), e.g. Q6_K in a Q4_K_M-style file
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    mla: str = "split"  # deepseek2: "split" (attn_k_b / attn_v_b) or "kv_b" (the older attn_kv_b)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
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
        if self.vocab < min_vocab(self.arch):
            raise ValueError(f"SynthConfig.vocab: {self.vocab}, expected >= {min_vocab(self.arch)} for {self.arch} "
                             "(byte tokens, single characters, one merge, the control tokens)")
        if self.arch == "olmoe" and self.num_kv_heads != self.num_heads:
            raise ValueError(f"SynthConfig.num_kv_heads: {self.num_kv_heads}; olmoe's full-width k norm needs "
                             f"num_kv_heads = num_heads ({self.num_heads})")
        if ARCHS[self.arch].q_width == "hidden" and self.num_heads * self.head_dim != self.hidden:
            raise ValueError(f"SynthConfig.head_dim: {self.head_dim}; llama.cpp's {self.arch} loader needs "
                             f"num_heads * head_dim = hidden ({self.hidden})")
        if self.mla not in ("split", "kv_b"):
            raise ValueError(f"SynthConfig.mla: {self.mla!r}, expected 'split' or 'kv_b'")
        if self.quant.upper() not in gguf_io.EXPERT_QTYPES:
            raise ValueError(f"SynthConfig.quant: {self.quant!r}, expected one of {', '.join(gguf_io.EXPERT_QTYPES)}")
        if self.dense_quant.upper() not in ("F32", "F16", "BF16", "Q8_0"):
            raise ValueError(f"SynthConfig.dense_quant: {self.dense_quant!r}, expected F32, F16, BF16 or Q8_0")
        if self.down_quant and self.down_quant.upper() not in gguf_io.EXPERT_QTYPES:
            raise ValueError(f"SynthConfig.down_quant: {self.down_quant!r}, expected '' or one of "
                             f"{', '.join(gguf_io.EXPERT_QTYPES)}")
        object.__setattr__(self, "quant", self.quant.upper())
        object.__setattr__(self, "dense_quant", self.dense_quant.upper())
        object.__setattr__(self, "down_quant", self.down_quant.upper() or self.quant)
        for name, quant in (("hidden", self.quant), ("ffn", self.quant), ("ffn", self.down_quant)):
            block = gguf_io.block_shape(qtype_value(quant))[0]
            if getattr(self, name) % block:
                raise ValueError(f"SynthConfig.{name}: {getattr(self, name)} is not a multiple of {quant}'s "
                                 f"block size {block} (expert rows are {name} long)")
        dblock = gguf_io.block_shape(qtype_value(self.dense_quant))[0]
        for name, n in (("hidden", self.hidden), ("num_heads*head_dim", self.num_heads * self.head_dim)):
            if n % dblock:
                raise ValueError(f"SynthConfig.dense_quant: {self.dense_quant} needs {name} ({n}) a multiple of {dblock}")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate + up + down) in the expert quant types."""
        block, size = gguf_io.block_shape(qtype_value(self.quant))
        dblock, dsize = gguf_io.block_shape(qtype_value(self.down_quant))
        return 2 * self.ffn * self.hidden // block * size + self.ffn * self.hidden // dblock * dsize


# random weights -----------------------------------------------------------------------------------
def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random ``(rows, cols)`` weights of type ``qtype`` as uint8 ``(rows, bytes_per_row)``.

    Quants are uniform and scales vary per block (x0.5..1.5), sized so that the dequantized weights
    have standard deviation about ``std`` and mean about 0 (other types than those below:
    ``quant.random_blocks``, std about ``std``, mean not controlled). F32/F16/BF16: Gaussian values."""
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
    elif qtype == "MXFP4":  # e u8 (E8M0) | qs u8[16] (two 4-bit E2M1 codes); w = code value * 2^(e - 128)
        e = np.rint(np.log2(jitter * std / 5.85)) + 128  # codes' values have std 5.85
        out[:, 0] = np.clip(e, 0, 254).astype(np.uint8)
        out[:, 1:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    else:  # any other layout: random bytes, every f16 scale sized so the weights' std is about std
        qt = Q.QTYPE_BY_NAME[qtype]
        probe = Q.dequantize(Q.random_blocks(np.random.default_rng(0), qt, 4, cols, 1.0), qt, cols).std()
        return Q.random_blocks(rng, qt, rows, cols, std / float(probe))
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


def _bias(seed: int, index: int, shape: tuple[int, ...]):
    def make():
        rng = np.random.default_rng([seed, index])
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return make


def _embedding(seed: int, index: int, qtype: str, shape: tuple[int, int]):
    def make():
        rng = np.random.default_rng([seed, index])
        return random_blocks(rng, qtype, shape[0], shape[1], 1.0)
    return make


def _mla_split(cfg: SynthConfig, index: int, kv_b: tuple[int, int], part: str):
    """attn_k_b ``(heads, kv_lora, nope)`` or attn_v_b ``(heads, v, kv_lora)``, F32, cut from the
    attn_kv_b ``(heads*(nope+v), kv_lora)`` that draw ``index`` makes in the dense type: per head,
    the nope rows (transposed) and the v rows, dequantized (so exactly the same model). F32
    because llama.cpp's CPU backend fails on this absorbed-attention path with F16 or Q8_0
    k_b/v_b once nope >= 16 (no kernel, or NaN logits)."""
    def make():
        m, dq = _mla_dims(cfg), cfg.dense_quant
        raw = _matrix(cfg.seed, index, dq, kv_b)()
        vals = gguf_io.dequantize(raw, qtype_value(dq)).reshape(cfg.num_heads, m["nope"] + m["v"], -1)
        out = vals[:, m["nope"]:] if part == "v" else vals[:, :m["nope"]].transpose(0, 2, 1)
        return np.ascontiguousarray(out, np.float32)
    return make


def _mla_dims(cfg: SynthConfig) -> dict:
    """deepseek2's attention sizes in a tiny model: ranks hidden/2, rope half of a key head."""
    rd = cfg.head_dim // 2
    return {"q_lora": cfg.hidden // 2, "kv_lora": cfg.hidden // 2, "rope": rd, "nope": cfg.head_dim - rd,
            "v": cfg.head_dim}


def _attention_specs(cfg: SynthConfig, p: str, add) -> None:
    spec, h, hd, dq, f32 = ARCHS[cfg.arch], cfg.hidden, cfg.head_dim, qtype_value(cfg.dense_quant), qtype_value("F32")
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    add(p + "attn_norm.weight", (h,), f32, "norm")
    if spec.attn == "mla":
        m = _mla_dims(cfg)
        add(p + "attn_q_a.weight", (m["q_lora"], h), dq, "mat")
        add(p + "attn_q_a_norm.weight", (m["q_lora"],), f32, "norm")
        add(p + "attn_q_b.weight", (cfg.num_heads * hd, m["q_lora"]), dq, "mat")
        add(p + "attn_kv_a_mqa.weight", (m["kv_lora"] + m["rope"], h), dq, "mat")
        add(p + "attn_kv_a_norm.weight", (m["kv_lora"],), f32, "norm")
        kv_b = (cfg.num_heads * (m["nope"] + m["v"]), m["kv_lora"])
        if cfg.mla == "kv_b":
            add(p + "attn_kv_b.weight", kv_b, dq, "mat")
        else:  # the same draw as attn_kv_b, split per head the way llama.cpp's converter does
            add(p + "attn_k_b.weight", (cfg.num_heads, m["kv_lora"], m["nope"]), f32, "k_b", kv_b)
            add(p + "attn_v_b.weight", (cfg.num_heads, m["v"], m["kv_lora"]), f32, "v_b", kv_b)
        add(p + "attn_output.weight", (h, cfg.num_heads * m["v"]), dq, "mat")
        return
    add(p + "attn_q.weight", (q, h), dq, "mat")
    add(p + "attn_k.weight", (kv, h), dq, "mat")
    add(p + "attn_v.weight", (kv, h), dq, "mat")
    add(p + "attn_output.weight", (h, q), dq, "mat")
    if spec.attn_bias:
        for n, size in (("q", q), ("k", kv), ("v", kv)):
            add(f"{p}attn_{n}.bias", (size,), f32, "bias")
        if cfg.arch == "gpt-oss":
            add(p + "attn_output.bias", (h,), f32, "bias")
    if spec.sinks:
        add(p + "attn_sinks.weight", (cfg.num_heads,), f32, "bias")
    if spec.qk_norm == "head":
        add(p + "attn_q_norm.weight", (hd,), f32, "norm")
        add(p + "attn_k_norm.weight", (hd,), f32, "norm")
    elif spec.qk_norm == "full":
        add(p + "attn_q_norm.weight", (q,), f32, "norm")
        add(p + "attn_k_norm.weight", (kv,), f32, "norm")


def _ffn_specs(cfg: SynthConfig, l: int, p: str, add) -> None:
    spec, h, e, f = ARCHS[cfg.arch], cfg.hidden, cfg.num_experts, cfg.ffn
    dq, xq, f32 = qtype_value(cfg.dense_quant), qtype_value(cfg.quant), qtype_value("F32")
    add(f"{p}{spec.ffn_norm}.weight", (h,), f32, "norm")
    if l < leading_dense(cfg):
        df = dense_ffn(cfg)
        add(p + "ffn_gate.weight", (df, h), dq, "mat")
        add(p + "ffn_up.weight", (df, h), dq, "mat")
        add(p + "ffn_down.weight", (h, df), dq, "mat")
        return
    add(p + "ffn_gate_inp.weight", (e, h), f32, "mat")
    if spec.activation == "swiglu_oai":
        add(p + "ffn_gate_inp.bias", (e,), f32, "bias")
    if spec.gating == "sigmoid" or cfg.arch == "deepseek2":
        add(p + "exp_probs_b.bias", (e,), f32, "bias")
    add(p + "ffn_gate_exps.weight", (e, f, h), xq, "mat")
    add(p + "ffn_up_exps.weight", (e, f, h), xq, "mat")
    add(p + "ffn_down_exps.weight", (e, h, f), qtype_value(cfg.down_quant), "mat")
    if spec.activation == "swiglu_oai":
        add(p + "ffn_gate_exps.bias", (e, f), f32, "bias")
        add(p + "ffn_up_exps.bias", (e, f), f32, "bias")
        add(p + "ffn_down_exps.bias", (e, h), f32, "bias")
    if spec.shared != "none":
        sf = shared_ffn(cfg)
        if spec.shared == "gated":
            add(p + "ffn_gate_inp_shexp.weight", (h,), f32, "mat")
        add(p + "ffn_gate_shexp.weight", (sf, h), dq, "mat")
        add(p + "ffn_up_shexp.weight", (sf, h), dq, "mat")
        add(p + "ffn_down_shexp.weight", (h, sf), dq, "mat")


def leading_dense(cfg: SynthConfig) -> int:
    """Dense blocks before the MoE blocks (deepseek2: 1 when there are >= 2 blocks)."""
    return 1 if cfg.arch == "deepseek2" and cfg.num_layers > 1 else 0


def dense_ffn(cfg: SynthConfig) -> int:
    return cfg.dense_ffn or cfg.ffn * cfg.top_k


def shared_ffn(cfg: SynthConfig) -> int:
    """Width of the shared expert: qwen2moe 2 x ffn, deepseek2 one expert's ffn."""
    return 2 * cfg.ffn if cfg.arch == "qwen2moe" else cfg.ffn


def tensor_specs(cfg: SynthConfig) -> list[TensorSpec]:
    """Every tensor of the model, named and shaped (numpy order) as llama.cpp's loader of
    ``cfg.arch`` asks."""
    h, dq, f32 = cfg.hidden, qtype_value(cfg.dense_quant), qtype_value("F32")
    specs: list[TensorSpec] = []
    draws = [0]  # generator index of the next draw; attn_k_b and attn_v_b share attn_kv_b's draw

    def add(name, shape, qtype, kind, kv_b=None):
        i = draws[0] - 1 if kind == "v_b" else draws[0]
        draws[0] = i + 1
        qn = gguf_io.qtype_name(qtype)
        make = {"norm": lambda: _norm(cfg.seed, i, shape[0]), "mat": lambda: _matrix(cfg.seed, i, qn, shape),
                "emb": lambda: _embedding(cfg.seed, i, qn, shape), "bias": lambda: _bias(cfg.seed, i, shape),
                "k_b": lambda: _mla_split(cfg, i, kv_b, "k"), "v_b": lambda: _mla_split(cfg, i, kv_b, "v"),
                }[kind]()
        specs.append(TensorSpec(name, shape, qtype, make))

    add("token_embd.weight", (cfg.vocab, h), dq, "emb")
    add("output_norm.weight", (h,), f32, "norm")
    if cfg.arch != "granitemoe":  # granite ties its output to the embedding
        add("output.weight", (cfg.vocab, h), dq, "mat")
    for l in range(cfg.num_layers):
        _attention_specs(cfg, f"blk.{l}.", add)
        _ffn_specs(cfg, l, f"blk.{l}.", add)
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


def vocabulary(vocab: int, controls: tuple[str, ...] = CONTROL_TOKENS) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)`` of a byte-level BPE vocabulary: the 256 byte tokens,
    ``vocab - 256 - len(controls)`` merged tokens (merge i joins token ``i // 256`` with byte token
    ``i % 256``; all distinct), then the control tokens."""
    tokens = _byte_chars()
    merges = []
    for i in range(vocab - 256 - len(controls)):
        left, right = tokens[i // 256], tokens[i % 256]
        merges.append(f"{left} {right}")
        tokens.append(left + right)
    types = [_NORMAL] * len(tokens) + [_CONTROL] * len(controls)
    return tokens + list(controls), types, merges


SPM_SPACE = "\u2581"  # SentencePiece's visible space
_SPM_CHARS = [SPM_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
_SPM_COMMON = SPM_SPACE + "etaoinshrdlucmfwypvbgk"


def spm_vocabulary(vocab: int) -> tuple[list[str], list[float], list[int]]:
    """``(tokens, scores, token_types)`` of a SentencePiece vocabulary: ``<unk>``, ``<s>``, ``</s>``,
    the 256 byte-fallback tokens ``<0xXX>``, the single characters (space as U+2581 and printable
    ASCII), then pairs of common characters as merged pieces, higher score first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    scores = [0.0] * len(tokens)
    for i, c in enumerate(_SPM_CHARS):
        tokens.append(c)
        types.append(_NORMAL)
        scores.append(-1000.0 - i)
    pairs = [a + b for a in _SPM_COMMON for b in _SPM_COMMON if b != SPM_SPACE]
    for i in range(vocab - len(tokens)):
        tokens.append(pairs[i % len(pairs)] + (_SPM_COMMON[1 + i // len(pairs)] if i >= len(pairs) else ""))
        types.append(_NORMAL)
        scores.append(-1.0 - i)
    return tokens, scores, types


def min_vocab(arch: str) -> int:
    """Smallest vocabulary a synthetic model of ``arch`` can have."""
    if ARCHS[arch].tokenizer == "llama":
        return 3 + 256 + len(_SPM_CHARS) + 1
    return 256 + len(HARMONY_TOKENS if ARCHS[arch].chat == "harmony" else CONTROL_TOKENS) + 1


def _tokenizer_metadata(cfg: SynthConfig) -> list[tuple[str, object, str]]:
    spec = ARCHS[cfg.arch]
    chat = [("tokenizer.chat_template", CHAT_TEMPLATES[spec.chat], "str")]
    if spec.tokenizer == "llama":
        tokens, scores, types = spm_vocabulary(cfg.vocab)
        return [("tokenizer.ggml.model", "llama", "str"), ("tokenizer.ggml.tokens", tokens, "[str]"),
                ("tokenizer.ggml.scores", scores, "[f32]"), ("tokenizer.ggml.token_type", types, "[i32]"),
                ("tokenizer.ggml.unknown_token_id", 0, "u32"), ("tokenizer.ggml.bos_token_id", 1, "u32"),
                ("tokenizer.ggml.eos_token_id", 2, "u32"), ("tokenizer.ggml.add_bos_token", True, "bool"),
                ("tokenizer.ggml.add_space_prefix", True, "bool")] + chat
    controls = HARMONY_TOKENS if spec.chat == "harmony" else CONTROL_TOKENS
    tokens, types, merges = vocabulary(cfg.vocab, controls)
    eos = tokens.index("<|im_end|>" if spec.chat == "chatml" else "<|return|>")
    pad = tokens.index("<|endoftext|>")
    return [("tokenizer.ggml.model", "gpt2", "str"), ("tokenizer.ggml.pre", "qwen2", "str"),
            ("tokenizer.ggml.tokens", tokens, "[str]"), ("tokenizer.ggml.token_type", types, "[i32]"),
            ("tokenizer.ggml.merges", merges, "[str]"), ("tokenizer.ggml.eos_token_id", eos, "u32"),
            ("tokenizer.ggml.padding_token_id", pad, "u32"), ("tokenizer.ggml.bos_token_id", pad, "u32"),
            ("tokenizer.ggml.add_bos_token", False, "bool")] + chat


def _arch_metadata(cfg: SynthConfig) -> list[tuple[str, object, str]]:
    """Keys beyond the common geometry that the architecture's loader reads."""
    a = cfg.arch
    if a == "granitemoe":
        return [(f"{a}.embedding_scale", 12.0, "f32"), (f"{a}.residual_scale", 0.22, "f32"),
                (f"{a}.attention.scale", 0.0078125 * 16 / cfg.head_dim, "f32"), (f"{a}.logit_scale", 6.0, "f32")]
    if a == "gpt-oss":
        return [(f"{a}.attention.sliding_window", 4, "u32"), (f"{a}.rope.scaling.type", "yarn", "str"),
                (f"{a}.rope.scaling.factor", 4.0, "f32"), (f"{a}.rope.scaling.original_context_length", 64, "u32")]
    if a == "qwen2moe":
        return [(f"{a}.expert_shared_feed_forward_length", shared_ffn(cfg), "u32")]
    if a == "deepseek2":
        m = _mla_dims(cfg)
        groups = 4 if cfg.num_experts % 4 == 0 and cfg.num_experts >= 8 else 1
        return [(f"{a}.leading_dense_block_count", leading_dense(cfg), "u32"), (f"{a}.expert_shared_count", 1, "u32"),
                (f"{a}.expert_weights_scale", 2.5, "f32"), (f"{a}.expert_weights_norm", True, "bool"),
                (f"{a}.expert_gating_func", 2, "u32"), (f"{a}.expert_group_count", groups, "u32"),
                (f"{a}.expert_group_used_count", max(groups // 2, 1), "u32"),
                (f"{a}.attention.q_lora_rank", m["q_lora"], "u32"), (f"{a}.attention.kv_lora_rank", m["kv_lora"], "u32"),
                (f"{a}.rope.dimension_count", m["rope"], "u32")] + _mla_metadata(cfg)
    return []


def _mla_metadata(cfg: SynthConfig) -> list[tuple[str, object, str]]:
    """MLA head sizes as llama.cpp reads them. Split layout (``attn_k_b``/``attn_v_b``): attention
    is one compressed kv head, so ``head_count_kv`` 1, ``key_length`` kv_lora + rope,
    ``value_length`` kv_lora, and the per-head sizes in ``key_length_mla``/``value_length_mla``
    (llama.cpp takes their presence as the split layout). ``attn_kv_b`` layout: keys and values
    decompressed for every head, ``head_count_kv`` = ``head_count``, no ``*_mla`` keys."""
    if cfg.mla != "split":
        return []
    a, m = cfg.arch, _mla_dims(cfg)
    return [(f"{a}.attention.key_length_mla", cfg.head_dim, "u32"), (f"{a}.attention.value_length_mla", m["v"], "u32")]


def metadata(cfg: SynthConfig) -> list[tuple[str, object, str]]:
    """The ``(key, value, kind)`` metadata of the model (``general.architecture`` added by the writer)."""
    a = cfg.arch
    kdim, vdim, kv_heads = cfg.head_dim, cfg.head_dim, cfg.num_kv_heads
    if ARCHS[a].attn == "mla":  # see _mla_metadata
        m = _mla_dims(cfg)
        kdim, vdim, kv_heads = (m["kv_lora"] + m["rope"], m["kv_lora"], 1) if cfg.mla == "split" else (
            cfg.head_dim, m["v"], cfg.num_heads)
    return [
        ("general.name", f"moelab synthetic {a} L{cfg.num_layers} E{cfg.num_experts} k{cfg.top_k} {cfg.quant} seed {cfg.seed}", "str"),
        ("general.file_type", _FILE_TYPES[cfg.quant], "u32"),
        ("general.quantization_version", 2, "u32"),
        (f"{a}.block_count", cfg.num_layers, "u32"),
        (f"{a}.context_length", cfg.context_length, "u32"),
        (f"{a}.embedding_length", cfg.hidden, "u32"),
        (f"{a}.feed_forward_length", cfg.ffn if ARCHS[a].expert_width == "ffn" else dense_ffn(cfg), "u32"),
        (f"{a}.expert_feed_forward_length", cfg.ffn, "u32"),
        (f"{a}.attention.head_count", cfg.num_heads, "u32"),
        (f"{a}.attention.head_count_kv", kv_heads, "u32"),
        (f"{a}.attention.key_length", kdim, "u32"),
        (f"{a}.attention.value_length", vdim, "u32"),
        (f"{a}.rope.freq_base", float(cfg.rope_theta), "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_eps), "f32"),
        (f"{a}.expert_count", cfg.num_experts, "u32"),
        (f"{a}.expert_used_count", cfg.top_k, "u32"),
    ] + _arch_metadata(cfg) + _tokenizer_metadata(cfg)


def synth_model(path: str | Path, cfg: SynthConfig, progress: bool = False) -> Path:
    """Write the synthetic model ``cfg`` to ``path`` (atomically); returns the path. ``progress``:
    a bar of the bytes written on stderr."""
    from tqdm import tqdm

    specs = tensor_specs(cfg)
    before = np.cumsum([0] + [s.nbytes for s in specs])  # bytes written before tensor i
    with tqdm(total=int(before[-1]), unit="B", unit_scale=True, desc="model synth",
              disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        def step(i: int, n: int, name: str) -> None:
            bar.set_postfix_str(f"tensor {i + 1}/{n}", refresh=False)
            bar.update(int(before[i]) - bar.n)

        gguf_io.write_gguf(path, cfg.arch, metadata(cfg), specs, step)
        bar.update(bar.total - bar.n)
    return Path(path)


def config_from_preset(name: str, **overrides) -> SynthConfig:
    """A :class:`SynthConfig` from ``PRESETS[name]`` with ``overrides`` (None values ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: expected one of {', '.join(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    base = dict(PRESETS[name])
    arch = given.get("arch", "qwen3moe")
    if arch in ARCHS and name == "tiny":  # the tiny preset adapts to what the architecture needs
        base["vocab"] = max(base["vocab"], 512 if ARCHS[arch].tokenizer == "llama" else min_vocab(arch))
        if arch == "olmoe":
            base["num_kv_heads"] = given.get("num_heads", base["num_heads"])
    return SynthConfig(**{**base, **given})
