"""``belady``: the optimal offline cache with bypass, given every step in replay order."""
from __future__ import annotations

from array import array
from typing import Iterable

import numpy as np

from ..core import Capacity, Decision, Geometry, Step
from ..profile import Profile
from .base import BasePolicy

__all__ = ["BeladyPolicy"]


class BeladyPolicy(BasePolicy):
    """Optimal offline cache with bypass, given every step in replay order.

    The future is read once into flat arrays (each step's layer, experts and, per expert, the
    step of its next use), a few bytes per routed expert rather than objects per step.

    After each step the pool keeps the experts (its residents and this step's misses) whose next
    use comes soonest; a miss not kept is streamed (bypass). Before the step, misses take free
    slots and the slots of residents the step does not use; where the best choice is to drop an
    expert the step itself uses, that expert is retired after the step and the miss, streamed,
    is promoted into its slot. Ties keep residents, then lower (layer, expert).
    """

    name = "belady"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 future: Iterable[Step] = ()):
        super().__init__(geometry, capacity, profile)
        layers, experts, counts = array("l"), array("l"), array("l")
        for st in future:  # read once: the steps are not kept
            layers.append(st.layer)
            counts.append(len(st.experts))
            experts.extend(st.experts)
        if not layers:
            raise ValueError("policy 'belady' needs the whole trace (future=steps in replay order)")
        n = len(layers)
        self.inf = inf = n + 1
        index = np.int32 if inf < 2**31 else np.int64
        self.layers = np.array(layers, index)
        self.start = np.zeros(n + 1, np.int64)  # step i's experts: experts[start[i]:start[i + 1]]
        np.cumsum(np.array(counts, np.int64), out=self.start[1:])
        del counts
        top = max(experts, default=0)
        self.experts = np.array(experts, np.uint16 if top < 2**16 else np.int64)
        del experts
        self.next_use = np.full(len(self.experts), inf, index)  # aligned with experts: the step of its next use
        first: dict[tuple[int, int], int] = {}
        for layer in np.unique(self.layers).tolist():
            self._index_layer(layer, first)
        self.nu: dict[tuple[int, int], int] = {k: first.get(k, inf) for k in self.cache.slot}
        self.pos = 0

    def _index_layer(self, layer: int, first: dict) -> None:
        """``next_use`` of the entries of the steps at ``layer``, and each expert's first use
        into ``first``; memory of the order of this layer's entries only."""
        steps = np.flatnonzero(self.layers == layer)
        lo, c = self.start[steps], self.start[steps + 1] - self.start[steps]
        within = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
        entry = np.repeat(lo, c) + within  # indices into experts, in step order
        step = np.repeat(steps, c)
        order = np.argsort(self.experts[entry], kind="stable")  # by expert, then by step
        ex = self.experts[entry[order]]
        same = ex[1:] == ex[:-1]  # an expert appears once per step: the next in the group is its next use
        self.next_use[entry[order[:-1][same]]] = step[order[1:][same]]
        heads = np.flatnonzero(np.concatenate(([True], ~same)))
        first.update(((layer, e), s) for e, s in zip(ex[heads].tolist(), step[order[heads]].tolist()))

    def plan(self, step: Step) -> Decision:
        i = self.pos
        if i >= len(self.layers) or self.layers[i] != step.layer or self._experts(i) != step.experts:
            raise ValueError(f"belady: step {i} differs from the trace it was given")
        layer = step.layer
        cache = self.cache
        nxt = self._next(i)
        hits = tuple(e for e in step.experts if cache.is_resident((layer, e)))
        misses = [e for e in step.experts if not cache.is_resident((layer, e))]
        p = cache.pool_of[layer]
        if not misses:
            return Decision(step, hits)
        if p < 0 or cache.size[p] == 0:
            return Decision(step, hits, streams=tuple(misses))
        inf = self.inf
        # every candidate for the pool after this step, with its next use
        cand = [(nxt[e] if k[0] == layer and e in nxt else self.nu[k], 0, k)
                for k in cache.owner[p] if k is not None for e in (k[1],)]
        cand += [(nxt[e], 1, (layer, e)) for e in misses]
        cand.sort()
        keep = {k for n, kind, k in cand[: cache.size[p]] if n < inf or kind == 0}
        admit = [e for e in misses if (layer, e) in keep]
        if not admit:
            return Decision(step, hits, streams=tuple(misses))
        used = set(step.experts)
        leaving = [k for n, kind, k in reversed(cand) if kind == 0 and k not in keep]
        before = [k for k in leaving if not (k[0] == layer and k[1] in used)]
        after = [k for k in leaving if k[0] == layer and k[1] in used]
        slots = cache.free_slots(layer, len(admit))
        evictions = before[: len(admit) - len(slots)]
        slots += [cache.slot[k] for k in evictions]
        uploads, promos = admit[: len(slots)], admit[len(slots):]
        retired = after[: len(promos)]
        promos = promos[: len(retired)]
        kept = set(uploads)
        return Decision(step, hits, uploads=tuple(uploads), slots=tuple(slots),
                        streams=tuple(e for e in misses if e not in kept), evictions=tuple(evictions),
                        promotions=tuple(promos), promotion_slots=tuple(cache.slot[k] for k in retired),
                        retired=tuple(retired))

    def commit(self, d: Decision) -> None:
        nxt = self._next(self.pos)
        cache = self.cache
        layer = d.step.layer
        for v in d.evictions + d.retired:
            cache.evict(v)
            self.nu.pop(v, None)
        for e, s in zip(d.uploads + d.promotions, d.slots + d.promotion_slots):
            cache.reserve((layer, e), s)
        for e in d.step.experts:
            if (layer, e) in cache.slot:
                self.nu[(layer, e)] = nxt[e]
        self.pos += 1

    def _experts(self, i: int) -> tuple[int, ...]:
        return tuple(self.experts[self.start[i]:self.start[i + 1]].tolist())

    def _next(self, i: int) -> dict[int, int]:
        """Step ``i``'s experts -> the step of their next use (``inf``: none)."""
        a, b = self.start[i], self.start[i + 1]
        return dict(zip(self.experts[a:b].tolist(), self.next_use[a:b].tolist()))
