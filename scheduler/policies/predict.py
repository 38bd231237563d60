"""``predict``: a cache that forecasts each layer's next experts, evicts by the forecast, and
prefetches the next layer's experts while the current one runs.

The policy learns, online from the steps it has committed (never from later ones), per MoE layer:

- ``freq``: an exponential moving average of each expert's routes per step (weight ``1 / memory``);
- ``trans``: how often expert ``b`` was routed at the layer's step after one that routed ``a``,
  with ``seen[a]`` the number of such successor steps (*temporal*);
- ``cross``: how often ``b`` was routed at the layer in a token whose previous MoE step (the layer
  above, or the last layer of the previous token) routed ``a``, with ``cseen[a]`` (*cross-layer*).

Counts decay by ``1 - 1 / memory`` per step of their layer. A forecast from a step with experts
``S`` is, for every expert ``b`` of the predicted layer, ``mean over a in S of (counts[a, b] +
prior * (freq[b] + persist * [b == a])) / (seen[a] + prior)``, the persistence term in the
temporal forecast only: the expected routes of ``b`` at that layer's step. A transition row with
few observations leans on the prior: the expert itself recurs (as ``lru`` assumes), others by
frequency.

Decisions (``misses="gpu"``, the default: every miss crosses PCIe, as in ``lru``; the CPU pool is
never used; ``misses="cpu"``: every miss runs on the CPU pool and the cache changes only by
prefetch, so fewer slots than top-k are allowed):

- a step's misses take free slots first, then the slots of the pool's residents that the step does
  not use with the lowest temporal forecast (the step's layer: from the step's own experts; other
  layers of a shared pool: from their last step; ties by layer, then expert id). Misses go in
  order of their own forecast, highest first;
- *bypass* (``bypass=True``): a miss whose forecast is below the forecast of the victim it would
  replace plus ``admit_margin`` is streamed instead (TinyLFU-style admission: a one-off expert does
  not push out one that is coming back). A miss still in flight is streamed;
- *prefetch* (``plan_prefetch``, after each step; ``max_prefetch=0``: off): the next MoE layer's
  experts are forecast from this step's experts by ``cross``; the most likely non-residents take
  the pool's free slots (forecast >= ``prefetch_margin``), then replace the residents with the
  lowest forecast (the next layer's by this forecast, other layers' by their temporal one) while
  the forecast gains at least ``prefetch_margin``, at most ``max_prefetch`` moves. The driver
  completes them before the next step is planned (timed by the link in the simulator, by the copy
  stream in the executor). After a token's last step, the next token's first MoE layer is the
  next layer.

No background work between tokens. Planning reads the state only; ``commit`` changes residency, and
``commit_background`` at the token's end folds the token's steps into the statistics.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache import ABSENT, RESIDENT
from ..core import Capacity, Decision, Geometry, Move, Step
from ..profile import Profile
from .base import MAX_FILLS_PER_TOKEN, BasePolicy

__all__ = ["PredictConfig", "PredictPolicy"]


@dataclass(frozen=True)
class PredictConfig:
    """``predict``'s knobs (see the module docstring); an error names the field.

    ``memory`` (steps, > 1), ``prior`` (> 0), ``bypass``, ``admit_margin`` (>= 0), ``max_prefetch``
    (moves per step, 0..``MAX_FILLS_PER_TOKEN``), ``prefetch_margin`` (> 0), ``misses`` ("gpu" or
    "cpu"), ``persist`` (>= 0).
    """

    memory: float = 16.0
    prior: float = 0.5
    bypass: bool = True
    admit_margin: float = 0.0
    max_prefetch: int = 8
    prefetch_margin: float = 0.25
    misses: str = "gpu"
    persist: float = 16.0

    def __post_init__(self) -> None:
        if self.misses not in ("gpu", "cpu"):
            raise ValueError(f"predict misses: {self.misses!r}, expected 'gpu' or 'cpu'")
        if not self.memory > 1.0:
            raise ValueError(f"predict memory: {self.memory}, expected > 1 (steps)")
        if not self.prior > 0.0:
            raise ValueError(f"predict prior: {self.prior}, expected > 0")
        if not self.admit_margin >= 0.0:
            raise ValueError(f"predict admit_margin: {self.admit_margin}, expected >= 0")
        if not 0 <= self.max_prefetch <= MAX_FILLS_PER_TOKEN:
            raise ValueError(f"predict max_prefetch: {self.max_prefetch}, expected 0..{MAX_FILLS_PER_TOKEN}")
        if not self.prefetch_margin > 0.0:
            raise ValueError(f"predict prefetch_margin: {self.prefetch_margin}, expected > 0")
        if not self.persist >= 0.0:
            raise ValueError(f"predict persist: {self.persist}, expected >= 0")
        for name in ("memory", "prior", "admit_margin", "prefetch_margin", "persist"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "bypass", bool(self.bypass))
        object.__setattr__(self, "max_prefetch", int(self.max_prefetch))


class PredictPolicy(BasePolicy):
    """See the module docstring; the knobs are ``PredictConfig``'s."""

    name = "predict"
    uploads_every_miss = True

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None,
                 config: PredictConfig = PredictConfig()):
        self.config = config
        self.memory, self.prior, self.bypass = config.memory, config.prior, config.bypass
        self.admit_margin, self.max_prefetch = config.admit_margin, config.max_prefetch
        self.prefetch_margin = config.prefetch_margin
        self.persist = config.persist
        misses = config.misses
        self.misses = misses
        self.uploads_every_miss = misses == "gpu"
        L, E = geometry.num_layers, max(geometry.max_experts, 1)
        # statistics stored divided by the layer's running decay ``scale[l]`` (a step decays a layer
        # by changing one number; rescaled before it underflows)
        self.scale = [1.0] * L
        self.freq_stored = np.zeros((L, E))
        self.trans, self.seen = np.zeros((L, E, E)), np.zeros((L, E))
        self.cross, self.cseen = np.zeros((L, E, E)), np.zeros((L, E))
        self.prev: list[tuple[int, ...]] = [()] * L  # each layer's last committed experts
        self.above: tuple[int, ...] = ()  # experts of the last committed step (any layer)
        self._unlearnt: list[tuple] = []  # (layer, experts, its prev, the step above) this token
        moe = geometry.moe_layers
        self.next_layer = {l: moe[(i + 1) % len(moe)] for i, l in enumerate(moe)}
        super().__init__(geometry, capacity, profile)

    # forecasts -------------------------------------------------------------------------------
    def frequency(self, layer: int) -> np.ndarray:
        """The layer's decayed routes per step, (max_experts,) (a fresh array)."""
        return self.freq_stored[layer] * self.scale[layer]

    def _mix(self, counts: np.ndarray, seen: np.ndarray, layer: int, experts, persist: float) -> np.ndarray:
        """The mean over ``experts`` (rows a) of (counts[a] + prior * (freq + persist * [b == a]))
        / (seen[a] + prior), in true units; only the rows asked for are computed (nothing learnt:
        the temporal rows say an expert recurs, the cross-layer rows are 0)."""
        idx = list(experts)
        if not idx:
            return self.frequency(layer)
        s = self.scale[layer]
        num = counts[layer, idx] * s + (self.prior * s) * self.freq_stored[layer]  # (n, E)
        if persist:
            num[np.arange(len(idx)), idx] += self.prior * persist
        num /= (seen[layer, idx] * s + self.prior)[:, None]
        q = num.sum(axis=0)  # (E,)
        q *= 1.0 / len(idx)
        return q

    def forecast(self, layer: int, experts) -> np.ndarray:
        """Temporal forecast: expected routes of each expert at ``layer``'s next step after one
        that routed ``experts`` (a fresh (max_experts,) array; reads the statistics only)."""
        return self._mix(self.trans, self.seen, layer, experts, self.persist)

    def forecast_below(self, layer: int, experts) -> np.ndarray:
        """Cross-layer forecast: expected routes of each expert at ``layer`` in a token whose
        previous MoE step routed ``experts``."""
        return self._mix(self.cross, self.cseen, layer, experts, 0.0)

    # steps -----------------------------------------------------------------------------------
    def plan(self, step: Step) -> Decision:
        layer, cache = step.layer, self.cache
        state = cache.state[layer]
        experts = step.experts
        misses = [e for e in experts if state[e] != RESIDENT]
        if not misses:
            return Decision(step, experts)
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        if self.misses == "cpu":
            return Decision(step, hits, cpu=tuple(misses))
        q = self.forecast(layer, experts)
        fresh = [e for e in misses if (layer, e) not in cache.slot]  # the rest are in flight
        fresh.sort(key=lambda e: -q[e])  # stable: router rank breaks ties
        slots = cache.free_slots(layer, len(fresh))
        uploads = fresh[: len(slots)]
        evictions: list[tuple[int, int]] = []
        streamed = {e for e in misses if (layer, e) in cache.slot}
        rest = fresh[len(slots):]
        if rest:
            victims = self._victims(layer, q, set(experts), len(rest))
            for e in rest:
                if victims and (not self.bypass or q[e] >= victims[0][0] + self.admit_margin):
                    v = victims.pop(0)[1]
                    uploads.append(e)
                    slots.append(cache.slot[v])
                    evictions.append(v)
                else:
                    streamed.add(e)
        streams = tuple([e for e in experts if e in streamed])
        return Decision(step, hits, tuple(uploads), tuple(slots), streams, (), tuple(evictions))

    def _victims(self, layer: int, q: np.ndarray, used, need: int) -> list[tuple[float, tuple[int, int]]]:
        """Up to ``need`` (forecast, key) of the pool's residents not in ``used`` (experts of
        ``layer``), lowest forecast first, then layer, then expert; ``q`` ranks ``layer``'s."""
        return self._ranked(layer, q, used)[:need]

    def _ranked(self, layer: int, q: np.ndarray, used=()) -> list[tuple[float, tuple[int, int]]]:
        """(forecast, key) of every resident of ``layer``'s pool but ``layer``'s experts in
        ``used``, ascending (ties: layer, expert); ``q`` ranks ``layer``'s, other layers rank by
        their own temporal forecast."""
        cache = self.cache
        p = cache.pool_of[layer]
        state = cache.state
        if len(self.capacity.pools[p][0]) == 1:  # the layer's own pool
            qs, row = q.tolist(), state[layer]
            out = [(qs[k[1]], k) for k in cache.owner[p]
                   if k is not None and row[k[1]] == RESIDENT and k[1] not in used]
        else:
            own = {layer: q}
            out = [(float(self._own(k[0], own)[k[1]]), k) for k in cache.owner[p]
                   if k is not None and state[k[0]][k[1]] == RESIDENT and not (k[0] == layer and k[1] in used)]
        out.sort()
        return out

    def _own(self, layer: int, memo: dict) -> np.ndarray:
        """The layer's temporal forecast from its last committed step (memoised in ``memo``; a
        layer's statistics change only when one of its steps is committed)."""
        q = memo.get(layer)
        if q is None:
            q = memo[layer] = self.forecast(layer, self.prev[layer])
        return q

    def commit(self, d: Decision) -> None:
        """Change residency. The step is learnt at the token's end (``commit_background`` with no
        moves: this policy has no background work between tokens, and a prefetch always has
        moves). A layer's statistics change only with its own steps and are read by its next step
        and the prefetch before it, in a later token; only the prefetch for the next token's first
        layer, planned after this token's last step, sees that layer's statistics as of the
        previous token."""
        self._take_slots(d)
        layer, experts = d.step.layer, d.step.experts
        self._unlearnt.append((layer, experts, self.prev[layer], self.above))
        self.prev[layer] = self.above = experts

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        super().commit_background(moves)
        if not moves and self._unlearnt:
            self._learn()

    def _learn(self) -> None:
        """Fold the token's committed steps into the statistics: each decays its layer by
        ``1 - 1 / memory`` and adds one route per expert and per (before, expert) pair; vectorised
        over groups of steps of distinct layers (a token has one step per layer)."""
        steps, self._unlearnt = self._unlearnt, []
        while steps:
            group, rest, layers = [], [], set()
            for st in steps:
                (rest if st[0] in layers else group).append(st)
                layers.add(st[0])
            self._learn_group(group)
            steps = rest

    def _learn_group(self, group: list[tuple]) -> None:
        """Each step of ``group`` (distinct layers) decays its layer (one number, ``scale``) and
        adds its routes: k entries of ``freq`` and ``seen``, k x k of ``counts`` per statistic."""
        arrays = (self.freq_stored, self.trans, self.seen, self.cross, self.cseen)
        keep = 1.0 - 1.0 / self.memory
        for l, now, prev, above in group:
            s = self.scale[l] * keep
            if s < 1e-200:  # rescale before the stored values overflow
                for a in arrays:
                    a[l] *= s
                s = 1.0
            self.scale[l] = s
            w = 1.0 / s
            now = list(now)
            self.freq_stored[l, now] += w / self.memory
            for counts, seen, before in ((self.trans, self.seen, prev), (self.cross, self.cseen, above)):
                if before:
                    before = list(before)
                    seen[l, before] += w
                    counts[l][np.ix_(before, now)] += w

    # prefetch --------------------------------------------------------------------------------
    def plan_prefetch(self, step: Step) -> tuple[Move, ...]:
        """Moves that bring the next MoE layer's likeliest experts in (see the module docstring);
        called after ``step`` is committed. Reads the state only."""
        if not self.max_prefetch:
            return ()
        cache = self.cache
        nl = self.next_layer[step.layer]
        p = cache.pool_of[nl]
        if p < 0 or cache.size[p] == 0:
            return ()
        r = self.forecast_below(nl, step.experts)
        margin, n, rl = self.prefetch_margin, self.geometry.num_experts[nl], r.tolist()
        row = cache.state[nl]
        cands = [e for e in np.argsort(-r[:n], kind="stable").tolist() if row[e] == ABSENT]
        free = cache.free_slots(nl, len(cands))
        moves = []
        for e, s in zip(cands, free):
            if rl[e] < margin or len(moves) == self.max_prefetch:
                return tuple(moves)
            moves.append(Move(nl, e, s, None, rl[e]))
        for e, (vq, v) in zip(cands[len(free):], self._ranked(nl, r)):
            gain = rl[e] - vq
            if gain < margin or len(moves) == self.max_prefetch:
                break
            moves.append(Move(nl, e, cache.slot[v], v, gain))
        return tuple(moves)
