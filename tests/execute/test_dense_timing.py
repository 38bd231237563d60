"""execute.dense_timing without a GPU: the repeated figures reduced to medians and ratios."""
from __future__ import annotations

import pytest

from execute.dense_timing import summarize


def _runs(host, event, tps, prompt):
    return {"host_us": host, "event_us": event, "tokens_per_s": tps, "prompt_tokens_per_s": prompt}


def test_summarize_takes_medians_and_ratios_as_times_faster():
    res = {"float32": _runs([40.0, 50.0, 60.0], [30.0, 30.0, 90.0], [10.0, 11.0, 9.0], [100.0, 100.0, 100.0]),
           "fused": _runs([10.0, 9.0, 100.0], [6.0, 5.0, 7.0], [20.0, 22.0, 21.0], [300.0, 200.0, 250.0]),
           "graphs": _runs([5.0, 5.0, 5.0], [4.0, 4.0, 4.0], [42.0, 42.0, 42.0], [250.0, 250.0, 250.0])}
    summary, ratios = summarize(res)
    assert summary["fused"]["dense_host_us_per_block"] == 10.0  # the median: one slow repeat does not count
    assert summary["float32"]["dense_event_us_per_block"] == 30.0
    assert summary["fused"]["runs"] is res["fused"]
    assert ratios["dense_host"] == pytest.approx(5.0) and ratios["dense_events"] == pytest.approx(5.0)
    assert ratios["tokens_per_s"] == pytest.approx(2.1) and ratios["prompt_tokens_per_s"] == pytest.approx(2.5)
    assert ratios["graphs_dense_host"] == pytest.approx(2.0) and ratios["graphs_tokens_per_s"] == pytest.approx(2.0)
