"""Prompt-lookup speculative decoding: drafting, verification (greedy and sampled), and ``moelab run
--speculative`` giving plain greedy decoding's tokens on every architecture."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from execute.archs import ARCHS
from execute.cli_run import run_main
from execute.sampling import Sampler
from execute.speculative import lookup_draft, verify

from .conftest import run_json

PROMPT = "the cat sat on the mat the cat sat on the"  # with --raw, drafts get accepted on every tiny model




# drafting -----------------------------------------------------------------------------------------
def test_lookup_prefers_the_longest_most_recent_match():
    ctx = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    assert lookup_draft(ctx, 2) == [9, 8]  # 3-gram (1, 2, 3) at 0; the later (2, 3) at 5 is a shorter match
    assert lookup_draft([5, 2, 3, 4, 6, 2, 3, 5, 6, 7, 3], 3) == [5, 6, 7]  # 1-gram: the most recent 3 (at 6)
    assert lookup_draft([4, 5, 6, 7], 3) == []  # nothing repeats
    assert lookup_draft([1, 2, 1, 2], 4) == [1, 2]  # continuation up to the context's end
    assert lookup_draft([7, 7, 7], 3) == [7]  # overlapping match
    assert lookup_draft([1, 2, 1], 0) == [] and lookup_draft([1], 3) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=30), st.integers(1, 4))
def test_a_draft_continues_an_earlier_occurrence_of_the_tail(ctx, n):
    draft = lookup_draft(ctx, n)
    assert len(draft) <= n
    if not draft:
        assert len(ctx) < 2 or ctx[-1] not in ctx[:-1]  # no 1-gram match either
        return
    found = False
    for size in (3, 2, 1):
        if size >= len(ctx):
            continue
        starts = [i for i in range(len(ctx) - size) if ctx[i:i + size] == ctx[-size:]]
        if starts:
            i = starts[-1]
            found = draft == ctx[i + size:i + size + n]
            break
    assert found


# verification -------------------------------------------------------------------------------------
def one_hot_rows(ids, vocab=6):
    rows = np.zeros((len(ids), vocab))
    rows[np.arange(len(ids)), ids] = 5.0
    return rows


def test_greedy_verification_accepts_the_matching_prefix():
    g = Sampler(0.0)
    assert verify(g, [3, 4, 5], one_hot_rows([3, 4, 5, 1])) == [3, 4, 5, 1]  # all accepted + one more
    assert verify(g, [3, 4, 5], one_hot_rows([3, 2, 5, 1])) == [3, 2]  # second rejected, replaced
    assert verify(g, [3], one_hot_rows([0, 1])) == [0]
    with pytest.raises(ValueError, match="logit rows"):
        verify(g, [3, 4], one_hot_rows([3, 4]))


def test_speculative_sampling_keeps_the_samplers_distribution():
    """First token out of a verification batch, drafted 2: its frequencies follow the sampler's p,
    whether or not 2 is likely (seeded; 20000 draws, each frequency within 0.015 of p, ~4 sigma)."""
    logits = np.array([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0], [0.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    for temp, top_k in ((1.0, 0), (0.7, 3), (3.0, 0)):
        s = Sampler(temp, seed=3, top_k=top_k)
        p = s.probs(logits[0])
        first = np.bincount([verify(s, [2], logits)[0] for _ in range(20000)], minlength=6) / 20000
        assert np.abs(first - p).max() < 0.015, (temp, top_k, first, p)
    s = Sampler(1.0, seed=4)
    accepted_first = [out for out in (verify(s, [2], logits) for _ in range(20000)) if out[0] == 2]
    second = np.bincount([out[1] for out in accepted_first], minlength=6) / len(accepted_first)
    assert np.abs(second - s.probs(logits[1])).max() < 0.015  # after an accepted draft: the next row's p


# moelab run --speculative -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", tuple(ARCHS))
def test_speculative_greedy_gives_plain_greedy_tokens(arch, models, capsys):
    accepted = 0
    for draft in (1, 3) if arch != "qwen3moe" else (1, 2, 3, 4):
        text, fig = run_json(capsys, models(arch), "-p", PROMPT, "-n", "48", "--speculative", draft, "--compare", "--raw",
                             "--backend", "numpy")
        assert fig["same_tokens"], (arch, draft)
        assert fig["generated"] == fig["plain"]["generated"] and fig["speculative"] == draft
        assert fig["decode_positions"] == fig["decode_steps"] + fig["drafted"]
        assert fig["decode_tokens"] == fig["decode_steps"] + fig["accepted"]
        assert 0 < fig["tokens_per_step"] <= draft + 1
        accepted += fig["accepted"]
    assert accepted > 0, arch  # drafts were accepted, so the batches mattered


def test_speculative_on_the_engine_cpu_path(models, capsys):
    plain, _ = run_json(capsys, models("llama"), "-p", PROMPT, "-n", "40", "--backend", "engine")
    text, fig = run_json(capsys, models("llama"), "-p", PROMPT, "-n", "40", "--backend", "engine", "--speculative", "4")
    assert text == plain and fig["accepted"] > 0


def test_speculative_sampling_runs_seeded(models, capsys):
    args = (models(), "-p", PROMPT, "-n", "40", "--temp", "0.8", "--speculative", "3", "--backend", "numpy")
    a, fa = run_json(capsys, *args, "--seed", "1")
    b, fb = run_json(capsys, *args, "--seed", "1")
    assert a == b and fa["digest"] == fb["digest"] and fa["drafted"] > 0


def test_summary_reports_acceptance_and_both_speeds(models, capsys):
    assert run_main([str(models()), "-p", PROMPT, "-n", "24", "--speculative", "2", "--compare", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "speculative (draft 2):" in out and "acceptance" in out and "plain decode:" in out
    assert "same tokens: yes" in out


def test_speculative_errors_exit_2(models, capsys):
    for argv, word in ((["--speculative", "5"], "--speculative"), (["--speculative", "-1"], "--speculative"),
                       (["--compare"], "--compare")):
        assert run_main([str(models()), "-p", "x", *argv]) == 2, argv
        assert word in capsys.readouterr().err, argv


def test_experiment_executor_mode_writes_results(models, tmp_path, monkeypatch, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "experiments" / "speculative.py"
    spec = importlib.util.spec_from_file_location("speculative_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["speculative.py", "--executor", str(models()), "--max-draft", "2", "--repeats", "1",
                                      "--gen-tokens", "24", "--threads", "1", "--backend", "numpy", "--prefill-chunk", "8",
                                      "--policies", "cpu", "--out", str(tmp_path)])
    assert mod.main() == 0
    out = capsys.readouterr().out
    assert "PASS  speculative greedy gives plain greedy's tokens" in out and "FAIL" not in out
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["draft_len"] for r in res if r["mode"] == "decode"] == [0, 1, 2]
    assert {r["mode"] for r in res} == {"decode", "prefill", "prefill-1"}
    assert (tmp_path / "speculative.png").stat().st_size > 0 and (tmp_path / "results.csv").exists()
