"""The simple policies: ``cpu``, ``gpu``, ``lru``, ``freq-lru`` and ``static``.

``lru`` and ``freq-lru`` upload every miss before the step runs (they need at least top_k slots
per MoE layer); ``cpu``, ``gpu`` and ``static`` never upload on demand.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..cache import RESIDENT
from ..core import Capacity, CapacityError, Decision, Geometry, Step
from ..profile import Profile
from .base import BasePolicy

__all__ = ["CpuPolicy", "GpuPolicy", "LruPolicy", "FreqLruConfig", "FreqLruPolicy", "StaticPolicy"]


class CpuPolicy(BasePolicy):
    """Every expert computed on the CPU from host RAM (upstream ``--cpu-moe``)."""

    name = "cpu"

    def plan(self, step: Step) -> Decision:
        return Decision(step, (), cpu=step.experts)

    def commit(self, decision: Decision) -> None:
        pass


class GpuPolicy(BasePolicy):
    """Every expert resident from the start (the model fits): all hits."""

    name = "gpu"

    def __init__(self, geometry: Geometry, capacity: Capacity | None = None, profile: Profile | None = None):
        full = Capacity.per_layer(geometry, geometry.num_experts)
        if capacity is not None and capacity.min_slots_per_layer(geometry) < geometry.max_experts:
            short = [l for l in geometry.moe_layers
                     if capacity.pools[capacity.pool_of_layer(geometry.num_layers)[l]][1] < geometry.num_experts[l]]
            raise CapacityError(f"policy 'gpu' needs every expert resident; layers {short[:8]} have fewer slots than experts")
        super().__init__(geometry, full)
        for l in geometry.moe_layers:
            for e in range(geometry.num_experts[l]):
                self.cache.place((l, e), self.cache.free[self.cache.pool_of[l]][-1])

    def plan(self, step: Step) -> Decision:
        return Decision(step, step.experts)

    def commit(self, decision: Decision) -> None:
        pass


class _UploadEveryMiss(BasePolicy):
    """Shared plan/commit for caches that upload every miss before it runs.

    Misses take free slots first, then victims chosen by ``_victims``; if a multi-token step
    has more distinct misses than its pool can hold, the rest are streamed (upstream's large
    batches read the cache without filling it).
    """

    uploads_every_miss = True

    def plan(self, step: Step) -> Decision:
        layer = step.layer
        cache = self.cache
        state = cache.state[layer]
        experts = step.experts
        misses = [e for e in experts if state[e] != RESIDENT]
        if not misses:
            return Decision(step, experts)
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        slots = cache.free_slots(layer, len(misses))
        need = len(misses) - len(slots)
        if need <= 0:
            return Decision(step, hits, tuple(misses), tuple(slots))
        evictions = self._victims(layer, need, experts)
        slot_of = cache.slot
        slots += [slot_of[v] for v in evictions]
        n_up = len(slots)
        return Decision(step, hits, tuple(misses[:n_up]), tuple(slots), tuple(misses[n_up:]), (), tuple(evictions))

    def commit(self, d: Decision) -> None:
        if d.uploads:
            self._take_slots(d)
        self._touch(d.step.layer, d)

    def _victims(self, layer: int, need: int, used) -> list[tuple[int, int]]:
        """``need`` residents of the layer's pool to evict, none of them in ``used`` (this
        step's experts of ``layer``)."""
        raise NotImplementedError  # each subclass defines its eviction order

    def _touch(self, layer: int, d: Decision) -> None:
        raise NotImplementedError


class LruPolicy(_UploadEveryMiss):
    """Upstream's cache: every miss uploaded, least-recently-used resident evicted.

    One LRU order per pool; a step's experts become most recent together (in router-rank order).
    The orders' keys are ``layer * width + expert`` (ints hash and compare faster than pairs).
    """

    name = "lru"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None):
        self.order: list[OrderedDict] = [OrderedDict() for _ in capacity.pools]
        self.width = max(geometry.max_experts, 1)
        super().__init__(geometry, capacity, profile)

    def _admitted(self, key):
        self.order[self.cache.pool_of[key[0]]][key[0] * self.width + key[1]] = None

    def _evicted(self, key):
        del self.order[self.cache.pool_of[key[0]]][key[0] * self.width + key[1]]

    def _victims(self, layer, need, used):
        out = []
        state, width = self.cache.state, self.width
        for k in self.order[self.cache.pool_of[layer]]:
            key = divmod(k, width)
            if (key[0] == layer and key[1] in used) or state[key[0]][key[1]] != RESIDENT:
                continue
            out.append(key)
            if len(out) == need:
                break
        return out

    def _touch(self, layer, d):
        order = self.order[self.cache.pool_of[layer]]
        to_end = order.move_to_end
        base = layer * self.width
        if not d.uploads:
            for e in d.hits:
                to_end(base + e)
            return
        for e in d.step.experts:
            k = base + e
            if k in order:
                to_end(k)
            elif e in d.uploads:
                order[k] = None


@dataclass(frozen=True)
class FreqLruConfig:
    """``freq-lru``'s knob: frequencies halve every ``halve_every`` steps of their layer (>= 1)."""

    halve_every: int = 16

    def __post_init__(self) -> None:
        if not self.halve_every >= 1:
            raise ValueError(f"freq-lru halve_every: {self.halve_every}, expected >= 1")


class FreqLruPolicy(_UploadEveryMiss):
    """Evict the resident with the lowest routing frequency, least recent first on ties.

    Frequencies count routes per (layer, expert) and halve every ``halve_every`` steps of that layer.
    """

    name = "freq-lru"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None,
                 config: FreqLruConfig = FreqLruConfig()):
        self.config = config
        self.halve_every = config.halve_every
        self.freq = np.zeros((geometry.num_layers, max(geometry.max_experts, 1)))
        self.last = np.zeros_like(self.freq)  # last use, in steps of the whole replay
        self.layer_steps = [0] * geometry.num_layers
        self.clock = 0
        super().__init__(geometry, capacity, profile)

    def _victims(self, layer, need, used):
        cache = self.cache
        p = cache.pool_of[layer]
        cands = [k for k in cache.owner[p] if k is not None and k not in cache.inflight
                 and not (k[0] == layer and k[1] in used)]
        cands.sort(key=lambda k: (self.freq[k], self.last[k], k))
        return cands[:need]

    def _touch(self, layer, d):
        self.clock += 1
        for e in d.hits + d.uploads + d.streams:
            self.freq[layer, e] += 1
            self.last[layer, e] = self.clock
        self.layer_steps[layer] += 1
        if self.layer_steps[layer] % self.halve_every == 0:
            self.freq[layer] *= 0.5


class StaticPolicy(BasePolicy):
    """Residents fixed from a profile; misses computed on the CPU; nothing is ever uploaded."""

    name = "static"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None):
        if profile is None:
            raise ValueError("policy 'static' needs a profile (Profile.from_counts or an STRP file)")
        super().__init__(geometry, capacity, profile)

    def plan(self, step: Step) -> Decision:
        state = self.cache.state[step.layer]
        hits = tuple(e for e in step.experts if state[e] == RESIDENT)
        if len(hits) == len(step.experts):
            return Decision(step, hits)
        return Decision(step, hits, cpu=tuple(e for e in step.experts if state[e] != RESIDENT))

    def commit(self, decision: Decision) -> None:
        pass
