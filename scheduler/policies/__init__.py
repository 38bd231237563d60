"""The policies, picked by name from ``POLICIES`` and built by ``make_policy``.

One file per family: ``simple`` (cpu, gpu, lru, freq-lru, static), ``hybrid``, ``hybrid_cost``
with its floor tuner (``tuner``) and its prefetch (``prefetch``), ``belady``, ``predict``, ``lookahead`` and
``oracle``; ``base`` holds what they share. Each
policy is a plain class over a :class:`~scheduler.cache.Cache` that follows ``core.Policy``; a
family with knobs has a frozen config dataclass (``HybridConfig``, ...) whose errors name the
field, and every default is written once, there.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Iterable

import numpy as np

from ..core import Capacity, Geometry, Step, Token
from ..costmodel import CostModel
from ..profile import Profile
from .base import MAX_FILLS_PER_TOKEN, BasePolicy
from .belady import BeladyPolicy
from .hybrid import MISS_FRAC_256, HybridConfig, HybridPolicy, _by_layer_then  # noqa: F401 (tests)
from .hybrid_cost import HybridCostConfig, HybridCostPolicy
from .lookahead import LookaheadConfig, LookaheadPolicy
from .oracle import OracleConfig, OraclePolicy
from .predict import PredictConfig, PredictPolicy
from .simple import CpuPolicy, FreqLruConfig, FreqLruPolicy, GpuPolicy, LruPolicy, StaticPolicy

__all__ = [
    "POLICIES",
    "CONFIGS",
    "make_policy",
    "route_counts",
    "BasePolicy",
    "CpuPolicy",
    "GpuPolicy",
    "LruPolicy",
    "FreqLruConfig",
    "FreqLruPolicy",
    "StaticPolicy",
    "HybridConfig",
    "HybridPolicy",
    "HybridCostConfig",
    "HybridCostPolicy",
    "BeladyPolicy",
    "PredictConfig",
    "PredictPolicy",
    "LookaheadConfig",
    "LookaheadPolicy",
    "OracleConfig",
    "OraclePolicy",
    "MAX_FILLS_PER_TOKEN",
    "MISS_FRAC_256",
]

POLICIES = {
    "cpu": CpuPolicy,
    "gpu": GpuPolicy,
    "lru": LruPolicy,
    "freq-lru": FreqLruPolicy,
    "static": StaticPolicy,
    "hybrid": HybridPolicy,
    "hybrid-cost": HybridCostPolicy,
    "belady": BeladyPolicy,
    "predict": PredictPolicy,
    "lookahead": LookaheadPolicy,
    "oracle": OraclePolicy,
}

# the families with knobs: their config class (the others take none)
CONFIGS = {
    "freq-lru": FreqLruConfig,
    "hybrid": HybridConfig,
    "hybrid-cost": HybridCostConfig,
    "predict": PredictConfig,
    "lookahead": LookaheadConfig,
    "oracle": OracleConfig,
}


def route_counts(tokens: Iterable[Token], geometry: Geometry) -> np.ndarray:
    """Steps that routed each (layer, expert) over ``tokens``, ``(num_layers, max_experts)`` int64
    (a step counts once per expert, whatever its token counts)."""
    counts = np.zeros((geometry.num_layers, geometry.max_experts), dtype=np.int64)
    for t in tokens:
        for s in t.steps:
            counts[s.layer, list(s.experts)] += 1
    return counts


def make_policy(name: str, geometry: Geometry, capacity: Capacity, profile: Profile | None = None,
                future: Iterable[Step] | None = None, *, tokens: Iterable[Token] | None = None,
                cost_model: CostModel | None = None, miss_fraction: float | None = None, **options):
    """Build policy ``name``; ``options`` are its family's config fields (``CONFIGS[name]``).

    Each input goes to the policies that use it and is ignored by the others, so a caller passes
    what it has:

    - ``profile``: residents to start from (``static`` needs one); ``static`` with no profile and
      ``tokens`` given starts from the tokens' own route counts (``route_counts``: an oracle);
    - ``future``: ``belady``'s steps in replay order; by default the steps of ``tokens``;
    - ``cost_model``: the costs of ``hybrid-cost``, ``lookahead`` and ``oracle`` (they need one),
      and of ``hybrid``'s PCIe share when no ``miss_fraction`` (or ``miss_frac_256``) is given;
    - ``oracle``: the future as ``belady``'s, with its token boundaries when ``tokens`` are given;
    - ``miss_fraction``: ``hybrid``'s share of distinct misses sent over PCIe, 0..1, to the
      nearest 1/256 (``miss_frac_256``; default ``MISS_FRAC_256`` / 256).
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
    config = CONFIGS.get(name)
    known = {f.name for f in fields(config)} if config else set()
    unknown = [k for k in options if k not in known]
    if unknown:
        expected = f"expected some of {', '.join(sorted(known))}" if known else "it takes none"
        raise ValueError(f"policy {name!r}: unknown option {', '.join(unknown)}; {expected}")
    if name == "hybrid" and miss_fraction is not None:
        if not 0.0 <= miss_fraction <= 1.0:
            raise ValueError(f"miss_fraction: {miss_fraction}, expected 0..1")
        options["miss_frac_256"] = int(round(miss_fraction * 256))
    if name == "static" and profile is None and tokens is not None:
        profile = Profile.from_counts(route_counts(tokens, geometry))
    if name == "belady":  # read once, as it goes: belady keeps the future compactly, not the steps
        if future is None and tokens is not None:
            future = (s for t in tokens for s in t.steps)
        return cls(geometry, capacity, profile, future=future or ())
    if name == "oracle":
        ends = None
        if future is None and tokens is not None:
            steps = [tuple(t.steps) for t in tokens]
            future = [s for st in steps for s in st]
            ends, n = [], 0
            for st in steps:
                n += len(st)
                ends += [n] * len(st)
        return cls(geometry, capacity, profile, future=list(future or ()), cost_model=cost_model, token_ends=ends,
                   config=config(**options))
    if name in ("hybrid-cost", "lookahead"):
        return cls(geometry, capacity, profile, cost_model=cost_model, config=config(**options))
    if name == "hybrid" and "miss_frac_256" not in options:  # no fraction given: the cost model's share
        return cls(geometry, capacity, profile, config(**options), cost_model=cost_model)
    if config:
        return cls(geometry, capacity, profile, config(**options))
    return cls(geometry, capacity, profile)
