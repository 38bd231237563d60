"""Shared strategies: random geometries, capacities and routing traces for the scheduler."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from scheduler import Capacity, Geometry, Step, Token


def make_tokens(num_tokens: int, num_experts: tuple[int, ...], top_k: int, seed: int, skew: float = 1.0,
                max_batch: int = 1) -> list[Token]:
    """Random routing with some popularity skew and reuse; batches of up to ``max_batch`` tokens."""
    rng = np.random.default_rng(seed)
    pops = [rng.dirichlet(np.full(n, skew)) if n else None for n in num_experts]
    toks = []
    for t in range(num_tokens):
        n_tok = int(rng.integers(1, max_batch + 1))
        steps = []
        for layer, n in enumerate(num_experts):
            if not n:
                continue
            counts: dict[int, int] = {}
            for _ in range(n_tok):
                for e in rng.choice(n, top_k, replace=False, p=pops[layer]):
                    counts[int(e)] = counts.get(int(e), 0) + 1
            experts = tuple(counts)
            steps.append(Step(layer, experts, None if n_tok == 1 else tuple(counts[e] for e in experts)))
        toks.append(Token(t, 0, t, "decode" if n_tok == 1 else "prefill", tuple(steps), n_tok))
    return toks


@st.composite
def scenarios(draw, max_layers: int = 4, max_experts: int = 12, max_tokens: int = 40, batches: bool = False):
    """(geometry, capacity, tokens): per-layer or shared pools, dense layers sometimes."""
    top_k = draw(st.integers(1, 3))
    num_layers = draw(st.integers(1, max_layers))
    n = draw(st.integers(max(top_k, 2), max_experts))
    experts = [n if draw(st.booleans()) or l == 0 else 0 for l in range(num_layers)]
    geometry = Geometry(tuple(experts), top_k, tuple(1000 if e else 0 for e in experts))
    moe = geometry.moe_layers
    if len(moe) > 1 and draw(st.booleans()):
        capacity = Capacity.shared(geometry, [moe], [draw(st.integers(0, n * len(moe)))])
    else:
        capacity = Capacity.per_layer(geometry, draw(st.integers(0, n)))
    tokens = make_tokens(draw(st.integers(1, max_tokens)), geometry.num_experts, top_k,
                         draw(st.integers(0, 2**31)), draw(st.sampled_from([0.2, 1.0, 5.0])),
                         max_batch=3 if batches else 1)
    return geometry, capacity, tokens
