"""``oracle``: the ceiling online policies are measured against; it knows the future, the link
and the CPU.

It is ``lookahead``'s planner (``lookahead.CostPlanner``) fed with the trace instead of
forecasts, so it differs from the online policy only in what it knows:

- *residency* is Belady's: an expert's value is ``1 / (1 + d)``, ``d`` the steps to its next use
  (0 when never used again), so victims are the residents used furthest ahead, and an upload is
  admitted (else streamed) only when it is used sooner than its victim;
- *prefetch*: after each step, experts the next layer's step routes, within the link's idle
  window (the next layer's dense part, less the link's queue), so it never delays that step by
  the cost model; each replaces the resident used furthest ahead, only if that one is used later;
- *split*: each step's misses go over PCIe or to the CPU pool, the choice of fastest predicted
  layer time (ties: more uploads), misses used soonest first over PCIe;
- *fills* after each token, within ``fill_share`` of the token's predicted time: experts used
  after the next token (earlier ones would still be in flight), soonest first, over residents
  used later.

Its swaps are never held back (no audit: they are certain). It is no proof of optimality: a test checks it against every online policy on the evaluation
traces (``simulate.evaluate``). ``OracleConfig`` turns its future prefetch and fills off, leaving
Belady's residency and the split: how much of its gain needs foresight of what to move ahead.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..core import Capacity, Geometry, Step
from ..costmodel import CostModel
from ..profile import Profile
from .base import MAX_FILLS_PER_TOKEN
from .lookahead import CostPlanner, LookaheadConfig

__all__ = ["OracleConfig", "OraclePolicy", "ORACLE_CONFIG"]

# certain prefetches only; any strict improvement; the link window is the only cap
ORACLE_CONFIG = LookaheadConfig(confidence=1.0, margin=1e-12, max_prefetch=MAX_FILLS_PER_TOKEN, fill_share=1.0,
                                slack=0.0, reuse_weight=0.0, audit=False, fill_window="idle")


@dataclass(frozen=True)
class OracleConfig:
    """What ``oracle`` moves ahead of use: ``prefetch`` (the next step's experts in the link's idle
    window) and ``fills`` (experts used after the next token, at a token's end). Both off: Belady's
    residency and the fastest split only."""

    prefetch: bool = True
    fills: bool = True


class OraclePolicy(CostPlanner):
    """See the module docstring; ``future``: every step in replay order, ``token_ends``: the
    index of each token's first step past its last (None: one step per layer and token is
    assumed from the geometry's MoE layers)."""

    name = "oracle"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 future: Sequence[Step] = (), cost_model: CostModel | None = None,
                 token_ends: Sequence[int] | None = None, fill_share: float | None = None,
                 config: OracleConfig = OracleConfig()):
        self.future = list(future)
        if not self.future:
            raise ValueError("policy 'oracle' needs the whole trace (future=steps in replay order)")
        n = len(self.future)
        self.inf = inf = n + 1
        L, E = geometry.num_layers, max(geometry.max_experts, 1)
        nxt = np.full((L, E), inf, dtype=np.int64)
        self.next_use: list[np.ndarray] = [None] * n  # per step, its experts' next use after it
        for i in range(n - 1, -1, -1):
            st = self.future[i]
            ex = list(st.experts)
            self.next_use[i] = nxt[st.layer, ex].copy()
            nxt[st.layer, ex] = i
        self.nxt = nxt  # next use at or after ``pos``
        self.pos = 0
        if token_ends is None:
            per = len(geometry.moe_layers)
            token_ends = [min((i // per + 1) * per, n) for i in range(n)]
        self.token_end = list(token_ends)
        cfg = ORACLE_CONFIG if fill_share is None else replace(ORACLE_CONFIG, fill_share=fill_share)
        cfg = replace(cfg, max_prefetch=cfg.max_prefetch if config.prefetch else 0,
                      fill_share=cfg.fill_share if config.fills else 0.0)
        super().__init__(geometry, capacity, profile, cost_model, cfg)

    def _dist(self, nxt: np.ndarray, now: int) -> np.ndarray:
        return np.where(nxt >= self.inf, 0.0, 1.0 / (1.0 + (nxt - now)))

    def plan(self, step: Step):
        i = self.pos
        if i >= len(self.future) or self.future[i].layer != step.layer or self.future[i].experts != step.experts:
            raise ValueError(f"oracle: step {i} differs from the trace it was given")
        return super().plan(step)

    def value(self, layer, experts=None):
        row = self.nxt[layer].copy()
        if experts is not None and self.pos < len(self.future) and self.future[self.pos].layer == layer:
            row[list(self.future[self.pos].experts)] = self.next_use[self.pos]  # planning this step
        return self._dist(row, self.pos)

    def next_value(self, step, layer):
        return np.where(self.nxt[layer] == self.pos, 1.0, self._dist(self.nxt[layer], self.pos))

    def fill_value(self, layer):
        return self._dist(self.nxt[layer], self.pos)

    def fillable(self, layer):
        """Experts not used in the next token (a fill is in flight all through it)."""
        pos = self.pos
        if pos >= len(self.future):
            return np.zeros(self.nxt.shape[1], dtype=bool)
        return self.nxt[layer] >= self.token_end[pos]  # the next token's steps: [pos, end)

    def learn(self, step):
        i = self.pos
        self.nxt[step.layer, list(step.experts)] = self.next_use[i]
        self.pos = i + 1
