"""The scheduler's interface: what a step asks, what a policy decides, and the Policy protocol.

Experts are named ``(layer, expert)``. A *step* is one batch at one MoE layer (one token in
decode, n tokens in prefill or speculative verification). All of a step's experts are needed at
once: the hits are the experts resident when the step starts, and no eviction made for the step
removes an expert the step uses.

A policy answers a step with a :class:`Decision`. Planning (``plan``) has no side effects;
``commit`` changes residency. Uploads occupy their slot at commit but become resident only when
their completion is passed back (``complete``). After each token a policy may schedule background
work (``plan_background`` / ``commit_background``): fills into free slots and swaps.

Time never appears here: backends pass completions back, the scheduler never reads a clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol, Sequence

__all__ = [
    "Geometry",
    "Capacity",
    "Step",
    "Decision",
    "Move",
    "Token",
    "Policy",
    "CapacityError",
    "pad_slot_bytes",
    "SLOT_ALIGN_BYTES",
]

SLOT_ALIGN_BYTES = 256


def pad_slot_bytes(num_bytes: int) -> int:
    """Bytes one cache slot takes for an expert of ``num_bytes`` (padded to 256 bytes)."""
    return -(-int(num_bytes) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


class CapacityError(ValueError):
    """A capacity that a policy cannot work with (e.g. fewer slots than top-k for ``lru``)."""


@dataclass(frozen=True)
class Geometry:
    """Shape of a model's MoE part.

    Invariants: ``len(num_experts) == len(expert_bytes) == num_layers``; a dense layer has
    0 experts and 0 bytes; ``1 <= top_k <= num_experts[l]`` on every MoE layer.
    """

    num_experts: tuple[int, ...]  # per layer; 0 = dense layer
    top_k: int
    expert_bytes: tuple[int, ...]  # bytes of one expert's weights, per layer

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_experts", tuple(int(n) for n in self.num_experts))
        object.__setattr__(self, "expert_bytes", tuple(int(b) for b in self.expert_bytes))
        if len(self.num_experts) == 0:
            raise ValueError("Geometry.num_experts: need at least one layer")
        if len(self.expert_bytes) != len(self.num_experts):
            raise ValueError(
                f"Geometry.expert_bytes: {len(self.expert_bytes)} entries, expected one per layer "
                f"({len(self.num_experts)})"
            )
        if self.top_k < 1:
            raise ValueError(f"Geometry.top_k: {self.top_k}, expected >= 1")
        for layer, (n, b) in enumerate(zip(self.num_experts, self.expert_bytes)):
            if n < 0 or n > 65535:
                raise ValueError(f"Geometry.num_experts[{layer}]: {n}, expected 0..65535")
            if n and n < self.top_k:
                raise ValueError(f"Geometry.num_experts[{layer}]: {n} < top_k {self.top_k}")
            if b < 0 or (n and b == 0):
                raise ValueError(f"Geometry.expert_bytes[{layer}]: {b}, expected > 0 on a MoE layer")
        if not any(self.num_experts):
            raise ValueError("Geometry.num_experts: no MoE layer (all zero)")

    @classmethod
    def uniform(cls, num_layers: int, num_experts: int, top_k: int, expert_bytes: int = 1) -> "Geometry":
        """Every layer a MoE layer with the same expert count and size."""
        return cls((num_experts,) * num_layers, top_k, (expert_bytes,) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.num_experts)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(l for l, n in enumerate(self.num_experts) if n)

    @property
    def max_experts(self) -> int:
        return max(self.num_experts)

    @property
    def total_expert_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.num_experts, self.expert_bytes))


@dataclass(frozen=True)
class Capacity:
    """GPU expert-cache slots, as pools of layers.

    Each pool is ``(layers, num_slots)``: the layers share one set of slots (upstream shares one
    LRU per layer group; the default is one pool per MoE layer). A layer belongs to at most one
    pool; a layer in no pool has no cache.
    """

    pools: tuple[tuple[tuple[int, ...], int], ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        pools = []
        for i, (layers, slots) in enumerate(self.pools):
            layers = tuple(int(l) for l in layers)
            if int(slots) < 0:
                raise ValueError(f"Capacity.pools[{i}]: {slots} slots, expected >= 0")
            if not layers:
                raise ValueError(f"Capacity.pools[{i}]: no layers")
            dup = seen.intersection(layers)
            if dup:
                raise ValueError(f"Capacity.pools[{i}]: layer(s) {sorted(dup)} already in another pool")
            seen.update(layers)
            pools.append((layers, int(slots)))
        object.__setattr__(self, "pools", tuple(pools))

    @classmethod
    def per_layer(cls, geometry: Geometry, slots: int | Sequence[int]) -> "Capacity":
        """``slots`` per MoE layer (an int for all, or one per layer), one pool each."""
        moe = geometry.moe_layers
        if isinstance(slots, int):
            per = [slots] * geometry.num_layers
        else:
            per = list(slots)
            if len(per) != geometry.num_layers:
                raise ValueError(f"Capacity slots: {len(per)} entries, expected {geometry.num_layers}")
        return cls(tuple(((l,), min(int(per[l]), geometry.num_experts[l])) for l in moe))

    @classmethod
    def from_mib(cls, geometry: Geometry, budget_mib: float) -> "Capacity":
        """The largest n slots per MoE layer whose padded sizes fit in ``budget_mib`` MiB."""
        if budget_mib < 0:
            raise ValueError(f"Capacity budget_mib: {budget_mib}, expected >= 0")
        per_slot_row = sum(pad_slot_bytes(geometry.expert_bytes[l]) for l in geometry.moe_layers)
        n = int(budget_mib * 1024 * 1024) // per_slot_row
        return cls.per_layer(geometry, min(n, geometry.max_experts))

    @classmethod
    def shared(cls, geometry: Geometry, groups: Sequence[Sequence[int]], slots: Sequence[int]) -> "Capacity":
        """One pool per group of layers (all layers of a group must have equal expert sizes)."""
        if len(groups) != len(slots):
            raise ValueError("Capacity.shared: one slot count per group expected")
        for g in groups:
            sizes = {geometry.expert_bytes[l] for l in g}
            if len(sizes) > 1:
                raise ValueError(f"Capacity.shared: layers {list(g)} have different expert sizes {sorted(sizes)}")
        return cls(tuple((tuple(g), int(s)) for g, s in zip(groups, slots)))

    def pool_of_layer(self, num_layers: int) -> list[int]:
        """Pool index of each layer, -1 where the layer has no cache."""
        out = [-1] * num_layers
        for i, (layers, _) in enumerate(self.pools):
            for l in layers:
                if l >= num_layers:
                    raise ValueError(f"Capacity: layer {l} out of range for {num_layers} layers")
                out[l] = i
        return out

    def slot_bytes(self, geometry: Geometry) -> int:
        """Device bytes the cache occupies (padded slots)."""
        return sum(n * pad_slot_bytes(geometry.expert_bytes[layers[0]]) for layers, n in self.pools)

    def min_slots_per_layer(self, geometry: Geometry) -> int:
        """Fewest slots any MoE layer can use (0 when a MoE layer has no pool)."""
        pool = self.pool_of_layer(geometry.num_layers)
        return min((self.pools[pool[l]][1] if pool[l] >= 0 else 0) for l in geometry.moe_layers)


@dataclass(frozen=True, slots=True)
class Step:
    """One batch at one MoE layer.

    ``experts`` are distinct, in router-rank order of first appearance. ``counts[i]`` is the
    number of the batch's tokens routed to ``experts[i]`` (None: one each, as in decode).
    ``weights[i]`` is the summed router weight when known.
    """

    layer: int
    experts: tuple[int, ...]
    counts: tuple[int, ...] | None = None
    weights: tuple[float, ...] | None = None

    def count(self, i: int) -> int:
        return 1 if self.counts is None else self.counts[i]


@dataclass(frozen=True, slots=True)
class Token:
    """One trace row's worth of steps (a token position, or one batch of positions)."""

    index: int  # position in the replay, 0-based
    seq: int  # sequence id
    pos: int  # position in its sequence
    phase: str  # "prefill" or "decode"
    steps: Iterable[Step]  # a tuple in replay; may be a generator when routing is live
    num_tokens: int = 1


class Decision(NamedTuple):
    """A policy's answer to one step (immutable; a NamedTuple because one is built per
    layer-step, where a frozen dataclass costs twice as much to construct).

    Every expert of the step appears exactly once in ``hits + uploads + streams + cpu``.
    ``uploads[i]`` goes into slot ``slots[i]`` of the layer's pool and is resident once its
    completion is passed back; ``streams`` are uploaded to a scratch buffer, run, and dropped.
    ``evictions`` are ``(layer, expert)`` pairs removed before the step to make room; none is used
    by the step. After the step has run, ``retired`` residents leave and each streamed expert in
    ``promotions`` is kept, copied on the device from scratch into ``promotion_slots[i]``.
    """

    step: Step
    hits: tuple[int, ...]
    uploads: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    streams: tuple[int, ...] = ()
    cpu: tuple[int, ...] = ()
    evictions: tuple[tuple[int, int], ...] = ()
    promotions: tuple[int, ...] = ()
    promotion_slots: tuple[int, ...] = ()
    retired: tuple[tuple[int, int], ...] = ()

    @property
    def layer(self) -> int:
        return self.step.layer


class Move(NamedTuple):
    """Background upload of ``(layer, expert)`` into ``slot``: a fill when ``victim`` is None,
    else a swap that evicts ``victim`` at commit. ``gain`` is what ranked it."""

    layer: int
    expert: int
    slot: int
    victim: tuple[int, int] | None = None
    gain: float = 0.0


class Policy(Protocol):
    """What every policy provides; see the module docstring for the call order."""

    name: str
    geometry: Geometry
    capacity: Capacity

    def plan(self, step: Step) -> Decision: ...

    def commit(self, decision: Decision) -> None: ...

    def plan_background(self) -> tuple[Move, ...]: ...

    def commit_background(self, moves: tuple[Move, ...]) -> None: ...

    def complete(self, layer: int, expert: int) -> None: ...

    def residents(self) -> list[tuple[int, int]]: ...
