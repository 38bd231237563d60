"""execute.gguf_io: model info from metadata, weights as mmap views, errors naming file and field."""
from __future__ import annotations

import numpy as np
import pytest

from execute import gguf_io, gguf_model, synth
from execute.gguf_io import GGUFError, TensorSpec, qtype_value

from .conftest import K_QUANTS, SMALL_QUANTS, tiny_config


@pytest.mark.parametrize("quant", SMALL_QUANTS + K_QUANTS)
def test_info_round_trip(quant, synth_path):
    cfg = tiny_config(quant)
    info = gguf_io.read_model_info(synth_path(quant))
    assert info.arch == "qwen3moe"
    assert (info.num_layers, info.num_experts, info.top_k) == (cfg.num_layers, (cfg.num_experts,) * cfg.num_layers, cfg.top_k)
    assert (info.hidden, info.ffn, info.num_heads, info.num_kv_heads, info.head_dim, info.vocab) == (
        cfg.hidden, cfg.ffn, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab)
    assert info.rope_theta == cfg.rope_theta and info.rms_eps == pytest.approx(cfg.rms_eps)
    assert info.norm_topk and info.qk_norm and not info.tied_output and not info.fused_gate_up
    assert info.expert_bytes == (cfg.expert_bytes,) * cfg.num_layers
    assert info.total_expert_bytes == cfg.expert_bytes * cfg.num_experts * cfg.num_layers
    assert set(info.expert_qtypes().values()) == {quant}
    g = info.geometry()
    assert g.total_expert_bytes == info.total_expert_bytes and g.top_k == cfg.top_k


def test_tensor_table_is_numpy_order(synth_path):
    cfg = tiny_config("Q8_0")
    info = gguf_io.read_model_info(synth_path("Q8_0"))
    down = info.tensor("blk.0.ffn_down_exps.weight")
    assert down.shape == (cfg.num_experts, cfg.hidden, cfg.ffn)  # GGUF lists [ffn, hidden, experts]
    assert info.tensor("blk.1.attn_q.weight").shape == (cfg.num_heads * cfg.head_dim, cfg.hidden)
    assert down.nbytes == cfg.num_experts * cfg.hidden * cfg.ffn // 32 * 34


def test_experts_are_views_on_the_map(tiny_weights):
    w = tiny_weights("Q8_0")
    layer = w.experts[1]
    mm = w.reader.data
    for t in (layer.gate, layer.up, layer.down):
        assert t.data.dtype == np.uint8 and t.data.shape == (8, t.expert_bytes)
        assert np.shares_memory(t.data, mm), t.name
        assert t.qtype == qtype_value("Q8_0")
    assert (layer.gate.rows, layer.gate.cols, layer.down.rows, layer.down.cols) == (32, 64, 64, 32)
    assert layer.expert_bytes == w.info.expert_bytes[1]


def test_dense_weights_match_the_file(tiny_weights):
    import gguf

    w = tiny_weights("F32")
    t = next(t for t in gguf.GGUFReader(w.info.path).tensors if t.name == "blk.0.attn_k.weight")
    np.testing.assert_array_equal(w.layers[0].wk, np.asarray(t.data, np.float32).reshape(w.layers[0].wk.shape))
    assert w.layers[0].wk.shape == (2 * 16, 64)
    assert w.token_embd.shape == (320, 64) and w.output.shape == (320, 64)


def test_dequantize_quantize_round_trip(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = gguf_io.quantize(x, qtype_value("Q8_0"))
    assert q8.dtype == np.uint8 and q8.shape == (4, 2 * 34)
    y = gguf_io.dequantize(q8, qtype_value("Q8_0"))
    assert y.shape == x.shape and np.abs(y - x).max() < np.abs(x).max() / 100
    np.testing.assert_array_equal(gguf_io.dequantize(x.view(np.uint8), qtype_value("F32")), x)


def _specs_with(cfg, change):
    return [change(s) for s in synth.tensor_specs(cfg)]


def _with_up_type(cfg, tmp_path, qtype: int, make):
    def change(s: TensorSpec):
        if s.name != "blk.1.ffn_up_exps.weight":
            return s
        return TensorSpec(s.name, s.shape, qtype, lambda: make(s.shape))

    path = tmp_path / "mixed.gguf"
    gguf_io.write_gguf(path, "qwen3moe", synth.metadata(cfg), _specs_with(cfg, change))
    return path


def test_expert_type_without_a_kernel_is_dequantized_to_f16_at_load(tmp_path, rng, monkeypatch):
    """A Q4_K_M-style file mixing types per tensor: a type no expert kernel reads loads as F16
    (its weights rounded once), the others stay views on the map; info reports what moves, and
    qtype_paths says which path runs each type."""
    from execute import quant as Q

    cfg = tiny_config("Q4_K")  # rows of 256
    qt = Q.IQ1_S  # no expert kernel reads it (here: every layout has a CPU kernel)
    monkeypatch.setattr(Q, "CPU_QTYPES", {t: q for t, q in Q.CPU_QTYPES.items() if t != qt})
    blocks = {}

    def make(shape):
        blocks["up"] = Q.random_blocks(rng, qt, shape[0] * shape[1], shape[2], 0.05).reshape(shape[0], -1)
        return blocks["up"]

    path = _with_up_type(cfg, tmp_path, qt, make)
    info = gguf_io.read_model_info(path)
    assert info.expert_bytes[1] != info.expert_bytes[0]  # the file's sizes
    paths = gguf_io.qtype_paths(info)
    assert paths["IQ1_S"] == "experts: dequantized to F16 at load"
    assert paths["Q4_K"].startswith("experts: CPU kernel, GPU kernel")
    w = gguf_model.load_model(path)
    up, gate = w.experts[1].up, w.experts[1].gate
    assert up.qtype == Q.F16 and gate.qtype == Q.Q4_K and np.shares_memory(gate.data, w.reader.data)
    want = Q.dequantize(blocks["up"], qt, cfg.hidden).astype(np.float16)
    np.testing.assert_array_equal(up.data.reshape(-1).view(np.float16), want.reshape(-1))
    assert w.info.expert_bytes == tuple(x.expert_bytes for x in w.experts)
    assert w.info.expert_bytes[1] == w.info.expert_bytes[0] - gate.expert_bytes + 2 * cfg.ffn * cfg.hidden


def test_unsupported_expert_type_names_tensor_and_type(tmp_path):
    cfg = tiny_config("Q8_0")
    path = _with_up_type(cfg, tmp_path, 24, lambda shape: np.zeros(int(np.prod(shape)), np.uint8))  # I8
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up_exps\.weight' has quant type I8; experts may be.*IQ4_XS"):
        gguf_io.read_model_info(path)


def test_own_type_table_matches_gguf():
    import gguf

    from execute.gguf_file import QUANT_SIZES

    assert QUANT_SIZES == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    for k in gguf.GGML_QUANT_SIZES:
        assert gguf_io.qtype_name(int(k)) == k.name


def test_tied_output_head_warns_where_llamacpp_needs_output(tmp_path):
    cfg = tiny_config("Q8_0", arch="olmoe", num_kv_heads=4)
    specs = [s for s in synth.tensor_specs(cfg) if s.name != "output.weight"]
    path = tmp_path / "tied.gguf"
    gguf_io.write_gguf(path, "olmoe", synth.metadata(cfg), specs)
    assert gguf_io.read_model_info(path).tied_output
    assert any("no output.weight" in p for p in gguf_io.llamacpp_problems(path))
    full = tmp_path / "full.gguf"
    gguf_io.write_gguf(full, "olmoe", synth.metadata(cfg), synth.tensor_specs(cfg))
    assert not any("output.weight" in p for p in gguf_io.llamacpp_problems(full))


def test_fused_gate_up_experts_split_into_gate_and_up(tmp_path):
    cfg = tiny_config("Q8_0", num_layers=1)
    specs = [s for s in synth.tensor_specs(cfg) if "ffn_gate_exps" not in s.name and "ffn_up_exps" not in s.name]
    e, f, h = cfg.num_experts, cfg.ffn, cfg.hidden
    blocks = synth.random_blocks(np.random.default_rng(1), "Q8_0", e * 2 * f, h, 0.1).reshape(e, 2 * f, -1)
    specs.append(TensorSpec("blk.0.ffn_gate_up_exps.weight", (e, 2 * f, h), qtype_value("Q8_0"), lambda: blocks))
    path = tmp_path / "fused.gguf"
    gguf_io.write_gguf(path, "qwen3moe", synth.metadata(cfg), specs)
    w = gguf_model.load_model(path)
    assert w.info.fused_gate_up and w.info.expert_bytes == (cfg.expert_bytes,)
    gate, up = w.experts[0].gate, w.experts[0].up
    assert gate.rows == up.rows == f and gate.cols == h
    np.testing.assert_array_equal(gate.data, blocks[:, :f].reshape(e, -1))
    np.testing.assert_array_equal(up.data, blocks[:, f:].reshape(e, -1))


def test_missing_metadata_key_is_named(tmp_path):
    cfg = tiny_config("Q8_0")
    meta = [m for m in synth.metadata(cfg) if m[0] != "qwen3moe.expert_used_count"]
    path = tmp_path / "nokey.gguf"
    gguf_io.write_gguf(path, "qwen3moe", meta, synth.tensor_specs(cfg))
    with pytest.raises(GGUFError, match="qwen3moe.expert_used_count"):
        gguf_io.read_model_info(path)


def test_bad_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="junk.gguf"):
        gguf_io.read_model_info(junk)
    with pytest.raises(GGUFError, match="no such file"):
        gguf_io.read_model_info(tmp_path / "absent.gguf")


def test_write_is_atomic_on_failure(tmp_path):
    cfg = tiny_config("Q8_0")

    def boom():
        raise RuntimeError("generator failed")

    specs = synth.tensor_specs(cfg)
    specs[5] = TensorSpec(specs[5].name, specs[5].shape, specs[5].qtype, boom)
    path = tmp_path / "out.gguf"
    with pytest.raises(RuntimeError, match="generator failed"):
        gguf_io.write_gguf(path, "qwen3moe", synth.metadata(cfg), specs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dense_quant", ["F32", "F16", "Q8_0"])
def test_mla_split_layout_reads_as_the_kv_b_it_was_cut_from(dense_quant, tmp_path):
    """deepseek2 written as attn_k_b/attn_v_b (current llama.cpp) and as attn_kv_b, one seed:
    the loader rebuilds the same kv_b and the reference gives the same logits."""
    from execute.reference import reference_forward

    w = {}
    for mla in ("split", "kv_b"):
        cfg = synth.config_from_preset("tiny", arch="deepseek2", mla=mla, dense_quant=dense_quant)
        w[mla] = gguf_model.load_model(synth.synth_model(tmp_path / f"{mla}.gguf", cfg))
    split, kv_b = w["split"], w["kv_b"]
    assert (split.info.num_kv_heads, kv_b.info.num_kv_heads) == (1, 4)
    for name in ("head_dim", "v_head_dim", "kv_lora_rank", "rope_dims"):
        assert getattr(split.info, name) == getattr(kv_b.info, name), name
    for a, b in zip(split.layers, kv_b.layers):
        assert a.mla["kv_b"].shape == b.mla["kv_b"].shape == (4 * (8 + 16), 32)
        np.testing.assert_array_equal(a.mla["kv_b"], b.mla["kv_b"])  # k_b/v_b: kv_b's values in F32
    tokens = [5, 300, 17, 42]
    np.testing.assert_array_equal(reference_forward(split, tokens)[0], reference_forward(kv_b, tokens)[0])
    assert {t.qtype_name for t in split.info.tensors if "attn_k_b" in t.name or "attn_v_b" in t.name} == {"F32"}


def test_mla_split_layout_without_its_keys_is_named(tmp_path):
    cfg = synth.config_from_preset("tiny", arch="deepseek2")
    meta = [m for m in synth.metadata(cfg) if "_mla" not in m[0]]
    path = tmp_path / "m.gguf"
    gguf_io.write_gguf(path, cfg.arch, meta, synth.tensor_specs(cfg))
    assert any("key_length_mla" in p for p in gguf_io.llamacpp_problems(path))


@pytest.mark.parametrize("arch", ["qwen3moe", "llama", "gpt-oss"])
def test_read_tokenizer_matches_gguf_reader(arch, tmp_path):
    """The metadata parser of read_tokenizer gives what gguf-py's reader gives, key by key."""
    gguf = pytest.importorskip("gguf")
    path = synth.synth_model(tmp_path / "m.gguf", synth.config_from_preset("tiny", arch=arch))
    got = gguf_io.read_tokenizer(path)
    reader = gguf.GGUFReader(path)
    for short, key in gguf_io._TOKENIZER_KEYS.items():
        f = reader.get_field(key)
        want = None if f is None else f.contents()
        assert got[short] == (list(want) if isinstance(want, list) else want), key
    assert got["tokens"] and got["model"] in ("gpt2", "llama")


def test_read_tokenizer_errors_name_the_file(tmp_path):
    path = synth.synth_model(tmp_path / "m.gguf", synth.config_from_preset("tiny"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(GGUFError, match="cut.gguf: metadata section truncated"):
        gguf_io.read_tokenizer(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 10)
    with pytest.raises(GGUFError, match="junk.gguf: not a little-endian GGUF"):
        gguf_io.read_tokenizer(junk)
    with pytest.raises(GGUFError, match="no such file"):
        gguf_io.read_tokenizer(tmp_path / "absent.gguf")


def test_mla_split_layout_that_does_not_fit_its_rank_is_named(tmp_path):
    cfg = synth.config_from_preset("tiny", arch="deepseek2", mla="split")
    meta = [(k, 5 if k == "deepseek2.attention.kv_lora_rank" else v, kind) for k, v, kind in synth.metadata(cfg)]
    path = tmp_path / "m.gguf"
    gguf_io.write_gguf(path, cfg.arch, meta, synth.tensor_specs(cfg))
    with pytest.raises(GGUFError, match=r"m\.gguf: blk\.0\.attn_k_b .* do not split into head_count 4 x kv_lora_rank 5"):
        gguf_model.load_model(path)


@pytest.mark.parametrize("quant,down", [("Q4_K", "Q6_K"), ("Q5_K", "Q6_K"), ("IQ4_XS", "Q5_K"), ("Q3_K", "IQ1_S")])
def test_mixed_type_files_run_on_the_cpu_kernels(quant, down, tmp_path, rng):
    """Q4_K_M / Q5_K_M / UD-style files (a type per projection) load with cpu_only: every expert
    tensor the CPU pool reads stays raw and goes through its kernel (a type without one would be
    dequantized to F16 at load); the kernels' outputs match gguf-py's dequantized weights."""
    from execute import quant as Q
    from execute.cpu_experts import run_experts

    from .test_cpu_kernels import REL_ERR_INT8, reference, rel_err

    cfg = tiny_config(quant, down_quant=down, num_layers=1, hidden=256, ffn=256)
    path = synth.synth_model(tmp_path / "mixed.gguf", cfg)
    assert set(gguf_io.qtype_paths(gguf_io.read_model_info(path))) >= {quant, down}
    w = gguf_model.load_model(path, cpu_only=True)
    layer = w.experts[0]
    want_down = Q.QTYPE_BY_NAME[down] if Q.QTYPE_BY_NAME[down] in Q.CPU_QTYPES else Q.F16
    assert (layer.gate.qtype, layer.down.qtype) == (Q.QTYPE_BY_NAME[quant], want_down)
    x = rng.standard_normal((3, cfg.hidden)).astype(np.float32)
    y = run_experts(layer, [0, 5, 5], x, threads=2)
    assert rel_err(y, reference(layer, [0, 5, 5], x)) < REL_ERR_INT8
