"""execute.llamacpp_check and its script: the comparison, the routing-tie rule, the cases, argument
errors and moelab's side on its own, the whole check against a stand-in llama.cpp; (slow) the build
and the check against llama.cpp end to end."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from execute import llamacpp_check as lc  # noqa: E402

_spec = importlib.util.spec_from_file_location("llamacpp_check_script",
                                               Path(__file__).parents[1] / "experiments" / "llamacpp_check.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


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


def test_activation_formats_follow_llamacpps_vec_dot_types():
    assert [lc.act_format(q) for q in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "MXFP4", "Q4_K", "Q6_K", "IQ4_XS")] == \
        ["F32", "F16", "BF16", "Q8_32", "Q8_32", "Q8_32", "Q8_256", "Q8_256", "Q8_256"]
    assert lc.file_formats("Q4_K", "F16") == ("Q8_256", "F16") and lc.file_formats("Q8_0", "Q8_0") == ("Q8_32",)
    assert "Q8_256 + F16" in lc.tie_rule("Q4_K", "F16") and "4 x" in lc.tie_rule("Q4_K", "F16")


def test_rounding_steps():
    h = np.array([[1.0, -2.54, 0.5, 0.0] * 8])  # one block of 32
    assert np.allclose(lc.rounding_step(h, "Q8_32"), 2.54 / 127)
    v = np.array([1.0, 3.0, -0.3, 0.0])
    assert (lc.rounding_step(v, "F16") == np.array([np.spacing(np.float16(x)) for x in (1.0, 3.0, 0.3)] + [0])).all()
    assert lc.rounding_step(v, "BF16")[1] == 2.0 ** -6 and lc.rounding_step(v, "F32")[0] == 2.0 ** -23
    with pytest.raises(ValueError, match="blocks of 256"):
        lc.rounding_step(np.ones((1, 64)), "Q8_256")


def test_logit_noise_matches_real_8bit_rounding():
    """The expected noise is the RMS change of the logits when the input is rounded to 8 bits per
    32 values (over many inputs, within 10%)."""
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((400, 64)), rng.standard_normal((8, 64))
    d = np.abs(h.reshape(400, 2, 32)).max(-1, keepdims=True) / 127
    rounded = (np.round(h.reshape(400, 2, 32) / d) * d).reshape(400, 64)
    measured = np.sqrt((((rounded - h) @ w.T) ** 2).mean())
    expected = np.sqrt((lc.logit_noise(h, w, ["Q8_32"]) ** 2).mean())
    assert expected == pytest.approx(measured, rel=0.1)
    two = lc.logit_noise(h, w, ["Q8_32", "F16"])
    assert (two >= lc.logit_noise(h, w, ["Q8_32"])).all()


def test_tie_ratio():
    s, n = np.array([3.0, 2.0, 1.0, 0.0]), np.ones(4)
    assert lc.tie_ratio(s, n, 2) == pytest.approx(1 / np.sqrt(2))  # expert 1 (kept) vs 2 (dropped)
    assert lc.tie_ratio(s, n, 4) == np.inf
    assert lc.tie_ratio(s, n * 1e-3, 1) == pytest.approx(1 / np.sqrt(2) * 1e3)
    # two groups of two; group scores 5 and 1: the group margin 4 in sqrt(4) noises, the experts'
    # margin (within the kept group) 1 in sqrt(2)
    assert lc.tie_ratio(s, n, 1, groups=2, groups_used=1) == pytest.approx(1 / np.sqrt(2))
    g = np.array([3.0, 0.0, 2.9, 0.05])  # groups 3.0 vs 2.95: the group margin decides
    assert lc.tie_ratio(g, n, 1, groups=2, groups_used=1) == pytest.approx(0.05 / 2)


def _rounded_reference_moves(path, tokens, fmt) -> list[int]:
    """Positions whose experts change when a float64 reference rounds every expert matmul's input
    to ``fmt`` as llama.cpp does (the router, in F32, reads unrounded inputs)."""
    from execute import reference as R
    from execute.gguf_model import load_model
    from execute.model import Route

    def rnd(x):
        s = np.asarray(x, np.float64)
        if fmt == "BF16":  # round to nearest even
            u = s.astype(np.float32).view(np.uint32).astype(np.uint64)
            return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
        b = int(fmt[3:])
        blocks = s.reshape(*s.shape[:-1], -1, b)
        d = np.abs(blocks).max(-1, keepdims=True) / 127
        return (np.round(blocks / np.where(d == 0, 1, d)) * d).reshape(s.shape)

    w = load_model(path)
    _, plain = R.reference_forward(w, list(tokens))
    moe, act = R._moe, R._act

    def rounded_moe(info, lw, ex, h, routes_l):
        logits = h @ np.asarray(lw.router, np.float64).T
        if lw.router_bias is not None:
            logits = logits + np.asarray(lw.router_bias, np.float64)
        return moe(info, lw, ex, rnd(h), [Route(*R._select(info, logits[t], lw, None)) for t in range(len(h))])

    R._moe, R._act = rounded_moe, (lambda kind, g, u: rnd(act(kind, g, u)))
    try:
        _, rounded = R.reference_forward(w, list(tokens))
    finally:
        R._moe, R._act = moe, act
    return [t for t in range(len(tokens))
            if any(a is not None and set(a[0]) != set(b[0]) for a, b in zip(plain[t], rounded[t]))]


@pytest.mark.parametrize("arch, quant, dense, moved", [("gpt-oss", "MXFP4", "F16", [2]), ("llama", "Q4_K", "F16", []),
                                                       ("llama", "BF16", "Q8_0", [11])])
def test_ties_cover_the_routing_that_activation_rounding_moves(tmp_path, arch, quant, dense, moved):
    """Seed 0: rounding the experts' activations moves these positions' experts; each is a tie."""
    path = lc.synth_case(tmp_path, arch, quant, "", dense, 0)
    assert _rounded_reference_moves(path, lc.TOKENS, lc.act_format(quant)) == moved
    ratio = lc.routing_ties(path, lc.TOKENS, lc.file_formats(quant, dense))
    assert ratio.shape == (len(lc.TOKENS),) and all(ratio[t] < lc.TIE_Z for t in moved)


def test_routing_ties_of_seed_0(tmp_path):
    """llama Q4_K's position 11 (the flip that failed the row under a relative 1e-3 rule) and
    deepseek2's position 0 (group margin 1e-4) are ties; F32 experts elsewhere have none."""
    q4k = lc.routing_ties(lc.synth_case(tmp_path, "llama", "Q4_K", "", "F16", 0), lc.TOKENS, ("Q8_256", "F16"))
    assert list(np.flatnonzero(q4k < lc.TIE_Z)) == [11]
    ds = lc.routing_ties(lc.synth_case(tmp_path, "deepseek2", "F32", "split", "F16", 0), lc.TOKENS, ("F32", "F16"))
    assert list(np.flatnonzero(ds < lc.TIE_Z)) == [0]
    q = lc.routing_ties(lc.synth_case(tmp_path, "qwen3moe", "F32", "", "F16", 0), lc.TOKENS, ("F32", "F16"))
    assert (q > 10 * lc.TIE_Z).all()


@pytest.mark.parametrize("argv, match", [(["check", "--archs", "mixtral"], "mixtral"),
                                         (["check", "--quants", "Q5_1"], "Q5_1"),
                                         (["check", "--dense-quant", "Q4_K"], "--dense-quant"),
                                         (["check", "--extra-bufts", "maybe"], "--extra-bufts"),
                                         (["check", "--tokens", "0"], "--tokens"), (["build", "--jobs", "0"], "--jobs")])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        script._args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_check_without_a_build_exits_2(tmp_path, capsys):
    assert script.main(["check", "--cache", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert "not built" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_moelab_side_matches_the_reference(tmp_path):
    from execute.gguf_model import load_model
    from execute.reference import reference_forward

    path = lc.synth_case(tmp_path, "deepseek2", "Q4_K", "split", "F16", 3)
    ours = lc.moelab_logits(path, lc.TOKENS)
    ref, _ = reference_forward(load_model(path), list(lc.TOKENS))
    assert ours.shape == (len(lc.TOKENS), 320) and lc.compare(ours, np.asarray(ref))["nmse"] < 1e-10


def _stand_in(flip: int | None = None, fail: bool = False):
    """llama.cpp's logits function replaced by moelab's reference, with position ``flip`` changed
    as a routing flip would change it (or a refusal to load)."""
    def logits(target, path, tokens, extra):
        if fail:
            return None, "llama_model_load: error loading model\nfailed to load"
        ref = lc.moelab_logits(path, tokens)
        if flip is not None:
            ref[flip] = np.roll(ref[flip], 7)
        return ref, ""
    return logits


@pytest.mark.parametrize("flip, rc", [(None, 0), (11, 0), (4, 1)])
def test_check_leaves_out_the_tie_and_only_it(tmp_path, capsys, flip, rc):
    """llama Q4_K, seed 0: a flip at the tie (position 11) is left out and counted; one elsewhere
    fails the row."""
    out = tmp_path / "out"
    argv = ["check", "--archs", "llama", "--quants", "Q4_K", "--out", str(out)]
    assert script.main(argv, llamacpp=_stand_in(flip)) == rc
    row = json.loads((out / "result.json").read_text())["rows"][0]
    assert row["near_ties"] == [11] and row["positions"] == 11 and row["formats"] == "Q8_256+F16"
    assert row["ok"] == (rc == 0) and (row["nmse"] < 1e-10) == (rc == 0)
    text = capsys.readouterr().out
    assert "4 x" in text and "llama_Q4_K.gguf" in text and "1 routing-tie positions left out" in text


def test_a_file_llamacpp_refuses_is_a_failed_row(tmp_path, capsys):
    out = tmp_path / "out"
    assert script.main(["check", "--archs", "olmoe", "--quants", "F16", "--out", str(out)],
                       llamacpp=_stand_in(fail=True)) == 1
    row = json.loads((out / "result.json").read_text())["rows"][0]
    assert row["ok"] is False and "failed to load" in row["error"]
    assert "llama.cpp failed: failed to load" in capsys.readouterr().out


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


_CACHE = Path.home() / ".cache" / "moelab" / "llamacpp"


@pytest.mark.slow
def test_llamacpp_runs_q8_0_dense_weights(tmp_path):
    """Q8_0 dense weights, which llama.cpp's AMX path crashes on where it is built with GCC 12, are
    evaluated without extra buffer types and agree within the Q8_0 bound (needs the build)."""
    if not lc.built(_CACHE, "0.3.36"):
        pytest.skip("llama-cpp-python 0.3.36 is not built in the default cache")
    out = tmp_path / "out"
    assert script.main(["check", "--archs", "qwen3moe", "deepseek2", "--quants", "Q8_0", "--dense-quant", "Q8_0",
                        "--out", str(out)]) == 0
    rows = json.loads((out / "result.json").read_text())["rows"]
    assert [r["extra_bufts"] for r in rows] == [False, False]


@pytest.mark.slow
def test_llamacpp_agrees_on_every_architecture(tmp_path):
    """Builds llama-cpp-python for the CPU into the default cache (once; tens of minutes), then
    checks every architecture and quant type against it."""
    assert script.main(["all", "--out", str(tmp_path / "out")]) == 0
