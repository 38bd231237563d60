"""Slot bookkeeping for a GPU expert cache: which expert sits in which slot of which pool.

Invariants (checked by ``check``): a slot holds at most one expert; an expert holds at most one
slot; occupied + free slots == the pool's size; an expert is *resident* only when it holds a slot
and is not in flight. Policies own the order in which they evict; this class owns the slots.
"""
from __future__ import annotations

import numpy as np

from .core import Capacity, Geometry

__all__ = ["Cache"]


class Cache:
    """Slots of every pool; ``(layer, expert)`` keys."""

    def __init__(self, geometry: Geometry, capacity: Capacity):
        self.geometry = geometry
        self.capacity = capacity
        self.pool_of = capacity.pool_of_layer(geometry.num_layers)
        self.size = [n for _, n in capacity.pools]
        # free slots as a stack: pop() gives the lowest free slot index first
        self.free: list[list[int]] = [list(range(n - 1, -1, -1)) for n in self.size]
        self.owner: list[list[tuple[int, int] | None]] = [[None] * n for n in self.size]
        self.slot: dict[tuple[int, int], int] = {}
        self.inflight: set[tuple[int, int]] = set()
        shape = (geometry.num_layers, max(geometry.max_experts, 1))
        self.resident_mask = np.zeros(shape, dtype=bool)  # resident (not in flight)
        self.inflight_mask = np.zeros(shape, dtype=bool)

    # queries -------------------------------------------------------------------------------
    def is_resident(self, key: tuple[int, int]) -> bool:
        return key in self.slot and key not in self.inflight

    def num_free(self, layer: int) -> int:
        p = self.pool_of[layer]
        return len(self.free[p]) if p >= 0 else 0

    def pool_size(self, layer: int) -> int:
        p = self.pool_of[layer]
        return self.size[p] if p >= 0 else 0

    def free_slots(self, layer: int, n: int) -> list[int]:
        """The ``n`` slots ``reserve`` would take next, without taking them."""
        p = self.pool_of[layer]
        return self.free[p][::-1][:n] if p >= 0 else []

    def residents(self) -> list[tuple[int, int]]:
        return sorted(k for k in self.slot if k not in self.inflight)

    # changes -------------------------------------------------------------------------------
    def reserve(self, key: tuple[int, int], slot: int) -> None:
        """Put ``key`` in flight into free ``slot`` of its layer's pool."""
        p = self.pool_of[key[0]]
        if p < 0:
            raise ValueError(f"layer {key[0]} has no cache pool")
        if key in self.slot:
            raise ValueError(f"expert {key} already holds slot {self.slot[key]}")
        free = self.free[p]
        if free and free[-1] == slot:
            free.pop()
        else:
            try:
                free.remove(slot)
            except ValueError:
                raise ValueError(f"slot {slot} of pool {p} is not free (held by {self.owner[p][slot]})") from None
        self.owner[p][slot] = key
        self.slot[key] = slot
        self.inflight.add(key)
        self.inflight_mask[key] = True

    def complete(self, key: tuple[int, int]) -> None:
        """The copy of ``key`` has finished: it becomes resident."""
        if key not in self.inflight:
            raise ValueError(f"completion for {key}, which is not in flight")
        self.inflight.discard(key)
        self.inflight_mask[key] = False
        self.resident_mask[key] = True

    def place(self, key: tuple[int, int], slot: int) -> None:
        """Reserve and complete at once (pre-population)."""
        self.reserve(key, slot)
        self.complete(key)

    def evict(self, key: tuple[int, int]) -> int:
        """Remove resident ``key``; returns the freed slot."""
        if key in self.inflight:
            raise ValueError(f"cannot evict {key}: its copy is in flight")
        slot = self.slot.pop(key)
        p = self.pool_of[key[0]]
        self.owner[p][slot] = None
        self.free[p].append(slot)
        self.resident_mask[key] = False
        return slot

    def check(self) -> None:
        """Assert every invariant in the module docstring."""
        for p, owners in enumerate(self.owner):
            held = [k for k in owners if k is not None]
            assert len(held) == len(set(held)), f"pool {p}: an expert holds two slots"
            assert len(held) + len(self.free[p]) == self.size[p], f"pool {p}: slots lost"
            assert len(set(self.free[p])) == len(self.free[p]), f"pool {p}: free slot listed twice"
            for s in self.free[p]:
                assert owners[s] is None, f"pool {p}: free slot {s} is occupied"
        for key, slot in self.slot.items():
            assert self.owner[self.pool_of[key[0]]][slot] == key, f"{key}: slot map disagrees"
            assert self.resident_mask[key] == (key not in self.inflight)
        assert self.inflight <= self.slot.keys()
        assert int(self.resident_mask.sum()) == len(self.slot) - len(self.inflight)
