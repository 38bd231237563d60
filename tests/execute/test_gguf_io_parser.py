"""execute.gguf_io's own GGUF parser: the same metadata and tensors as gguf-py's reader on every
synthetic architecture, and one-line errors naming the file and section on damaged files."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from execute import gguf_io, synth
from execute.archs import ARCHS
from execute.gguf_io import GGUFError, GGUFFile

gguf = pytest.importorskip("gguf")

# gguf-py's reader adds these pseudo-fields for the header; they are not metadata keys
_HEADER_FIELDS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}


def _cases():
    yield from ((arch, {}) for arch in ARCHS)
    yield "deepseek2", {"mla": "split"}
    yield "deepseek2", {"mla": "kv_b"}
    yield "qwen3moe", {"quant": "Q4_K", "hidden": 256, "ffn": 256}


@pytest.mark.parametrize("arch, extra", list(_cases()), ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
def test_parser_matches_gguf_reader(arch, extra, tmp_path):
    path = synth.synth_model(tmp_path / "m.gguf", synth.config_from_preset("tiny", arch=arch, **extra))
    own, ref = GGUFFile(path), gguf.GGUFReader(path)
    assert set(own.fields) == set(ref.fields) - _HEADER_FIELDS
    for key in own.fields:
        want = ref.get_field(key).contents()
        got = own.value(key)
        assert got == want, key
    assert [t.name for t in own.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(own.tensors, ref.tensors):
        assert t.shape == tuple(reversed(r.shape.tolist())), t.name  # numpy order: GGUF order reversed
        assert (t.qtype, t.nbytes, t.data_offset) == (int(r.tensor_type), int(r.n_bytes), int(r.data_offset)), t.name
        raw = own.raw(t)
        assert raw.dtype == np.uint8 and raw.shape[:-1] == t.shape[:-1] and np.shares_memory(raw, own.data)
        np.testing.assert_array_equal(raw.reshape(-1), np.asarray(r.data).view(np.uint8).reshape(-1), err_msg=t.name)


def test_model_info_is_what_gguf_reader_fields_give(tmp_path):
    """A few ModelInfo figures cross-checked against gguf-py's view of the same file."""
    path = synth.synth_model(tmp_path / "m.gguf", synth.config_from_preset("tiny", arch="gpt-oss"))
    info, ref = gguf_io.read_model_info(path), gguf.GGUFReader(path)
    val = lambda k: ref.get_field(k).contents()  # noqa: E731
    assert info.num_layers == val("gpt-oss.block_count") and info.top_k == val("gpt-oss.expert_used_count")
    assert info.rms_eps == val("gpt-oss.attention.layer_norm_rms_epsilon")
    assert [(t.name, t.shape) for t in info.tensors] == [(t.name, tuple(reversed(t.shape.tolist()))) for t in ref.tensors]


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("parser")
    return synth.synth_model(root / "m.gguf", synth.config_from_preset("tiny")).read_bytes()


def _write(tmp_path, data: bytes):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return p




@pytest.mark.parametrize("edit, message", [
    (lambda b: b[:10], "10 bytes, truncated inside the 24-byte GGUF header"),
    (lambda b: b"GGUX" + b[4:], "not a little-endian GGUF v2/v3 file"),
    (lambda b: b"GGUF" + struct.pack("<I", 7) + b[8:], "GGUF version 7; supported"),
    (lambda b: b"GGUF" + struct.pack(">I", 3) + b[8:], "a big-endian GGUF file"),
    (lambda b: b[:16] + struct.pack("<Q", 2**40) + b[24:], "metadata section truncated or corrupt"),
    (lambda b: b[:8] + struct.pack("<Q", 2**40) + b[16:], "tensor table truncated or corrupt"),
    (lambda b: b[:len(b) - 100], "tensor data truncated: tensor 'blk.1.ffn_down_exps.weight'"),
    (lambda b: b"", "empty file"),
])
def test_damaged_files_are_named(edit, message, tiny_bytes, tmp_path):
    p = _write(tmp_path, edit(tiny_bytes))
    with pytest.raises(GGUFError) as exc:
        gguf_io.read_model_info(p)
    assert str(exc.value).startswith(f"{p}: ") and message in str(exc.value) and "\n" not in str(exc.value)


def test_a_string_length_past_the_end_is_refused(tiny_bytes, tmp_path):
    """The first key's length is set beyond the file: refused, not read as a short string."""
    b = bytearray(tiny_bytes)
    b[24:32] = struct.pack("<Q", len(b))
    with pytest.raises(GGUFError, match="metadata section truncated or corrupt .*run past the end"):
        GGUFFile(_write(tmp_path, bytes(b)))


def test_tensor_row_length_must_fit_its_blocks(tmp_path):
    spec = gguf_io.TensorSpec("x", (2, 32), gguf_io.qtype_value("Q8_0"), lambda: np.zeros((2, 34), np.uint8))
    path = tmp_path / "t.gguf"
    gguf_io.write_gguf(path, "qwen3moe", [], [spec])
    data = bytearray(path.read_bytes())
    at = data.index(b"x\x02\x00\x00\x00") + 5  # after the name and n_dims: ne[0] = 32
    data[at:at + 8] = struct.pack("<Q", 31)
    with pytest.raises(GGUFError, match=r"tensor 'x': dimensions \[31, 2\].*multiple of Q8_0's block of 32"):
        GGUFFile(_write(tmp_path, bytes(data)))
    assert GGUFFile(path).tensors[0].shape == (2, 32)


def test_open_speed_experiment_runs_and_writes_figures(tmp_path, capsys):
    """experiments/gguf_open_speed.py end to end on a small vocabulary (no time is asserted)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gguf_open_speed", Path(__file__).parents[2] / "experiments" / "gguf_open_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "open.json"
    assert mod.main(["--vocab", "2000", "--repeats", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["args"]["vocab"] == 2000 and res["gguf_reader_s"] > 0 and res["read_model_info_s"] > 0
    assert res["speedup"] == pytest.approx(res["gguf_reader_s"] / res["read_model_info_s"])
    assert "vocabulary of 2000" in capsys.readouterr().out
