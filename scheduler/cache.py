"""Slot bookkeeping for a GPU expert cache: which expert sits in which slot of which pool.

Invariants (checked by ``check``): a slot holds at most one expert; an expert holds at most one
slot; occupied + free slots == the pool's size; an expert is *resident* only when it holds a slot
and is not in flight. Policies own the order in which they evict; this class owns the slots.
"""
from __future__ import annotations

import numpy as np

from .core import Capacity, Geometry

__all__ = ["Cache", "ABSENT", "INFLIGHT", "RESIDENT"]


ABSENT, INFLIGHT, RESIDENT = 0, 1, 2


class Cache:
    """Slots of every pool; ``(layer, expert)`` keys.

    ``state[layer][expert]`` is ABSENT, INFLIGHT or RESIDENT (a bytearray per layer, fast to
    read from Python); ``resident_mask`` / ``inflight_mask`` are numpy views for vector work.
    """

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
        width = max(geometry.max_experts, 1)
        self._buf = bytearray(geometry.num_layers * width)
        self._view = np.frombuffer(self._buf, dtype=np.uint8).reshape(geometry.num_layers, width)
        self.state = [memoryview(self._buf)[l * width:(l + 1) * width] for l in range(geometry.num_layers)]

    @property
    def resident_mask(self) -> np.ndarray:
        """(layers, max_experts) bool: resident and not in flight (a fresh array)."""
        return self._view == RESIDENT

    def resident_row(self, layer: int) -> np.ndarray:
        """(max_experts,) bool for one layer: resident and not in flight (a fresh array)."""
        return self._view[layer] == RESIDENT

    @property
    def inflight_mask(self) -> np.ndarray:
        return self._view == INFLIGHT

    @property
    def occupied_mask(self) -> np.ndarray:
        """Resident or in flight."""
        return self._view != ABSENT

    # queries -------------------------------------------------------------------------------
    def is_resident(self, key: tuple[int, int]) -> bool:
        return self.state[key[0]][key[1]] == RESIDENT

    def num_free(self, layer: int) -> int:
        p = self.pool_of[layer]
        return len(self.free[p]) if p >= 0 else 0

    def pool_size(self, layer: int) -> int:
        p = self.pool_of[layer]
        return self.size[p] if p >= 0 else 0

    def free_slots(self, layer: int, n: int) -> list[int]:
        """The ``n`` slots ``reserve`` would take next, without taking them."""
        p = self.pool_of[layer]
        if p < 0 or n <= 0:
            return []
        free = self.free[p]
        return free[: -n - 1: -1] if n < len(free) else free[::-1]

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
        self.state[key[0]][key[1]] = INFLIGHT

    def complete(self, key: tuple[int, int]) -> None:
        """The copy of ``key`` has finished: it becomes resident."""
        try:
            self.inflight.remove(key)
        except KeyError:
            raise ValueError(f"completion for {key}, which is not in flight") from None
        self.state[key[0]][key[1]] = RESIDENT

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
        self.state[key[0]][key[1]] = ABSENT
        return slot

    def replace(self, old: tuple[int, int], new: tuple[int, int]) -> int:
        """Evict resident ``old`` and put ``new`` in flight into its slot (one step of both)."""
        p = self.pool_of[old[0]]
        if self.pool_of[new[0]] != p:
            raise ValueError(f"replace: {old} and {new} are in different pools")
        if self.state[old[0]][old[1]] != RESIDENT:
            raise ValueError(f"cannot evict {old}: it is not resident")
        if new in self.slot:
            raise ValueError(f"expert {new} already holds slot {self.slot[new]}")
        slot = self.slot.pop(old)
        self.state[old[0]][old[1]] = ABSENT
        self.owner[p][slot] = new
        self.slot[new] = slot
        self.inflight.add(new)
        self.state[new[0]][new[1]] = INFLIGHT
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
            want = INFLIGHT if key in self.inflight else RESIDENT
            assert self.state[key[0]][key[1]] == want, f"{key}: state disagrees"
        assert self.inflight <= self.slot.keys()
        assert int((self._view != ABSENT).sum()) == len(self.slot)
