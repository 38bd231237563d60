"""experiments/llamacpp_check.py: the comparison, the cases, argument errors and moelab's side on
its own; (slow) the build and the check against llama.cpp end to end."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
_spec = importlib.util.spec_from_file_location("llamacpp_check", Path(__file__).parents[1] / "experiments" / "llamacpp_check.py")
lc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lc)


def test_compare():
    ref = np.array([[1.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    same = lc.compare(ref, ref)
    assert same == {"nmse": 0.0, "nmse_max_position": 0.0, "top1": 1.0, "top1_unexplained": 0}
    off = ref.copy()
    off[1] = [4.0, 1.0, 3.0]  # position 1's top-1 moves to token 0
    got = lc.compare(off, ref)
    assert got["top1"] == 0.5 and got["nmse"] == pytest.approx(16 / 15) and got["nmse_max_position"] == pytest.approx(1.6)


def test_top1_flips_explained_by_rounding_or_not():
    ref = np.zeros((1, 100))
    ref[0, 2] = 3.0
    far = ref.copy()
    far[0, 0] = 4.0  # one logit off by 4: RMS 0.4, llama.cpp's margin 3 > 4 x 0.4
    assert lc.compare(far, ref)["top1_unexplained"] == 1
    near = ref.copy()
    near[0, 0] = 3.01
    ref_tie = ref.copy()
    ref_tie[0, 0] = 2.999  # llama.cpp's top two within rounding of each other
    assert lc.compare(near, ref_tie)["top1"] == 0.0 and lc.compare(near, ref_tie)["top1_unexplained"] == 0


def test_cases_and_mla_layouts():
    assert lc.cases(["qwen3moe", "deepseek2"], ["Q8_0"]) == [("qwen3moe", "Q8_0", ""), ("deepseek2", "Q8_0", "split")]
    got = lc.cases(["deepseek2"], ["Q8_0"], ("split", "kv_b"))
    assert got == [("deepseek2", "Q8_0", "split"), ("deepseek2", "Q8_0", "kv_b")]


@pytest.mark.parametrize("argv, match", [(["check", "--archs", "mixtral"], "mixtral"),
                                         (["check", "--quants", "Q5_1"], "Q5_1"),
                                         (["check", "--dense-quant", "Q4_K"], "--dense-quant"),
                                         (["check", "--extra-bufts", "maybe"], "--extra-bufts"),
                                         (["check", "--tokens", "0"], "--tokens"), (["build", "--jobs", "0"], "--jobs")])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        lc._args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_check_without_a_build_exits_2(tmp_path, capsys):
    assert lc.main(["check", "--cache", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "not built" in capsys.readouterr().err


def test_moelab_side_matches_the_reference(tmp_path):
    from execute.gguf_model import load_model
    from execute.reference import reference_forward

    path = lc.synth_case(tmp_path, "deepseek2", "Q4_K", "split", "F16", 3)
    ours = lc.moelab_logits(path, lc.TOKENS)
    ref, _ = reference_forward(load_model(path), list(lc.TOKENS))
    assert ours.shape == (len(lc.TOKENS), 320) and lc.compare(ours, np.asarray(ref))["nmse"] < 1e-10


def test_amx_weights_are_the_quantized_dense_matmuls(tmp_path):
    """llama.cpp's AMX buffer takes quantized 2-D matmul weights; the embedding (row lookup) and
    the experts (MUL_MAT_ID) stay out, so Q8_0 experts under F16 dense weights list none."""
    q8 = lc.amx_weights(lc.synth_case(tmp_path, "qwen3moe", "F16", "", "Q8_0", 0))
    assert "output.weight" in q8 and "blk.1.attn_v.weight" in q8
    assert "token_embd.weight" not in q8 and not [n for n in q8 if "_exps" in n or "norm" in n or "gate_inp" in n]
    assert lc.amx_weights(lc.synth_case(tmp_path, "qwen3moe", "Q8_0", "", "F16", 0)) == []


def _fake_llama_cpp(root: Path, body: str) -> Path:
    """A stand-in ``llama_cpp`` package: ``body`` is its ``Llama`` class (or what importing it does)."""
    (root / "llama_cpp").mkdir(parents=True)
    (root / "llama_cpp" / "llama_cpp.py").write_text(
        "class P:\n    use_extra_bufts = True\ndef llama_model_default_params():\n    return P()\n")
    (root / "llama_cpp" / "__init__.py").write_text(body)
    return root


def test_child_passes_extra_bufts_to_the_model_params(tmp_path):
    """The child switches llama.cpp's extra buffer types through llama_model_default_params, which
    Llama() reads its model parameters from."""
    target = _fake_llama_cpp(tmp_path / "fake", (
        "import numpy as np\nfrom . import llama_cpp as C\n"
        "class Llama:\n    def __init__(self, **kw):\n        self.extra = C.llama_model_default_params().use_extra_bufts\n"
        "    def eval(self, tokens):\n        self.scores = np.full((len(tokens), 3), float(self.extra))\n"))
    for extra in (True, False):
        got, err = lc.llamacpp_logits(target, tmp_path / "model.gguf", [1, 2], extra)
        assert err == "" and got.shape == (2, 3) and (got == float(extra)).all()


def test_a_crashed_child_names_its_signal(tmp_path):
    target = _fake_llama_cpp(tmp_path / "fake", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    got, err = lc.llamacpp_logits(target, tmp_path / "model.gguf", [1, 2])
    assert got is None and err.splitlines()[-1] == "killed by SIGSEGV"


@pytest.mark.slow
def test_llamacpp_runs_q8_0_dense_weights(tmp_path):
    """Q8_0 dense weights, which llama.cpp's AMX path crashes on where it is built with GCC 12, are
    evaluated without extra buffer types and agree within the Q8_0 bound (needs the build)."""
    if not lc.built(Path.home() / ".cache" / "moelab" / "llamacpp", "0.3.36"):
        pytest.skip("llama-cpp-python 0.3.36 is not built in the default cache")
    out = tmp_path / "out"
    assert lc.main(["check", "--archs", "qwen3moe", "deepseek2", "--quants", "Q8_0", "--dense-quant", "Q8_0",
                    "--out", str(out)]) == 0
    rows = json.loads((out / "result.json").read_text())["rows"]
    assert [r["extra_bufts"] for r in rows] == [False, False]


@pytest.mark.slow
def test_llamacpp_agrees_on_every_architecture(tmp_path):
    """Builds llama-cpp-python for the CPU into the default cache (once; tens of minutes), then
    checks every architecture and quant type against it."""
    assert lc.main(["all", "--out", str(tmp_path / "out")]) == 0


def test_routing_gaps_find_the_near_tie(tmp_path):
    """Seed 0's deepseek2 model routes token 5 on a group margin of about 1e-4."""
    path = lc.synth_case(tmp_path, "deepseek2", "F32", "split", "F16", 0)
    gaps = lc.routing_gaps(path, lc.TOKENS)
    assert gaps.shape == (len(lc.TOKENS),)
    assert gaps[0] < lc.NEAR_TIE and (gaps[1:] > lc.NEAR_TIE).all()
    assert (lc.routing_gaps(lc.synth_case(tmp_path, "qwen3moe", "Q8_0", "", "F16", 0), lc.TOKENS) > 0).all()
