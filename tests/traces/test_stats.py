"""Statistics and hit-rate sweeps: the granite anchors, the reference LRU against the scheduler, the CLI."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from traces import stats
from moelab.trace_cli import main

from .conftest import small_trace


def test_cli_reports_the_anchor_figures(capsys):
    args = ["stats", "--phase", "decode", "--slots", "8,16", "--policies", "lru,belady", "--json"]
    assert main(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert {c: round(r, 3) for c, r in s["hit_rate"]["lru"].items()} == {"8": 0.422, "16": 0.725}
    assert {c: round(r, 3) for c, r in s["hit_rate"]["belady"].items()} == {"8": 0.620, "16": 0.859}


def test_reference_lru_matches_anchors(granite):
    got = stats.lru_hit_rates(granite, [4, 8, 16, 24], "decode")
    assert [round(got[c], 3) for c in (4, 8, 16, 24)] == [0.179, 0.422, 0.725, 0.904]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), slots=st.integers(4, 12), reset=st.booleans())
def test_reference_lru_equals_scheduler_lru(seed, slots, reset):
    t = small_trace(np.random.default_rng(seed), T=40, seqs=3)
    ref = stats.lru_hit_rates(t, [slots], None, reset)[slots]
    sched = stats.sweep(t, [slots], ["lru"], None, reset)["lru"][slots]
    assert ref == pytest.approx(sched, abs=1e-12)


def test_sweep_marks_refused_capacities_and_orders_policies(granite):
    s = stats.sweep(granite, [4, 12], ["lru", "belady", "static"], "decode", reset_per_sequence=True)
    assert s["lru"][4] is None
    assert s["belady"][12] >= max(s["lru"][12], s["static"][12])
    per_seq = [stats.sweep(granite.select("decode", [q]), [12], ["lru"])["lru"][12] for q in (0, 1, 2)]
    assert s["lru"][12] == pytest.approx(np.mean(per_seq))  # equal rows per sequence: mean of rates


def test_summary_statistics(granite):
    cov = stats.coverage(granite, "decode")
    assert 0 < cov["50%"] < cov["80%"] < cov["90%"] <= cov["touched"] <= 1
    ov = stats.adjacent_overlap(granite, "decode")
    # with k slots and a fresh cache per sequence, LRU holds exactly the previous token's experts
    lru_k = stats.lru_hit_rates(granite, [8], "decode", reset_per_sequence=True)[8]
    assert lru_k == pytest.approx(ov * (192 - 3) / 192)
    rd = stats.reuse_distances(granite, "decode")
    assert rd["routes"] == 192 * 24 * 8 and 1 <= rd["median"] <= rd["p90"] <= rd["p99"]


def test_cli_out_writes_csv_and_plot(tmp_path, capsys):
    assert main(["stats", "--phase", "decode", "--slots", "4,8", "--policies", "lru,static,belady",
                 "--out", str(tmp_path / "o")]) == 0
    table = capsys.readouterr().out
    assert "n/a" in table and "belady" in table
    rows = list(csv.DictReader(open(tmp_path / "o" / "hit_rates.csv")))
    assert {r["policy"] for r in rows} == {"lru-reference", "lru", "static", "belady"}
    assert (tmp_path / "o" / "hit_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["stats", "--policies", "nope", "--slots", "8"]) == 2
