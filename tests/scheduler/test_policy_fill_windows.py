"""lookahead's fill_window="windows": at a token's end the fills that the next token's layer
windows carry are held over and go there (so they land within that token), each batch no longer
than its window; with a link too slow for any window it is "priced"."""
from __future__ import annotations

import numpy as np

from scheduler import Capacity, Geometry, drive, make_policy
from scheduler.costmodel import CostModel
from traces import synth


def _run(window: str, up: float):
    L = 4
    t = synth.generate(L, 16, 2, 40, synth.SynthParams(reuse_prob=0.6, cross_layer=0.9), np.random.default_rng(0))
    g, toks = Geometry.uniform(L, 16, 2), list(t.tokens())
    cm = CostModel(gpu_expert_s=(1e-6,) * L, gpu_token_s=(0.0,) * L, upload_s=(up,) * L, cpu_expert_s=(40e-6,) * L,
                   cpu_token_s=(0.0,) * L, cpu_task_s=20e-6, layer_s=(150e-6,) * L)
    pol = make_policy("lookahead", g, Capacity.per_layer(g, 4), cost_model=cm, fill_window=window, max_prefetch=0)
    inside, at_end, items = [], 0, list(drive(pol, toks, 1))
    for item, nxt in zip(items, items[1:] + [None]):
        if type(item).__name__ == "StartBackground":
            if type(nxt).__name__ == "EndToken":
                at_end += len(item.moves)
            else:
                inside.append(len(item.moves))
    return inside, at_end


def test_windows_hold_fills_over_into_the_next_tokens_layer_windows():
    inside, at_end = _run("windows", 70e-6)  # two copies fit a layer's dense part
    priced_inside, priced_end = _run("priced", 70e-6)
    assert sum(inside) > sum(priced_inside) and at_end < priced_end
    assert max(inside) <= 2  # no batch longer than its window


def test_windows_on_a_slow_link_is_priced():
    assert _run("windows", 400e-6) == _run("priced", 400e-6)
