"""Model and hardware presets: byte sizes, geometry, sources, and clear errors on bad files."""
from __future__ import annotations

import json

import pytest

from simulate import MODEL_PRESETS, HardwareError, ModelSpec, hardware_presets, load_hardware, load_model, quant_bytes
from scheduler.hardware import HARDWARE_DIR, Hardware

from .conftest import tiny_model


@pytest.mark.parametrize("quant,weights,expected", [
    ("Q8_0", 64, 68), ("Q4_0", 32, 18), ("Q4_K", 256, 144), ("Q6_K", 512, 420), ("IQ4_XS", 256, 136),
    ("F16", 10, 20), ("BF16", 3, 6), ("F32", 5, 20), ("Q5_K", 256, 176), ("Q3_K", 256, 110), ("Q2_K", 256, 84),
    ("MXFP4", 32, 17), ("q8_0", 33, 68),
])
def test_quant_bytes(quant, weights, expected):
    assert quant_bytes(quant, weights) == expected


def test_unknown_quant_is_an_error():
    with pytest.raises(ValueError, match="Q9_9"):
        quant_bytes("Q9_9", 32)
    with pytest.raises(ValueError, match="expert_quant"):
        tiny_model(expert_quant="Q9_9")


def test_qwen3_30b_expert_bytes_and_geometry():
    m = load_model("qwen3-30b-a3b")
    assert m.expert_bytes(0) == 3 * 2048 * 768 // 32 * 34  # Q8_0
    g = m.geometry()
    assert g.num_layers == 48 and g.max_experts == 128 and g.top_k == 8
    assert m.with_quant("Q4_K").expert_bytes(5) == 3 * 2048 * 768 // 256 * 144


def test_dense_first_layers_have_no_experts():
    m = load_model("deepseek-v2-lite")
    g = m.geometry()
    assert g.num_experts[0] == 0 and g.expert_bytes[0] == 0 and g.num_experts[1] == 64


def test_every_model_preset_loads_with_a_source():
    for name in MODEL_PRESETS:
        m = load_model(name)
        assert m.source, name
        assert m.total_expert_bytes() > 0
    assert set(MODEL_PRESETS) >= {"qwen3-30b-a3b", "qwen3.5-35b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
                                  "olmoe-1b-7b", "gpt-oss-20b", "granite-3.0-1b-a400m"}


def test_every_hardware_number_has_a_source():
    assert {"rtx4060-laptop", "l4-colab", "rtx4070super-5950x", "rtx5070ti-16t", "h200-xeon16"} <= set(hardware_presets())
    numeric = [f for f, v in Hardware.__dataclass_fields__.items() if v.type in ("int", "float", "dict")
               and f not in ("sources", "executor", "cpu_call_factor")]  # optional, written by moelab calibrate
    assert len(numeric) == 16
    for name in hardware_presets():
        hw = load_hardware(name)
        missing = [f for f in numeric if f not in hw.sources]
        assert not missing, f"{name}: no source for {missing}"


def test_h200_preset_carries_the_probe_figures():
    hw = load_hardware("h200-xeon16")
    assert hw.pcie_h2d_gbps == 53.0 and hw.cpu_mem_gbps == 66.3 and hw.cpu_threads == 16


def _write(tmp_path, data, name="hw.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def _good():
    return json.loads((HARDWARE_DIR / "l4-colab.json").read_text())


def test_user_hardware_file_loads(tmp_path):
    data = _good()
    data["pcie_h2d_gbps"] = 3.5
    assert load_hardware(_write(tmp_path, data)).pcie_h2d_gbps == 3.5


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(pcie_h2d_gbps=-1), "pcie_h2d_gbps"),
    (lambda d: d.update(cpu_threads=2.5), "cpu_threads"),
    (lambda d: d.update(copy_latency_s="10us"), "copy_latency_s"),
    (lambda d: d.pop("gpu_mem_gbps"), "gpu_mem_gbps"),
    (lambda d: d.update(pcie_gbps=1), "pcie_gbps"),
    (lambda d: d["cpu_quant_efficiency"].update(Q8_0=0), "cpu_quant_efficiency.Q8_0"),
])
def test_bad_hardware_file_names_file_and_field(tmp_path, mutate, field):
    data = _good()
    mutate(data)
    p = _write(tmp_path, data)
    with pytest.raises(HardwareError) as e:
        load_hardware(p)
    assert str(p) in str(e.value) and field in str(e.value)


def test_unreadable_hardware_file(tmp_path):
    p = _write(tmp_path, "{not json")
    with pytest.raises(HardwareError, match="not a readable JSON"):
        load_hardware(p)
    with pytest.raises(HardwareError, match="unknown hardware"):
        load_hardware("no-such-preset")


def test_model_from_gguf(tmp_path):
    synth = pytest.importorskip("execute.synth")
    from execute.model_spec import model_spec, resolve_model

    path = synth.synth_model(tmp_path / "m.gguf", synth.SynthConfig(num_layers=2, num_experts=8, top_k=2, hidden=64,
                                                                    ffn=32, quant="Q8_0"))
    m = model_spec(path)
    assert (m.num_layers, m.num_experts, m.top_k, m.hidden, m.expert_ffn) == (2, 8, 2, 64, 32)
    assert m.expert_quant == "Q8_0"
    assert m.expert_bytes(1) == quant_bytes("Q8_0", 3 * 64 * 32)
    assert resolve_model(str(path)).geometry() == m.geometry()
    with pytest.raises(ValueError, match="unknown model"):
        load_model(str(path))  # the scheduler's presets do not read GGUF files
