"""``belady``: the optimal offline cache with bypass, given every step in replay order."""
from __future__ import annotations

from typing import Sequence

from ..core import Capacity, Decision, Geometry, Step
from ..profile import Profile
from .base import BasePolicy

__all__ = ["BeladyPolicy"]


class BeladyPolicy(BasePolicy):
    """Optimal offline cache with bypass, given every step in replay order.

    After each step the pool keeps the experts (its residents and this step's misses) whose next
    use comes soonest; a miss not kept is streamed (bypass). Before the step, misses take free
    slots and the slots of residents the step does not use; where the best choice is to drop an
    expert the step itself uses, that expert is retired after the step and the miss, streamed,
    is promoted into its slot. Ties keep residents, then lower (layer, expert).
    """

    name = "belady"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 future: Sequence[Step] = ()):
        super().__init__(geometry, capacity, profile)
        self.future = list(future)
        if not self.future:
            raise ValueError("policy 'belady' needs the whole trace (future=steps in replay order)")
        self.inf = inf = len(self.future) + 1
        last: dict[tuple[int, int], int] = {}
        self.next_use: list[tuple[int, ...]] = [()] * len(self.future)
        for i in range(len(self.future) - 1, -1, -1):
            st = self.future[i]
            self.next_use[i] = tuple(last.get((st.layer, e), inf) for e in st.experts)
            for e in st.experts:
                last[(st.layer, e)] = i
        self.nu: dict[tuple[int, int], int] = {k: last.get(k, inf) for k in self.cache.slot}
        self.pos = 0

    def plan(self, step: Step) -> Decision:
        i = self.pos
        if i >= len(self.future) or self.future[i].layer != step.layer or self.future[i].experts != step.experts:
            raise ValueError(f"belady: step {i} differs from the trace it was given")
        layer = step.layer
        cache = self.cache
        nxt = dict(zip(step.experts, self.next_use[i]))
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
        nxt = dict(zip(d.step.experts, self.next_use[self.pos]))
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
