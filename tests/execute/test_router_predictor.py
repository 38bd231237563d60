"""The next block's router as a predictor (``moelab run --router-predictor``): its recall is the one
a direct numpy computation from each block's MoE input gives; off (the default) it changes no
text, decision or figure; the GPU paths measure what the host path does."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from execute import model as M
from execute.gguf_model import load_model
from scheduler import Capacity, make_policy

from .conftest import cupy_or_skip, run_json

PROMPT = (3, 17, 250, 9, 88, 41, 5, 120)  # token ids: one prefill chunk
DECODE = (7, 200, 13, 64, 99, 31, 150, 2, 77, 18)  # token ids run one at a time, as decode


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A deepseek2 model of 4 blocks: a leading dense block, then 3 MoE blocks with grouped sigmoid
    routing and a selection bias."""
    from execute.synth import config_from_preset, synth_model

    path = tmp_path_factory.mktemp("rp") / "deepseek2.gguf"
    return synth_model(path, config_from_preset("tiny", arch="deepseek2", quant="Q8_0", seed=3, num_layers=4))


class Recorder(M.NumpyExperts):
    """The numpy backend, keeping each step's MoE input and routed ids, with the batch's phase."""

    def __init__(self, weights, model):
        super().__init__(weights)
        self.model, self.seen = model, []

    def run_layer(self, item, x, ids, weights):
        self.seen.append((self.model.router_predictor.phase, item.step.layer, np.array(M._host(x), np.float64),
                          np.array(ids)))
        return super().run_layer(item, x, ids, weights)


def inputs():
    yield M.ChunkInput(0, 0, 0, "prefill", PROMPT)
    for i, t in enumerate(DECODE):
        yield M.TokenInput(i + 1, 0, len(PROMPT) + i, "decode", t)


def measure(weights, use_gpu: bool = False):
    """(the predictor's summary, the model, the recording backend) of a run of ``inputs()`` under
    policy cpu."""
    g = weights.info.geometry()
    model = M.MoeModel(weights, use_gpu=use_gpu)
    model.router_predictor = M.RouterPredictor(weights.info)
    backend = Recorder(weights, model)
    M.run(model, backend, make_policy("cpu", g, Capacity.per_layer(g, 0)), inputs())
    return model.router_predictor.summary(), model, backend


def direct(weights, seen) -> dict:
    """(phase, block) -> [positions, routed, hits@k, hits@2k] from the recorded MoE inputs: block l's
    input un-normed by its own ffn norm weight, normed by block l + 1's, times block l + 1's
    router, ranked as block l + 1 routes; compared with block l + 1's recorded ids."""
    info, lw = weights.info, weights.layers
    k = info.top_k
    wide = dataclasses.replace(info, top_k=2 * k)
    out: dict = {}
    for (ph, l, hn, _), (ph2, l2, _, ids2) in zip(seen, seen[1:]):
        if l2 != l + 1 or ph2 != ph:
            continue
        x = hn / lw[l].ffn_norm.astype(np.float64)  # (T, hidden): the residual, up to a positive scale per row
        hn2 = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + info.rms_eps) * lw[l2].ffn_norm
        logits = hn2 @ lw[l2].router.astype(np.float64).T  # (T, experts)
        if lw[l2].router_bias is not None:
            logits = logits + lw[l2].router_bias
        c = out.setdefault((ph, l2), [0, 0, 0, 0])
        for row, got in zip(logits, ids2.tolist()):
            if info.gating == "softmax" and info.expert_groups <= 1 and lw[l2].exp_probs_b is None:
                rank = np.argsort(-row, kind="stable")[: 2 * k].tolist()
            else:  # grouped sigmoid with a selection bias: block l + 1's own selection rule, 2k wide
                rank = M.route_weights(wide, row, lw[l2].exp_probs_b)[0].tolist()
            c[0] += 1
            c[1] += len(set(got))
            c[2] += len(set(got) & set(rank[:k]))
            c[3] += len(set(got) & set(rank))
    return out


@pytest.mark.parametrize("which", ["qwen3moe", "deepseek2"])
def test_recall_is_the_direct_numpy_computation(which, synth_path, deep):
    w = load_model(synth_path("Q8_0", num_layers=4) if which == "qwen3moe" else deep)
    summary, model, rec = measure(w)
    want = direct(w, rec.seen)
    moe = [l for l, n in enumerate(w.info.num_experts) if n]
    predicted = [l for l in moe if l - 1 in moe]  # a MoE block whose block above is one too
    assert sorted({l for _, l in want}) == predicted and len(predicted) == 3 - (which == "deepseek2")
    assert model.router_predictor.counts == want
    for ph, n in (("prefill", len(PROMPT)), ("decode", len(DECODE))):
        s = summary[ph]
        assert s["positions"] == n and s["routed"] == n * w.info.top_k * len(predicted)
        assert [r["layer"] for r in s["per_layer"]] == predicted
        hits = sum(want[ph, l][2] for l in predicted)
        assert s["recall_k"] == hits / s["routed"] and 0.0 < s["recall_k"] <= s["recall_2k"] <= 1.0
    assert summary["k"] == w.info.top_k and summary["top_2k"] == 2 * w.info.top_k
    assert summary["chance_k"] == w.info.top_k / max(w.info.num_experts)


def untimed(fig: dict) -> dict:
    """A run's figures without the wall-clock ones."""
    return {k: v for k, v in fig.items()
            if not k.endswith(("_s", "_per_s", "ms_per_token")) and k != "first_token_breakdown"}


def test_the_cli_reports_it_and_off_changes_nothing(synth_path, capsys):
    from execute.cli_run import run_main

    path = synth_path("Q8_0", num_layers=4)
    assert M.MoeModel(load_model(path)).router_predictor is None  # off by default
    for chunk in ("1", "32"):
        argv = (path, "-p", "The cat sat on", "-n", "8", "--prefill-chunk", chunk)
        text, fig = run_json(capsys, *argv)
        text_on, fig_on = run_json(capsys, *argv, "--router-predictor")
        assert "router_predictor" not in fig
        assert text_on == text and fig_on["digest"] == fig["digest"] and fig_on["generated"] == fig["generated"]
        rp = fig_on.pop("router_predictor")
        assert rp["prefill"]["positions"] == fig["prompt_tokens"]
        assert rp["decode"]["positions"] == fig["decode_tokens"]
        assert [r["layer"] for r in rp["decode"]["per_layer"]] == [1, 2, 3]
        assert untimed(fig_on) == untimed(fig)
    assert run_main([str(path), "-p", "Hi", "-n", "3", "--threads", "1", "--router-predictor"]) == 0
    assert capsys.readouterr().out.count("next block's router as predictor: prefill recall@2 ") == 1


def test_a_batch_left_unfinished_leaves_no_prediction(synth_path):
    """A prediction is paired only with the next block of the same batch."""
    w = load_model(synth_path("Q8_0", num_layers=4))
    model = M.MoeModel(w)
    rp = model.router_predictor = M.RouterPredictor(w.info)
    steps = rp.phased("prefill", model.chunk_steps(PROMPT))
    next(steps)  # block 0 routed, block 1 predicted; the batch is dropped
    assert set(rp.pending) == {1} and not rp.counts
    model.reset()
    for step in rp.phased("decode", model.token_steps(5)):
        model.deliver(np.zeros((1, w.info.hidden), np.float32))
    assert {ph for ph, _ in rp.counts} == {"decode"} and not rp.pending


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["1", "0"])
def test_gpu_recall_agrees_with_the_host(graphs, synth_path, monkeypatch):
    """The fused one-token path (CUDA graphs on and off) and the GPU chunk path against numpy: the
    same routing; predictions may differ only where float32 logits nearly tie."""
    cupy_or_skip()
    monkeypatch.setenv("MOELAB_CUDA_GRAPHS", graphs)
    w = load_model(synth_path("Q8_0", num_layers=4))
    host, _, rec = measure(w)
    gpu, model, grec = measure(w, use_gpu=True)
    assert model.fast and model.graphed == (graphs == "1")
    assert [(p, l, ids.tolist()) for p, l, _, ids in grec.seen] == [(p, l, ids.tolist()) for p, l, _, ids in rec.seen]
    for ph in ("prefill", "decode"):
        assert gpu[ph]["routed"] == host[ph]["routed"] > 0
        for key in ("recall_k", "recall_2k"):  # at most one hit apart
            assert abs(gpu[ph][key] - host[ph][key]) * host[ph]["routed"] <= 1 + 1e-9, (ph, key, gpu[ph], host[ph])
