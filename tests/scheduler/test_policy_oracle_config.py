"""oracle's OracleConfig: with no prefetch and no fills it moves nothing ahead of use (every move is
a step's own upload), its options are checked by name, and its moves ahead are what it gains by."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler import Capacity, Geometry, drive, make_policy
from scheduler.costmodel import CostModel
from traces import synth


def _case():
    L = 4
    t = synth.generate(L, 16, 2, 40, synth.SynthParams(reuse_prob=0.6, cross_layer=0.9), np.random.default_rng(0))
    cm = CostModel(gpu_expert_s=(1e-6,) * L, gpu_token_s=(0.0,) * L, upload_s=(70e-6,) * L,
                   cpu_expert_s=(40e-6,) * L, cpu_token_s=(0.0,) * L, cpu_task_s=20e-6, layer_s=(150e-6,) * L)
    return Geometry.uniform(L, 16, 2), list(t.tokens()), cm


def _moves(options):
    g, toks, cm = _case()
    pol = make_policy("oracle", g, Capacity.per_layer(g, 4), tokens=toks, cost_model=cm, **options)
    early = uploads = 0
    for item in drive(pol, toks, 1):
        kind = type(item).__name__
        if kind == "StartBackground":
            early += len(item.moves)
        elif kind == "RunLayer":
            uploads += len(item.decision.uploads)
        pol.cache.check()
    return early, uploads


def test_demand_oracle_moves_nothing_ahead_of_use():
    early, uploads = _moves({"prefetch": False, "fills": False})
    assert early == 0 and uploads > 0
    assert _moves({"fills": False})[0] > 0  # the prefetch alone moves ahead
    assert _moves({"prefetch": False})[0] > 0  # the fills alone
    assert _moves({})[0] > 0


def test_unknown_oracle_option_is_refused_by_name():
    g, toks, cm = _case()
    with pytest.raises(ValueError, match="prefetch"):
        make_policy("oracle", g, Capacity.per_layer(g, 4), tokens=toks, cost_model=cm, prefetch_all=True)
