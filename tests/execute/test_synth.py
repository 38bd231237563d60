"""execute.synth: complete qwen3moe GGUFs as llama.cpp's loader expects them, deterministic by seed.

The expected tensor table is llama.cpp's qwen3moe ``load_tensors`` (``create_tensor`` calls, GGUF
dimension order) and the metadata keys its hparams loader reads; the file is read back with gguf's
own reader, independently of ``execute.gguf_io``.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from execute import gguf_io, synth
from execute.cli_model import model_main
from execute.synth import SynthConfig

from .conftest import K_QUANTS, SMALL_QUANTS, tiny_config

gguf = pytest.importorskip("gguf")
QUANTS = SMALL_QUANTS + K_QUANTS + ("MXFP4",)


def llama_cpp_tensors(cfg: SynthConfig) -> dict[str, tuple[int, ...]]:
    """name -> GGUF shape, as llama.cpp's qwen3moe loader creates them."""
    n_embd, n_vocab, hd = cfg.hidden, cfg.vocab, cfg.head_dim
    gqa = hd * cfg.num_kv_heads
    t = {"token_embd.weight": (n_embd, n_vocab), "output_norm.weight": (n_embd,), "output.weight": (n_embd, n_vocab)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        t.update({
            p + "attn_norm.weight": (n_embd,), p + "attn_q.weight": (n_embd, hd * cfg.num_heads),
            p + "attn_k.weight": (n_embd, gqa), p + "attn_v.weight": (n_embd, gqa),
            p + "attn_output.weight": (hd * cfg.num_heads, n_embd), p + "attn_k_norm.weight": (hd,),
            p + "attn_q_norm.weight": (hd,), p + "ffn_norm.weight": (n_embd,),
            p + "ffn_gate_inp.weight": (n_embd, cfg.num_experts),
            p + "ffn_gate_exps.weight": (n_embd, cfg.ffn, cfg.num_experts),
            p + "ffn_down_exps.weight": (cfg.ffn, n_embd, cfg.num_experts),
            p + "ffn_up_exps.weight": (n_embd, cfg.ffn, cfg.num_experts),
        })
    return t


REQUIRED_KEYS = ["general.architecture", "qwen3moe.block_count", "qwen3moe.context_length",
                 "qwen3moe.embedding_length", "qwen3moe.feed_forward_length", "qwen3moe.expert_feed_forward_length",
                 "qwen3moe.attention.head_count", "qwen3moe.attention.head_count_kv", "qwen3moe.attention.key_length",
                 "qwen3moe.attention.value_length", "qwen3moe.rope.freq_base",
                 "qwen3moe.attention.layer_norm_rms_epsilon", "qwen3moe.expert_count", "qwen3moe.expert_used_count",
                 "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"]


@pytest.mark.parametrize("quant", QUANTS)
def test_tensor_table_matches_llama_cpp(quant, synth_path):
    cfg = tiny_config(quant)
    reader = gguf.GGUFReader(synth_path(quant))
    got = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert got == llama_cpp_tensors(cfg)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for name, ty in types.items():
        if name.endswith("_exps.weight"):
            assert ty == quant
        elif name.endswith("norm.weight") or "ffn_gate_inp" in name:
            assert ty == "F32"  # llama.cpp keeps norms and the router in F32
        else:
            assert ty == "F16"


def test_metadata_keys_and_values(synth_path):
    cfg = tiny_config("Q8_0")
    reader = gguf.GGUFReader(synth_path("Q8_0"))
    for key in REQUIRED_KEYS:
        assert reader.get_field(key) is not None, key
    val = lambda k: reader.get_field(k).contents()  # noqa: E731
    assert val("general.architecture") == "qwen3moe"
    assert val("qwen3moe.expert_count") == cfg.num_experts and val("qwen3moe.expert_used_count") == cfg.top_k
    assert val("qwen3moe.attention.key_length") == cfg.head_dim
    assert reader.get_field("qwen3moe.block_count").types == [gguf.GGUFValueType.UINT32]
    assert reader.get_field("qwen3moe.rope.freq_base").types == [gguf.GGUFValueType.FLOAT32]


def test_vocabulary_is_consistent(synth_path):
    reader = gguf.GGUFReader(synth_path("Q8_0"))
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    merges = reader.get_field("tokenizer.ggml.merges").contents()
    assert len(tokens) == len(types) == 320 and len(set(tokens)) == 320
    assert len(merges) == 320 - 256 - 3
    ids = {t: i for i, t in enumerate(tokens)}
    for m in merges:
        left, right = m.split(" ")
        assert left in ids and right in ids and left + right in ids
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[-3:] == [3, 3, 3]
    assert reader.get_field("tokenizer.ggml.eos_token_id").contents() == 319
    assert len(set(tokens[:256])) == 256 and all(" " not in t for t in tokens[:256])


@pytest.mark.parametrize("quant", QUANTS)
def test_random_weights_are_sane(quant, tiny_weights):
    w = tiny_weights(quant)
    layer = w.experts[0]
    for t in (layer.gate, layer.down):
        vals = gguf_io.dequantize(t.data, t.qtype)
        assert np.isfinite(vals).all()
        std = 1 / np.sqrt(t.cols)
        assert 0.7 * std < vals.std() < 1.4 * std, (t.name, vals.std(), std)
        assert abs(vals.mean()) < 0.1 * std


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_by_seed(tmp_path):
    a = synth.synth_model(tmp_path / "a.gguf", tiny_config("Q4_0", seed=5))
    b = synth.synth_model(tmp_path / "b.gguf", tiny_config("Q4_0", seed=5))
    c = synth.synth_model(tmp_path / "c.gguf", tiny_config("Q4_0", seed=6))
    assert _digest(a) == _digest(b) != _digest(c)


@pytest.mark.parametrize("field,value,match", [
    ("top_k", 9, "top_k"), ("num_kv_heads", 3, "num_kv_heads"), ("vocab", 200, "vocab"),
    ("quant", "Q9_9", "quant"), ("hidden", 48, "hidden"),
])
def test_config_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"SynthConfig.{match}"):
        SynthConfig(**{**dict(num_layers=2, num_experts=8, top_k=2, hidden=64, ffn=32, num_heads=4, num_kv_heads=2,
                              vocab=320), field: value})


def test_k_quants_need_rows_of_256():
    with pytest.raises(ValueError, match="SynthConfig.hidden: 64 is not a multiple of Q4_K's block size 256"):
        SynthConfig(quant="Q4_K")


def test_cli_synth_then_info(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert model_main(["synth", str(out), "--layers", "3", "--experts", "16", "--top-k", "4", "--hidden", "64",
                       "--ffn", "64", "--quant", "q6_k", "--quiet"]) == 2  # Q6_K needs 256-wide rows
    assert "block size 256" in capsys.readouterr().err and not out.exists()
    assert model_main(["synth", str(out), "--layers", "3", "--experts", "16", "--top-k", "4", "--hidden", "64",
                       "--ffn", "64", "--quant", "q4_0", "--seed", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert model_main(["info", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    per = 3 * 64 * 64 // 32 * 18
    assert d["num_experts"] == [16, 16, 16] and d["top_k"] == 4 and d["expert_qtypes"] == ["Q4_0"]
    assert d["expert_bytes"] == [per] * 3 and d["total_expert_bytes"] == per * 16 * 3
    assert model_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Q4_0" in text and f"({per} B)" in text


def test_cli_synth_gpt_oss_mxfp4(tmp_path, capsys):
    """gpt-oss with MXFP4 experts, as real gpt-oss files: llama.cpp's MOSTLY_MXFP4_MOE file type."""
    out = tmp_path / "oss.gguf"
    assert model_main(["synth", str(out), "--arch", "gpt-oss", "--quant", "mxfp4", "--quiet"]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.file_type").contents() == gguf.LlamaFileType.MOSTLY_MXFP4_MOE == 38
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {ty for n, ty in types.items() if n.endswith("_exps.weight")} == {"MXFP4"}
    assert {ty for n, ty in types.items() if n.endswith("_exps.bias")} == {"F32"}
    capsys.readouterr()
    assert model_main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_qtypes"] == ["F32", "MXFP4"]  # F32: the expert biases


def test_cli_info_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    assert model_main(["info", str(bad)]) == 2
    assert "bad.gguf" in capsys.readouterr().err


# llama.cpp's loaders per architecture: where each takes the expert width and the MLA head sizes from
EXPERT_WIDTH_KEY = {"llama": "feed_forward_length", "olmoe": "feed_forward_length",
                    "granitemoe": "feed_forward_length", "qwen3moe": "expert_feed_forward_length",
                    "qwen2moe": "expert_feed_forward_length", "gpt-oss": "expert_feed_forward_length",
                    "deepseek2": "expert_feed_forward_length"}


@pytest.mark.parametrize("arch", sorted(EXPERT_WIDTH_KEY))
def test_expert_width_where_llama_cpp_reads_it(arch, tmp_path):
    cfg = synth.config_from_preset("tiny", arch=arch)
    path = synth.synth_model(tmp_path / "m.gguf", cfg)
    reader = gguf.GGUFReader(path)
    gate = next(t for t in reader.tensors if t.name.endswith("ffn_gate_exps.weight"))
    assert reader.get_field(f"{arch}.{EXPERT_WIDTH_KEY[arch]}").contents() == gate.shape[1] == cfg.ffn  # GGUF [hidden, ffn, E]
    assert gguf_io.llamacpp_problems(path) == []


@pytest.mark.parametrize("layout", ["split", "kv_b"])
def test_deepseek2_mla_metadata_as_llama_cpp_reads_it(layout, tmp_path):
    cfg = synth.config_from_preset("tiny", arch="deepseek2", mla=layout)
    reader = gguf.GGUFReader(synth.synth_model(tmp_path / "m.gguf", cfg))
    val = lambda k: reader.get_field(f"deepseek2.{k}").contents() if reader.get_field(f"deepseek2.{k}") else None  # noqa: E731
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    kv_lora, rope, nope, heads = cfg.hidden // 2, cfg.head_dim // 2, cfg.head_dim // 2, cfg.num_heads
    if layout == "split":  # one compressed kv head; per-head sizes in the *_mla keys
        assert (val("attention.head_count_kv"), val("attention.key_length"), val("attention.value_length")) == (
            1, kv_lora + rope, kv_lora)
        assert (val("attention.key_length_mla"), val("attention.value_length_mla")) == (cfg.head_dim, cfg.head_dim)
        assert shapes["blk.0.attn_k_b.weight"] == (nope, kv_lora, heads)
        assert shapes["blk.0.attn_v_b.weight"] == (kv_lora, cfg.head_dim, heads)
        assert "blk.0.attn_kv_b.weight" not in shapes
    else:  # keys and values for every head
        assert (val("attention.head_count_kv"), val("attention.key_length")) == (heads, cfg.head_dim)
        assert val("attention.key_length_mla") is None
        assert shapes["blk.0.attn_kv_b.weight"] == (kv_lora, heads * (nope + cfg.head_dim))


def _rewrite(cfg, path, change):
    """``cfg``'s model with metadata entry ``key -> value`` changed as ``change`` says."""
    meta = [(k, change.get(k, v), kind) for k, v, kind in synth.metadata(cfg)]
    gguf_io.write_gguf(path, cfg.arch, meta, synth.tensor_specs(cfg))
    return path


@pytest.mark.parametrize("arch, change, match", [
    ("llama", {"llama.feed_forward_length": 64}, "feed_forward_length = 64"),
    ("olmoe", {"olmoe.feed_forward_length": 64}, "feed_forward_length = 64"),
    ("granitemoe", {"granitemoe.feed_forward_length": 64}, "feed_forward_length = 64"),
    ("gpt-oss", {"gpt-oss.expert_feed_forward_length": 64}, "expert_feed_forward_length = 64"),
    ("qwen3moe", {"qwen3moe.expert_feed_forward_length": 16}, "expert_feed_forward_length = 16"),
    ("qwen2moe", {"qwen2moe.expert_shared_feed_forward_length": 32}, "ffn_gate_shexp"),
    ("deepseek2", {"deepseek2.feed_forward_length": 32}, "blk.0.ffn_gate"),
    ("deepseek2", {"deepseek2.attention.head_count_kv": 2}, "head_count_kv 2"),
    ("deepseek2/kv_b", {"deepseek2.attention.head_count_kv": 2}, "aborts at context creation"),
])
def test_info_warns_where_llama_cpp_refuses(arch, change, match, tmp_path, capsys):
    """Files as ``model synth`` wrote them before (feed_forward_length = ffn x top_k; MLA with
    2 kv heads) and other disagreements llama.cpp's loader refuses."""
    arch, _, mla = arch.partition("/")
    path = _rewrite(synth.config_from_preset("tiny", arch=arch, mla=mla or None), tmp_path / "m.gguf", change)
    problems = gguf_io.llamacpp_problems(path)
    assert len(problems) == 1 and match in problems[0] and "m.gguf" in problems[0]
    assert model_main(["info", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["llamacpp_problems"] == problems
    assert "llama.cpp would refuse" in captured.err and match in captured.err


def test_mla_layout_keys_must_match_the_tensors(tmp_path):
    cfg = synth.config_from_preset("tiny", arch="deepseek2", mla="kv_b")
    path = _rewrite(cfg, tmp_path / "m.gguf", {})
    gguf_io.write_gguf(path, cfg.arch, synth.metadata(cfg) + [("deepseek2.attention.key_length_mla", 16, "u32")],
                       synth.tensor_specs(cfg))
    assert any("looks for attn_k_b" in p for p in gguf_io.llamacpp_problems(path))
    split = synth.config_from_preset("tiny", arch="deepseek2")
    meta = [m for m in synth.metadata(split) if "_mla" not in m[0]]
    gguf_io.write_gguf(path, split.arch, meta, synth.tensor_specs(split))
    assert any("looks for attn_kv_b" in p for p in gguf_io.llamacpp_problems(path))


def test_loaders_that_size_q_by_hidden_need_heads_times_dim_equal_hidden():
    with pytest.raises(ValueError, match="SynthConfig.head_dim: 32; llama.cpp's qwen2moe loader"):
        synth.config_from_preset("tiny", arch="qwen2moe", head_dim=32)
    with pytest.raises(ValueError, match="SynthConfig.mla"):
        synth.config_from_preset("tiny", arch="deepseek2", mla="fused")
