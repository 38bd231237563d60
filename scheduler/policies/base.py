"""What every policy shares: cache ownership, completion, background commit, pre-population.

The protocol lives in ``core.Policy``; the call order is plan -> commit -> (backend runs the layer)
-> complete, and after each token plan_background -> commit_background -> ... -> complete.
``commit`` returns None.
"""
from __future__ import annotations

from ..cache import Cache
from ..core import Capacity, CapacityError, Decision, Geometry, Move
from ..profile import Profile

__all__ = ["BasePolicy", "MAX_FILLS_PER_TOKEN"]

MAX_FILLS_PER_TOKEN = 512


class BasePolicy:
    """Cache ownership, completion, background commit and pre-population shared by all."""

    name = "base"
    uploads_every_miss = False  # such policies need >= top_k slots per layer

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None):
        self.geometry = geometry
        self.capacity = capacity
        if self.uploads_every_miss:
            have = capacity.min_slots_per_layer(geometry)
            if have < geometry.top_k:
                raise CapacityError(
                    f"policy {self.name!r} uploads every miss before it runs and needs at least "
                    f"top_k={geometry.top_k} slots per MoE layer; this capacity gives {have}. "
                    f"Use a larger cache, or a policy that computes misses on the CPU (hybrid, static, cpu)."
                )
        self.cache = Cache(geometry, capacity)
        if profile is not None:
            self.prepopulate(profile)

    # protocol --------------------------------------------------------------------------------
    def plan_background(self) -> tuple[Move, ...]:
        return ()

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        cache = self.cache
        for m in moves:
            if m.victim is not None:
                cache.evict(m.victim)
                self._evicted(m.victim)
            key = (m.layer, m.expert)
            cache.reserve(key, m.slot)
            self._admitted(key)

    def complete(self, layer: int, expert: int) -> None:
        self.cache.complete((layer, expert))

    def residents(self) -> list[tuple[int, int]]:
        return self.cache.residents()

    def prepopulate(self, profile: Profile) -> list[tuple[int, int]]:
        """Make the hottest profiled experts resident, filling each pool's free slots in rank
        order. Returns the experts placed."""
        profile.check_geometry(self.geometry)
        placed = []
        cache = self.cache
        for layer, expert in profile.ranked:
            key = (layer, expert)
            p = cache.pool_of[layer]
            if p < 0 or not cache.free[p] or key in cache.slot:
                continue
            cache.place(key, cache.free[p][-1])
            self._admitted(key)
            placed.append(key)
        return placed

    def _take_slots(self, d: Decision) -> None:
        """Commit a decision's uploads: the first go into free slots, each of the rest into the
        slot of the eviction paired with it (``d.slots`` lists them in that order)."""
        cache = self.cache
        layer = d.step.layer
        n_free = len(d.uploads) - len(d.evictions)
        for i, e in enumerate(d.uploads):
            if i < n_free:
                cache.reserve((layer, e), d.slots[i])
            else:
                v = d.evictions[i - n_free]
                cache.replace(v, (layer, e))
                self._evicted(v)

    # hooks for eviction order ------------------------------------------------------------------
    def _admitted(self, key: tuple[int, int]) -> None:
        pass

    def _evicted(self, key: tuple[int, int]) -> None:
        pass
