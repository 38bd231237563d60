"""execute.kernel_timing's arithmetic and report (no GPU), the MOELAB_DECODE_KERNELS switch, that
every v2 kernel takes exactly its v1 twin's parameters (the launches are shared), and the bench
script's argument errors. With nvcc on the PATH (slow): the kernels build for sm_90 without spills."""
from __future__ import annotations

import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from execute import kernel_timing as KT
from execute import quant as Q
from execute.experts import ExecutorError
from execute.kernel_variants import V4_KERNELS, decode_kernels_env, kernel_name, programmatic
from execute.pdl_launch import PROGRAMMATIC_STREAM_SERIALIZATION, LaunchAttribute, LaunchConfig

ROOT = Path(__file__).resolve().parents[2]
TWINS = {"gpu_kernels.cu": ("moe1r_gate_up", "moe1r_down_combine"), "dense_kernels.cu": ("dense_gemv", "attn_partial",
                                                                                        "router_topk", "qk_rope_kv",
                                                                                        "attn_reduce")}


def test_bytes_of_the_qwen3_30b_block():
    b = KT.kernel_bytes(KT.BlockShape())
    assert b["qkv"] == 5120 * 2048 * 2 + 2 * 2048 * 4  # F16 q | k | v rows, x and the norm
    assert b["wo"] == 2048 * 4096 * 2 + 4096 * 4 + 2048 * 4
    assert b["router"] == 128 * 2048 * 4 + 2 * 2048 * 4
    assert b["gate_up"] == 8 * 2 * 768 * 2176 + 2048 * 4  # Q8_0: 64 blocks of 34 bytes per row
    assert b["down_combine"] == 8 * 2048 * 816 + 8 * 768 * 4
    assert b["attn_partial"] == 2 * 4 * 256 * 128 * 4 + 4096 * 4
    assert 78e6 < sum(b.values()) < 81e6  # ~20 us per block at 4 TB/s
    q8 = KT.kernel_bytes(KT.BlockShape(dense_qtype=Q.Q8_0))
    assert q8["qkv"] == 5120 * 2048 + 5120 * 64 * 2 + 2 * 2048 * 4


def test_expert_launch_shapes_per_variant():
    s = KT.BlockShape()
    assert KT.expert_launch_shapes(s) == {"gate_up": "(96,8)x128", "down_combine": "(1024,1)x256"}
    assert KT.expert_launch_shapes(s, "v4")["down_combine"] == "(512,1)x256"  # 4 rows per block


@pytest.mark.parametrize("field, value, match", [("heads", 30, "heads: 30"), ("head_dim", 512, "head_dim: 512"),
                                                 ("top_k", 40, "top_k: 40"), ("ffn", 100, "ffn: 100"),
                                                 ("dense_qtype", Q.Q4_K, "dense_qtype"), ("keys", 0, "keys: 0")])
def test_shape_errors_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=f"BlockShape.{match}"):
        KT.BlockShape(**{field: value})


def test_report_rows_against_the_ceiling():
    rows = KT.report_rows({"wo": 10.0, "qkv": 4.0, "extra": 1.0}, {"qkv": 8_000_000, "wo": 16_000_000}, 4000.0,
                          {"qkv": "(640,1)x256"}, {"qkv": 3.0, "wo": 9.0, "extra": 0.5})
    assert [r["kernel"] for r in rows] == ["qkv", "wo", "extra"]  # KERNELS order, then the rest
    qkv, wo, extra = rows
    assert qkv["gbps"] == pytest.approx(2000.0) and qkv["of_ceiling"] == pytest.approx(0.5)
    assert qkv["ideal_us"] == pytest.approx(2.0) and qkv["lost_us"] == pytest.approx(2.0)
    assert wo["gbps"] == pytest.approx(1600.0) and extra["mb"] == 0 and extra["lost_us"] == 1.0
    text = KT.format_table(rows, "title")
    assert text.splitlines()[0] == "title" and "(640,1)x256" in text
    assert text.splitlines()[-1].split() == ["sum", "24.00", "15.00", "6.00", "9.00", "12.50"]
    assert qkv["in_graph_us"] == 3.0 and np.isnan(KT.report_rows({"qkv": 1.0}, {}, 1.0)[0]["in_graph_us"])
    with pytest.raises(ValueError, match="ceiling_gbps"):
        KT.report_rows({}, {}, 0.0)


def test_summarize_two_variants():
    b = KT.kernel_bytes(KT.BlockShape())
    v1 = {k: 10.0 for k in KT.KERNELS}
    v2 = {k: 5.0 for k in KT.KERNELS}
    res = {"bytes": b, "ceiling_gbps": 4000.0, "node_us": 1.5, "variants": {
        "v1": {"kernel_us": v1, "block_us": 100.0, "launches": {}, "max_rel_diff_vs_first": 0.0,
               "in_graph_us": {k: 9.0 for k in KT.KERNELS}},
        "v2": {"kernel_us": v2, "block_us": 50.0, "launches": {}, "max_rel_diff_vs_first": 1e-7}}}
    text = KT.summarize(res)
    assert "[v1] whole block in one graph: 100.00 us per block (kernels alone sum 80.00)" in text
    assert "v2 / v1 time: block 0.50; qkv 0.50" in text and "max rel diff 1.00e-07" in text
    assert "an empty kernel node in a chain of them: 1.50 us" in text and "refused" not in text
    assert "refused (CUDA error 801)" in KT.summarize({**res, "programmatic_refused": 801})
    failed = KT.summarize({**res, "variants": {**res["variants"], "v3": {"error": "CUDAError: capture"}}})
    assert "[v3] failed: CUDAError: capture" in failed and "v3 / v1" not in failed


def test_decode_kernels_switch(monkeypatch):
    monkeypatch.delenv("MOELAB_DECODE_KERNELS", raising=False)
    assert decode_kernels_env() == "v4"
    monkeypatch.setenv("MOELAB_DECODE_KERNELS", " v2 ")
    assert decode_kernels_env() == "v2"
    monkeypatch.setenv("MOELAB_DECODE_KERNELS", "fast")
    with pytest.raises(ExecutorError, match="MOELAB_DECODE_KERNELS: 'fast', expected v1, v2, v3 or v4"):
        decode_kernels_env()
    assert kernel_name("dense_gemv", "v1") == "dense_gemv" and kernel_name("dense_gemv", "v2") == "dense_gemv_v2"
    assert kernel_name("dense_gemv", "v3") == "dense_gemv_v2"
    assert kernel_name("moe1r_gate_up", "v4") == "moe1r_gate_up_v4"
    assert kernel_name("qk_rope_kv", "v4") == "qk_rope_kv_v2"  # no v4 twin: v2's
    assert [programmatic(v) for v in ("v1", "v2", "v3", "v4")] == [False, False, True, True]
    with pytest.raises(ValueError, match="kernel variant 'v5'"):
        kernel_name("dense_gemv", "v5")


def test_launch_structs_match_cuda_h():
    """CUlaunchAttribute: 4-byte id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: seven
    uints, then (8-aligned) the stream and attribute pointers and the count."""
    import ctypes

    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.stream.offset, LaunchConfig.attrs.offset, LaunchConfig.num_attrs.offset) == (32, 40, 48)
    assert PROGRAMMATIC_STREAM_SERIALIZATION == 6


def _params(src: str, name: str) -> list[str]:
    """The parameter list of kernel ``name`` in ``src``, whitespace-normalised."""
    m = re.search(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?' + re.escape(name) + r"\((.*?)\)\s*\{",
                  src, re.S)
    assert m, f"kernel {name} not found"
    return [" ".join(p.split()) for p in m.group(1).split(",")]


def _source(cu: str) -> str:
    """The source a kernel module compiles (gpu_dense compiles dense_kernels.cu with its v2 file)."""
    files = [cu] + {"dense_kernels.cu": ["dense_kernels_v2.cu", "dense_kernels_v4.cu"],
                    "gpu_kernels.cu": ["expert_kernels_v4.cu"]}.get(cu, [])
    return "\n".join(resources.files("execute").joinpath(f).read_text() for f in files)


@pytest.mark.parametrize("cu", sorted(TWINS))
def test_v2_kernels_take_their_twins_parameters(cu):
    src = _source(cu)
    for name in TWINS[cu]:
        assert _params(src, name + "_v2") == _params(src, name)
    for name in set(TWINS[cu]) & set(V4_KERNELS):
        assert _params(src, name + "_v4") == _params(src, name)


def test_bench_script_rejects_bad_arguments(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_decode_kernels", ROOT / "experiments/bench_decode_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for argv, msg in [(["--variants", "v1,v5"], "--variants"), (["--variants", "v2,v2"], "--variants"), (["--dense-quant", "Q4_K"], "--dense-quant"),
                      (["--trials", "0"], "--trials"), (["--top-k", "40"], "BlockShape.top_k")]:
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("cu", sorted(TWINS))
def test_v2_kernels_build_for_sm90_without_spills(cu, tmp_path):
    src = tmp_path / cu
    src.write_text(_source(cu))
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++14", "-c", str(src), "-o", str(tmp_path / "k.o"),
                        "--ptxas-options=-v"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    props = re.findall(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores", r.stderr)
    got = {name: (int(frame), int(spill)) for name, frame, spill in props}
    for name in TWINS[cu]:
        assert got[name + "_v2"] == (0, 0)
