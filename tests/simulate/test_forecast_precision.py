"""``forecast_precision``: how often lookahead's forecaster names the absent expert a step routes.
On a trace where every layer of a token routes the same expert, drawn at random per token, the
cross-layer forecast (from the token's previous step) learns it and the temporal one (from the
layer's last step) does no better than a random pick; with a slot for every expert only first uses
miss."""
from __future__ import annotations

import numpy as np

from simulate.evaluate import forecast_precision, trace_model
from traces import Trace


def _copied(num_tokens: int, L: int = 4, E: int = 8, seed: int = 0) -> Trace:
    e = np.random.default_rng(seed).integers(E, size=num_tokens)
    ids = np.repeat(e[:, None, None], L, axis=1).astype(np.int16)  # (tokens, layers, top-1)
    return Trace("copied", (E,) * L, 1, ids, np.zeros(num_tokens, np.int32), np.arange(num_tokens, dtype=np.int32),
                 np.ones(num_tokens, np.int8), None, {})


def test_a_route_copied_across_layers_is_forecast_across_layers_only():
    t = _copied(96)
    p = forecast_precision(tuple(t.tokens()), trace_model(t), slots=2)
    assert 0.5 < p["miss"] < 1.0  # a step whose expert is resident has no absent expert to name
    assert p["cross"] > 0.8 * p["miss"]  # after a few tokens of learning, the previous layer's expert is named
    assert p["temporal"] < 0.3 * p["miss"] and abs(p["random"] - p["miss"] / 6) < 0.01  # 6 absent once warm


def test_with_a_slot_for_every_expert_only_first_uses_miss():
    t = _copied(8)
    first = len(set(t.expert_ids[:, 0, 0].tolist()))
    p = forecast_precision(tuple(t.tokens()), trace_model(t), slots=8)
    assert p["miss"] == first / 8 and p["cross"] <= p["miss"]
