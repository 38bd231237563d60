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
prior * freq[b]) / (seen[a] + prior)``: the expected routes of ``b`` at that layer's step (about
top-k in all). A transition row with few observations leans on the frequency.

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

No background work between tokens. Planning reads the state only; ``commit`` changes residency and
then learns from the step.
"""
from __future__ import annotations

import numpy as np

from .cache import RESIDENT
from .core import Capacity, Decision, Geometry, Move, Step
from .policies import MAX_FILLS_PER_TOKEN, BasePolicy
from .profile import Profile

__all__ = ["PredictPolicy"]


class PredictPolicy(BasePolicy):
    """See the module docstring. Options: ``memory`` (steps, > 1), ``prior`` (> 0), ``bypass``,
    ``admit_margin`` (>= 0), ``max_prefetch`` (moves per step, 0..512), ``prefetch_margin`` (> 0),
    ``misses`` ("gpu" or "cpu")."""

    name = "predict"
    uploads_every_miss = True

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 memory: float = 16.0, prior: float = 0.5, bypass: bool = True, admit_margin: float = 0.0,
                 max_prefetch: int = 8, prefetch_margin: float = 0.25, misses: str = "gpu"):
        if misses not in ("gpu", "cpu"):
            raise ValueError(f"predict misses: {misses!r}, expected 'gpu' or 'cpu'")
        if not memory > 1.0:
            raise ValueError(f"predict memory: {memory}, expected > 1 (steps)")
        if not prior > 0.0:
            raise ValueError(f"predict prior: {prior}, expected > 0")
        if not admit_margin >= 0.0:
            raise ValueError(f"predict admit_margin: {admit_margin}, expected >= 0")
        if not 0 <= max_prefetch <= MAX_FILLS_PER_TOKEN:
            raise ValueError(f"predict max_prefetch: {max_prefetch}, expected 0..{MAX_FILLS_PER_TOKEN}")
        if not prefetch_margin > 0.0:
            raise ValueError(f"predict prefetch_margin: {prefetch_margin}, expected > 0")
        self.memory, self.prior, self.bypass = float(memory), float(prior), bool(bypass)
        self.admit_margin, self.max_prefetch = float(admit_margin), int(max_prefetch)
        self.prefetch_margin = float(prefetch_margin)
        self.misses = misses
        self.uploads_every_miss = misses == "gpu"
        L, E = geometry.num_layers, max(geometry.max_experts, 1)
        self.freq = np.zeros((L, E))
        self.trans, self.seen = np.zeros((L, E, E)), np.zeros((L, E))
        self.cross, self.cseen = np.zeros((L, E, E)), np.zeros((L, E))
        self.q = np.zeros((L, E))  # each layer's temporal forecast after its last committed step
        self.prev: list[tuple[int, ...]] = [()] * L  # each layer's last committed experts
        self.above: tuple[int, ...] = ()  # experts of the last committed step (any layer)
        moe = geometry.moe_layers
        self.next_layer = {l: moe[(i + 1) % len(moe)] for i, l in enumerate(moe)}
        super().__init__(geometry, capacity, profile)

    # forecasts -------------------------------------------------------------------------------
    def _mix(self, counts: np.ndarray, seen: np.ndarray, layer: int, experts) -> np.ndarray:
        idx = list(experts)
        if not idx:
            return self.freq[layer].copy()
        rows = counts[idx] + self.prior * self.freq[layer]  # (k, E)
        rows /= (seen[idx] + self.prior)[:, None]
        return rows.mean(axis=0)

    def forecast(self, layer: int, experts) -> np.ndarray:
        """Temporal forecast: expected routes of each expert at ``layer``'s next step after one
        that routed ``experts`` (a fresh (max_experts,) array; reads the statistics only)."""
        return self._mix(self.trans[layer], self.seen[layer], layer, experts)

    def forecast_below(self, layer: int, experts) -> np.ndarray:
        """Cross-layer forecast: expected routes of each expert at ``layer`` in a token whose
        previous MoE step routed ``experts``."""
        return self._mix(self.cross[layer], self.cseen[layer], layer, experts)

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
        cache = self.cache
        state, own = cache.state, self.q
        out = []
        for k in cache.owner[cache.pool_of[layer]]:
            if k is None or state[k[0]][k[1]] != RESIDENT or (k[0] == layer and k[1] in used):
                continue
            out.append((float(q[k[1]] if k[0] == layer else own[k[0], k[1]]), k))
        out.sort()
        return out[:need]

    def commit(self, d: Decision) -> None:
        self._take_slots(d)
        layer, experts = d.step.layer, d.step.experts
        keep, idx = 1.0 - 1.0 / self.memory, list(experts)
        f = self.freq[layer]
        f *= keep
        f[idx] += 1.0 / self.memory
        for counts, seen, before in ((self.trans[layer], self.seen[layer], self.prev[layer]),
                                     (self.cross[layer], self.cseen[layer], self.above)):
            if before:
                counts *= keep
                seen *= keep
                counts[np.ix_(list(before), idx)] += 1.0
                seen[list(before)] += 1.0
        self.prev[layer] = self.above = tuple(experts)
        self.q[layer] = self.forecast(layer, experts)

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
        margin, n = self.prefetch_margin, self.geometry.num_experts[nl]
        cands = [e for e in np.argsort(-r[:n], kind="stable").tolist() if (nl, e) not in cache.slot]
        free = cache.free_slots(nl, len(cands))
        moves = []
        for e, s in zip(cands, free):
            if r[e] < margin or len(moves) == self.max_prefetch:
                return tuple(moves)
            moves.append(Move(nl, e, s, None, float(r[e])))
        state, own = cache.state, self.q
        victims = sorted((float(r[k[1]] if k[0] == nl else own[k[0], k[1]]), k) for k in cache.owner[p]
                         if k is not None and state[k[0]][k[1]] == RESIDENT)
        for e, (vq, v) in zip(cands[len(free):], victims):
            gain = float(r[e]) - vq
            if gain < margin or len(moves) == self.max_prefetch:
                break
            moves.append(Move(nl, e, cache.slot[v], v, gain))
        return tuple(moves)
