"""The policies, picked by name from ``POLICIES``.

Each is a plain class over a :class:`~scheduler.cache.Cache`. The shared protocol lives in
``core.Policy``; the call order is plan -> commit -> (backend runs the layer) -> complete, and
after each token plan_background -> commit_background -> ... -> complete.

Choice of which misses go over PCIe in ``hybrid`` (documented contract): a step's distinct misses
are ranked by token count (more first), then decayed usage (higher first), then router rank;
the first ``round(n_miss * frac / 256)`` (half rounds up) that are not in flight go over PCIe,
the rest to the CPU. With the default 44/256 a step with 1 or 2 misses sends none over PCIe and
one with 3 to 8 sends one, so on a top-1 or top-2 model no miss ever does. ``rounding="carry"``
keeps the fraction on average instead: per layer, the remainder (in 1/256ths) of each step's
``n_miss * frac`` is carried to the layer's next step, which sends ``(n_miss * frac + carry) //
256``; the carry is updated at commit, from the step's distinct misses. A PCIe miss is admitted into a free slot when its pool has one; else (with
``admit_uploads``, the default) into the slot of the layer's coldest resident that the step does
not use (by a usage ranking refreshed every ``swap_every`` tokens), when the miss is at least as
used; otherwise it is streamed through a scratch buffer. Misses in flight (a background copy not
yet complete) always go to the CPU: nothing is uploaded twice.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence

import numpy as np

from ..cache import INFLIGHT, RESIDENT, Cache
from ..core import Capacity, CapacityError, Decision, Geometry, Move, Step
from ..costmodel import CostModel
from ..profile import Profile

__all__ = [
    "POLICIES",
    "make_policy",
    "CpuPolicy",
    "GpuPolicy",
    "LruPolicy",
    "FreqLruPolicy",
    "StaticPolicy",
    "HybridPolicy",
    "HybridCostPolicy",
    "BeladyPolicy",
    "PredictPolicy",
    "MAX_FILLS_PER_TOKEN",
]

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
    """

    name = "lru"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None):
        self.order: list[OrderedDict] = [OrderedDict() for _ in capacity.pools]
        super().__init__(geometry, capacity, profile)

    def _admitted(self, key):
        self.order[self.cache.pool_of[key[0]]][key] = None

    def _evicted(self, key):
        del self.order[self.cache.pool_of[key[0]]][key]

    def _victims(self, layer, need, used):
        out = []
        state = self.cache.state
        for key in self.order[self.cache.pool_of[layer]]:
            if (key[0] == layer and key[1] in used) or state[key[0]][key[1]] != RESIDENT:
                continue
            out.append(key)
            if len(out) == need:
                break
        return out

    def _touch(self, layer, d):
        order = self.order[self.cache.pool_of[layer]]
        to_end = order.move_to_end
        if not d.uploads:
            for e in d.hits:
                to_end((layer, e))
            return
        for e in d.step.experts:
            key = (layer, e)
            if key in order:
                to_end(key)
            elif e in d.uploads:
                order[key] = None


class FreqLruPolicy(_UploadEveryMiss):
    """Evict the resident with the lowest routing frequency, least recent first on ties.

    Frequencies count routes per (layer, expert) and halve every ``halve_every`` steps of that layer.
    """

    name = "freq-lru"

    def __init__(self, geometry, capacity, profile=None, halve_every: int = 16):
        if halve_every < 1:
            raise ValueError(f"freq-lru halve_every: {halve_every}, expected >= 1")
        self.halve_every = halve_every
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

    def __init__(self, geometry, capacity, profile: Profile | None = None):
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


class HybridPolicy(BasePolicy):
    """Hits on the GPU; a layer's distinct misses split between PCIe and the CPU pool.

    ``miss_frac_256``/256 of the distinct misses go over PCIe (see the module docstring for
    which). After each token, the experts that missed are filled into free slots, ranked across
    layers by decayed usage, at most ``max_fills`` per token. Every ``swap_every`` tokens a swap
    round runs (skipped while earlier background copies are pending): per pool, candidates
    (non-resident, usage >= ``gate``) by usage descending first take free slots, then pair with
    residents by usage ascending, swapping only if candidate >= victim + ``margin``; all moves
    ranked by gain and cut to ``max_moves``; then usage *= ``decay``.

    With ``admit_uploads`` a miss that goes over PCIe when its pool is full takes the slot of
    the coldest resident the step does not use, if the miss's usage is at least the resident's:
    its bytes cross the link anyway, so keeping it costs nothing more.
    """

    name = "hybrid"

    def __init__(self, geometry, capacity, profile=None, *, miss_frac_256: int = 44,
                 adaptive: bool = True, swap_every: int = 4, max_moves: int = 96,
                 gate: float = 2.0, margin: float = 1.5, decay: float = 0.7,
                 max_fills: int = MAX_FILLS_PER_TOKEN, admit_uploads: bool = True, rounding: str = "nearest"):
        if rounding not in ("nearest", "carry"):
            raise ValueError(f"hybrid rounding: {rounding!r}, expected 'nearest' or 'carry'")
        self.rounding = rounding
        self._carry = [0] * geometry.num_layers  # remainders of n_miss * miss_frac_256, in 1/256ths
        self.admit_uploads = admit_uploads
        if not 0 <= miss_frac_256 <= 256:
            raise ValueError(f"hybrid miss_frac_256: {miss_frac_256}, expected 0..256")
        if swap_every < 0 or max_moves < 0 or not 0 <= max_fills <= MAX_FILLS_PER_TOKEN:
            raise ValueError("hybrid: swap_every, max_moves >= 0 and 0 <= max_fills <= 512 expected")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"hybrid decay: {decay}, expected in (0, 1]")
        self.miss_frac_256 = miss_frac_256
        self.adaptive = adaptive
        self.swap_every, self.max_moves = swap_every, max_moves
        self.gate, self.margin, self.decay = gate, margin, decay
        self.max_fills = max_fills
        # usage: one float64 buffer, read and bumped per step through memoryview rows (fast
        # from Python), decayed and ranked through a numpy view of the same memory.
        width = max(geometry.max_experts, 1)
        self._buf = bytearray(8 * geometry.num_layers * width)
        self._u = [memoryview(self._buf)[8 * width * l: 8 * width * (l + 1)].cast("d") for l in range(geometry.num_layers)]
        self._np = np.frombuffer(self._buf, dtype=np.float64).reshape(geometry.num_layers, width)
        self.missed: dict[tuple[int, int], None] = {}  # this token's misses, in order
        self._room = True  # some pool had a free slot when this token started
        self._cold: list[list[int]] = [[] for _ in range(geometry.num_layers)]  # admission ranking
        self.tokens = 0
        self.background: set[tuple[int, int]] = set()  # background copies in flight
        super().__init__(geometry, capacity, profile)
        pool_of = self.cache.pool_of
        self._valid = np.zeros((geometry.num_layers, width), dtype=bool)  # may be cached
        for l, n in enumerate(geometry.num_experts):
            if pool_of[l] >= 0 and self.cache.size[pool_of[l]] > 0:
                self._valid[l, :n] = True

    @property
    def usage(self) -> np.ndarray:
        """Decayed routing counts, (layers, max_experts): every committed step adds its token
        counts; each swap round multiplies all by ``decay`` once it is committed. A copy."""
        return self._np.copy()

    def plan(self, step: Step) -> Decision:
        layer = step.layer
        state = self.cache.state[layer]
        experts = step.experts
        misses = [e for e in experts if state[e] != RESIDENT]
        if not misses:
            return Decision(step, experts)
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        if self.rounding == "carry":
            n_pcie = (len(misses) * self.miss_frac_256 + self._carry[layer]) >> 8
        else:
            n_pcie = (len(misses) * self.miss_frac_256 + 128) >> 8
        if n_pcie == 0:
            return Decision(step, hits, (), (), (), tuple(misses))
        eligible = [e for e in misses if state[e] != INFLIGHT]
        if n_pcie == 1 and len(eligible) > 1 and step.counts is None:
            best = max(eligible, key=self._u[layer].__getitem__)  # first of the most used: rank order
            pcie = [best]
            cpu = tuple([e for e in misses if e != best])
        elif len(eligible) > n_pcie:
            u = self._u[layer]
            if step.counts is None:
                eligible.sort(key=lambda e: -u[e])  # stable: router rank breaks ties
            else:
                cnt = dict(zip(experts, step.counts))
                eligible.sort(key=lambda e: (-cnt[e], -u[e]))
            pcie = eligible[:n_pcie]
            cpu = tuple([e for e in misses if e not in pcie])
        else:
            pcie = eligible
            cpu = tuple([e for e in misses if state[e] == INFLIGHT])
        slots = self.cache.free_slots(layer, len(pcie))
        n_up = len(slots)
        if n_up < len(pcie) and self.admit_uploads:
            return self._admit(step, hits, pcie, slots, cpu)
        if n_up == 0:
            return Decision(step, hits, (), (), tuple(pcie), cpu)
        return Decision(step, hits, tuple(pcie[:n_up]), tuple(slots), tuple(pcie[n_up:]), cpu)

    def _admit(self, step: Step, hits, pcie: list[int], slots: list[int], cpu) -> Decision:
        """Uploads beyond the free slots replace the coldest residents of the layer that the
        step does not use, while the miss is at least as used as the resident now. "Coldest"
        follows the residents' usage ranking taken every ``swap_every`` tokens (4 without swap
        rounds), after that token's background moves (ascending, ties by id); when that ranking
        has too few such residents left, the layer is ranked afresh for this step."""
        layer = step.layer
        cache = self.cache
        u = self._u[layer]
        used = step.experts
        need = len(pcie) - len(slots)
        victims = _unused_residents(self._cold[layer], cache.state[layer], used, need)
        if len(victims) < need:
            victims = [v for v in self._rank_residents(layer) if v not in used][:need]
        victims = [(u[v], v) for v in victims]
        uploads, streams, evictions = list(pcie[: len(slots)]), [], []
        slots = list(slots)
        j = 0
        for e in pcie[len(slots):]:
            if j < len(victims) and u[e] >= victims[j][0]:
                v = (layer, victims[j][1])
                j += 1
                uploads.append(e)
                slots.append(cache.slot[v])
                evictions.append(v)
            else:
                streams.append(e)
        return Decision(step, hits, tuple(uploads), tuple(slots), tuple(streams), cpu, tuple(evictions))

    def commit(self, d: Decision) -> None:
        layer = d.step.layer
        if d.uploads:
            self._take_slots(d)
        if self.rounding == "carry":
            n_miss = len(d.uploads) + len(d.streams) + len(d.cpu)
            self._carry[layer] = (n_miss * self.miss_frac_256 + self._carry[layer]) & 255
        u = self._u[layer]
        if d.step.counts is None:
            for e in d.step.experts:
                u[e] += 1.0
        else:
            for e, c in zip(d.step.experts, d.step.counts):
                u[e] += c
        if self._room:  # the misses are fill candidates only while some pool has a free slot
            missed = self.missed
            for e in d.streams:
                missed[(layer, e)] = None
            for e in d.cpu:
                missed[(layer, e)] = None

    def complete(self, layer: int, expert: int) -> None:
        super().complete(layer, expert)
        self.background.discard((layer, expert))

    def _rank_residents(self, layer: int) -> list[int]:
        """The layer's residents by usage ascending, ties by id."""
        row = np.flatnonzero(self.cache.resident_row(layer) & self._valid[layer])
        return row[np.argsort(self._np[layer][row], kind="stable")].tolist()

    def _rank_all_residents(self) -> None:
        """Refresh every layer's admission ranking (after a swap round)."""
        width = self._np.shape[1]
        vi = np.flatnonzero(self._valid & self.cache.resident_mask)
        vl, ve = vi // width, vi % width
        o = _by_layer_then(vl, self._np.ravel()[vi])
        vl, ve = vl[o], ve[o]
        bounds = np.searchsorted(vl, np.arange(len(self._cold) + 1))
        self._cold = [ve[bounds[l]:bounds[l + 1]].tolist() for l in range(len(self._cold))]

    # background ------------------------------------------------------------------------------
    def _swap_due(self) -> bool:
        return bool(self.swap_every) and (self.tokens + 1) % self.swap_every == 0 and not self.background

    def plan_background(self) -> tuple[Move, ...]:
        cache = self.cache
        free_left = [len(f) for f in cache.free]
        fills: list[Move] = []
        taken: set[tuple[int, int]] = set()
        if self.adaptive and self.missed and any(free_left):
            u = self._u
            cands = [k for k in self.missed if k not in cache.slot and cache.pool_of[k[0]] >= 0]
            cands.sort(key=lambda k: -u[k[0]][k[1]])
            for k in cands:
                if len(fills) == self.max_fills:
                    break
                p = cache.pool_of[k[0]]
                if free_left[p] == 0:
                    continue
                slot = cache.free[p][free_left[p] - 1]
                free_left[p] -= 1
                fills.append(Move(k[0], k[1], slot, None, u[k[0]][k[1]]))
                taken.add(k)
        moves = self._swap_round(free_left, taken) if self._swap_due() else []
        return tuple(fills) + tuple(moves)

    def _swap_round(self, free_left: list[int], taken: set[tuple[int, int]]) -> list[Move]:
        """Plan one swap round (see the class docstring); vectorised over layers.

        Candidates of a layer are ranked by usage descending, victims ascending, ties by expert
        id. A pool's free slots go to its best candidates (merged across the pool's layers);
        the layer's next candidates pair with its victims in order while candidate >= victim +
        margin. All moves are ranked by gain descending, ties by layer then expert, and cut.
        """
        cache = self.cache
        U = self._np
        num_layers, width = U.shape
        cand = self._valid & ~cache.occupied_mask & (U >= self.gate)
        for l, e in taken:
            cand[l, e] = False
        layers = np.arange(num_layers)
        # candidates: by layer, usage descending, expert; rank = position within the layer
        ci = np.flatnonzero(cand)
        cl, ce, cu = ci // width, ci % width, U.ravel()[ci]
        o = _by_layer_then(cl, -cu)
        cl, ce, cu = cl[o], ce[o], cu[o]
        cstart = np.searchsorted(cl, layers)
        crank = np.arange(len(cl)) - cstart[cl]
        ncand = np.bincount(cl, minlength=num_layers)
        # victims: residents by layer, usage ascending, expert
        vi = np.flatnonzero(self._valid & cache.resident_mask)
        vl, ve, vu = vi // width, vi % width, U.ravel()[vi]
        o = _by_layer_then(vl, vu)
        vl, ve, vu = vl[o], ve[o], vu[o]
        vstart = np.searchsorted(vl, layers)
        nvict = np.bincount(vl, minlength=num_layers)
        # fills: a pool's free slots go to its best candidates (merged across its layers)
        f = np.zeros(num_layers, dtype=np.int64)
        fills = []  # (-gain, layer, expert, slot, None)
        for p, (pool_layers, _) in enumerate(self.capacity.pools):
            n_free = free_left[p]
            if n_free == 0:
                continue
            best = sorted((-float(cu[cstart[l] + i]), l, int(ce[cstart[l] + i]))
                          for l in pool_layers for i in range(min(n_free, int(ncand[l]))))
            free = cache.free[p]
            for i, (g, l, e) in enumerate(best[:n_free]):
                f[l] += 1
                fills.append((g, l, e, free[n_free - 1 - i], None))
        # swaps: the layer's candidate f + j against its victim j, while the gain holds
        vpos = crank - f[cl]
        ok = (vpos >= 0) & (vpos < nvict[cl])
        vidx = vstart[cl] + np.where(ok, vpos, 0)
        gain = cu - vu[np.minimum(vidx, max(len(vu) - 1, 0))] if len(vu) else np.zeros(len(cu))
        ok &= gain >= self.margin
        sel = np.flatnonzero(ok)
        swaps = [(-float(gain[i]), int(cl[i]), int(ce[i]), None, int(ve[vidx[i]])) for i in sel]
        moves = []
        for g, l, e, s, v in sorted(fills + swaps)[: self.max_moves]:
            if v is None:
                moves.append(Move(l, e, s, None, -g))
            else:
                moves.append(Move(l, e, cache.slot[(l, v)], (l, v), -g))
        return moves

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        swap_round = self._swap_due()
        super().commit_background(moves)
        self.background.update((m.layer, m.expert) for m in moves)
        if swap_round:
            self._np *= self.decay
        if self.admit_uploads and (self.tokens + 1) % (self.swap_every or 4) == 0:
            self._rank_all_residents()
        self.missed.clear()
        self._room = any(self.cache.free)  # hybrid frees no slot during a token
        self.tokens += 1


class HybridCostPolicy(HybridPolicy):
    """``hybrid`` whose miss split comes from a cost model instead of a fixed fraction.

    Per step: the hits' GPU time is counted first; in-flight misses go to the CPU. Of the other
    misses, ranked by token count (more first), then decayed usage (higher first), then router
    rank, the first ``round(n * floor_256 / 256)`` (half up) go over PCIe (the *floor*); each of
    the rest goes where the layer's time ``max(gpu, pcie, cpu)`` grows least: over PCIe to the GPU
    (upload + GPU compute) or to the CPU pool (its per-layer task cost paid once); ties go to the
    CPU, which moves no bytes. Misses of equal token count cost the same, so the greedy fixes how
    many of each count go over PCIe and the most used of them are the ones sent (and admitted).

    The link is modelled as a queue: background copies (fills and swaps) committed after a token
    are queued on it, and drain while layers run (``CostModel.layer_s`` of each layer's other
    work, then the layer's predicted time); a step's uploads start behind what is left. A step
    with no upload does not wait for the link.

    The floor is chosen online from ``floors_256``: one shadow copy of the policy per candidate
    floor (its own cache, usage and background work, completions at the live lag) is replayed on
    the committed steps of ``shadow_layers`` MoE layers (at most one per ``len(floors_256)`` MoE
    layers, at least one) spread evenly over depth (with every layer
    that shares a cache pool with one of them; each shadow's ``max_moves`` and ``max_fills`` are
    cut in the same proportion) and sums its predicted layer times. After the first
    ``tune_warmup`` windows the shadows run only a ``tune_duty`` share of the time: a window, then a
    rest; the window after a rest starts fresh shadows from the live cache, usage and in-flight
    copies on those layers. Tuning thus costs about ``tune_duty * len(floors_256) * shadow_layers
    / num_moe_layers`` of a policy's steps. A window closes after ``tune_every``
    tokens' worth of routes (``top_k`` per token and MoE layer; an n-token step counts its token
    counts), at a step (in the duty cycle, at the end of that step's token): the live floor
    moves to the shadow predicted fastest, if it beats the
    current floor's shadow by more than ``hysteresis`` (a fraction); then every sum is halved, so
    earlier windows weigh less. A single candidate fixes the floor. An expert with many tokens
    is worth uploading; one with a single token is often cheaper on the CPU (HybriMoE, Fiddler); a
    share of uploads beyond that buys future hits, which the shadows price.

    Caching (``admit``): with ``"recency"`` (the default) a PCIe miss beyond the free slots always
    takes the slot of the layer's least recently used resident the step does not use (within a
    step, in router order; never used: by id): its bytes cross the link anyway, and on a trace with the locality of the
    qwen3 preset, recency kept more hits than usage (simulated, calibrated H200 file: hit rate
    0.751 against 0.643 for hybrid's usage-gated admission when every miss goes over PCIe); swap
    rounds are then off unless ``swap_every`` is given, since they refill by usage what recency
    evicted. ``"usage"``: ``hybrid``'s admission and swap rounds. Fills are ``hybrid``'s.
    """

    name = "hybrid-cost"
    _shortcut = True  # skip the greedy where it provably sends every miss (tests compare without)

    def __init__(self, geometry, capacity, profile=None, *, cost_model: CostModel | None = None,
                 floors_256: Sequence[int] = (0, 32, 64, 96, 128), tune_every: int = 8,
                 hysteresis: float = 0.01, shadow_layers: int = 4, tune_duty: float = 0.25,
                 tune_warmup: int = 16, admit: str = "recency", **options):
        if admit not in ("recency", "usage"):
            raise ValueError(f"hybrid-cost admit: {admit!r}, expected 'recency' or 'usage'")
        if options.get("rounding", "nearest") != "nearest":
            raise ValueError("hybrid-cost rounding: its floor is rounded to nearest; 'carry' is hybrid's")
        if admit == "recency":
            options.setdefault("swap_every", 0)
        self.admit = admit
        if cost_model is None:
            raise ValueError("policy 'hybrid-cost' needs cost_model= (scheduler.CostModel)")
        if len(cost_model.upload_s) != geometry.num_layers:
            raise ValueError(f"cost_model has {len(cost_model.upload_s)} layers, the model {geometry.num_layers}")
        floors = tuple(int(f) for f in floors_256)
        if not floors or any(not 0 <= f <= 256 for f in floors) or len(set(floors)) != len(floors):
            raise ValueError(f"hybrid-cost floors_256: {floors_256}, expected distinct values in 0..256")
        if tune_every < 1:
            raise ValueError(f"hybrid-cost tune_every: {tune_every}, expected >= 1")
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hybrid-cost hysteresis: {hysteresis}, expected in [0, 1)")
        if shadow_layers < 1:
            raise ValueError(f"hybrid-cost shadow_layers: {shadow_layers}, expected >= 1")
        if not 0.0 < tune_duty <= 1.0:
            raise ValueError(f"hybrid-cost tune_duty: {tune_duty}, expected in (0, 1]")
        if tune_warmup < 0:
            raise ValueError(f"hybrid-cost tune_warmup: {tune_warmup}, expected >= 0")
        self.costs = cost_model
        self.floor_256 = floors[0]
        self._layer_s = cost_model.layer_s or (0.0,) * geometry.num_layers
        self._queue_s = 0.0  # link work still queued when the last committed layer ended
        self.lag_tokens = 1  # background completion lag, learnt from the live completions
        self._bg_token: dict[tuple[int, int], int] = {}  # background copy -> token it followed
        self._gpu1 = [cost_model.gpu_s(l, 1) for l in range(geometry.num_layers)]  # decode costs
        self._cpu1 = [cost_model.cpu_s(l, 1) for l in range(geometry.num_layers)]
        self._gpu_tab: list[list[float]] = [[] for _ in range(geometry.num_layers)]  # see _tables
        self._cpu_tab: list[list[float]] = [[] for _ in range(geometry.num_layers)]
        self._planned = None  # (the last decision planned, its layer_time_s), read by commit
        super().__init__(geometry, capacity, profile, **options)
        # per layer, every expert from least to most recently used (never used first, by id)
        self._lru = [OrderedDict.fromkeys(range(n)) for n in geometry.num_experts]
        self.tuner = None
        if len(floors) > 1:
            n_moe = len(geometry.moe_layers)  # shadows plan no more layer-steps than the live policy
            layers = _sample_layers(geometry.moe_layers, self.cache.pool_of,
                                    min(shadow_layers, max(n_moe // len(floors), 1)))
            parts = _sub_model(geometry, capacity, profile, cost_model, layers)
            n = len(layers)
            cut = {"max_moves": -(-self.max_moves * n // n_moe), "max_fills": -(-self.max_fills * n // n_moe)}
            make = lambda f, prof: HybridCostPolicy(*parts[:2], prof, cost_model=parts[3], floors_256=(f,),
                                                    admit=admit, **{**options, **cut})
            routes = tune_every * geometry.top_k * n_moe
            self.tuner = _FloorTuner(make, floors, routes, hysteresis, layers, parts[2], tune_duty, tune_warmup)

    def _tables(self, layer: int, max_count: int) -> tuple[list[float], list[float]]:
        """The layer's GPU and CPU seconds per expert by token count (index c: c tokens), grown
        to cover ``max_count``."""
        gt, ct = self._gpu_tab[layer], self._cpu_tab[layer]
        cm = self.costs
        for c in range(len(gt), max_count + 1):
            gt.append(cm.gpu_s(layer, c))
            ct.append(cm.cpu_s(layer, c))
        return gt, ct

    def plan(self, step: Step) -> Decision:
        layer = step.layer
        state = self.cache.state[layer]
        experts, counts = step.experts, step.counts
        misses = [e for e in experts if state[e] != RESIDENT]
        queued = self._queue_s - self._layer_s[layer]
        queued = queued if queued > 0.0 else 0.0
        if counts is None:
            gpu_s, cpu_s = self._gpu1[layer], self._cpu1[layer]
        else:
            gt, ct = self._tables(layer, max(counts))
        if not misses:
            t = len(experts) * gpu_s if counts is None else sum([gt[c] for c in counts])
            d = Decision(step, experts)
            self._planned = (d, t, queued - t if queued > t else 0.0)
            return d
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        eligible = [e for e in misses if state[e] != INFLIGHT]
        task = self.costs.cpu_task_s
        if counts is None:
            gpu = len(hits) * gpu_s
            n_busy = len(misses) - len(eligible)  # in flight: on the CPU
            cpu_t = task + n_busy * cpu_s if n_busy else 0.0
        else:
            cnt = dict(zip(experts, counts))
            gpu = sum([gt[cnt[e]] for e in hits])
            busy = [ct[cnt[e]] for e in misses if state[e] == INFLIGHT]
            cpu_t = task + sum(busy) if busy else 0.0
        delay = self.costs.cpu_delay_s  # with the pool in use, GPU work and copies are queued this late
        if not eligible:
            t = max(gpu + delay, cpu_t)
            d = Decision(step, hits, cpu=tuple(misses))
            self._planned = (d, t, queued - t if queued > t else 0.0)
            return d
        u = self._u[layer]
        if len(eligible) > 1:  # more used first; stable, so router rank breaks ties
            eligible.sort(key=u.__getitem__ if counts is None else (lambda e: (cnt[e], u[e])), reverse=True)
        n_floor = (len(eligible) * self.floor_256 + 128) >> 8
        up_s = self.costs.upload_s[layer]
        link = queued + n_floor * up_s
        if counts is None:
            gpu += n_floor * gpu_s
            pcie, gpu, link, cpu_t = self._split_decode(eligible, n_floor, gpu, link, cpu_t, gpu_s, cpu_s, up_s,
                                                        queued)
        else:
            gpu += sum([gt[cnt[e]] for e in eligible[:n_floor]])
            pcie, gpu, link, cpu_t = self._split_counts(eligible, cnt, n_floor, gpu, link, cpu_t, gt, ct, up_s,
                                                        queued)
        dl = delay if cpu_t else 0.0
        if pcie:
            t, left = max(gpu + dl, cpu_t, link + max(dl - queued, 0.0)), 0.0
            cpu = tuple([e for e in misses if e not in pcie])
        else:
            t = max(gpu + dl, cpu_t)
            left = queued - t if queued > t else 0.0
            cpu = tuple(misses)
        slots = self.cache.free_slots(layer, len(pcie))
        n_slot = len(slots)
        if n_slot < len(pcie) and self.admit_uploads:
            d = self._admit(step, hits, pcie, slots, cpu)
        else:
            d = Decision(step, hits, tuple(pcie[:n_slot]), tuple(slots), tuple(pcie[n_slot:]), cpu)
        self._planned = (d, t, left)
        return d

    def _split_decode(self, eligible, n_floor, gpu, link, cpu_t, gpu_s, cpu_s, up_s, queued):
        """The greedy past the floor when every miss has one token (all cost the same, so the
        first ones sent are the most used); returns (PCIe misses, gpu, link, cpu times).
        ``link``: the link's end (``queued`` background work, then the uploads); with the pool in
        use, the GPU work and the uploads start ``cpu_delay_s`` late."""
        n_up = n_floor
        task, delay = self.costs.cpu_task_s, self.costs.cpu_delay_s
        if self._shortcut and not cpu_t:  # the pool's first expert dearer than every miss sent: all go
            g_all, l_all = gpu, link
            for _ in range(len(eligible) - n_floor):
                g_all += gpu_s
                l_all += up_s
            if task + cpu_s > max(g_all, l_all):
                return eligible, g_all, l_all, cpu_t
        lag = max(delay - queued, 0.0)  # the uploads' delay behind the queue when the pool is used
        for _ in range(len(eligible) - n_floor):
            g_gpu, g_link = gpu + gpu_s, link + up_s
            c_cpu = cpu_t + cpu_s + (0.0 if cpu_t else task)
            dg, dk = (delay, lag) if cpu_t else (0.0, 0.0)
            if max(g_gpu + dg, g_link + dk, cpu_t) < max(gpu + delay, link + lag if n_up else 0.0, c_cpu):
                gpu, link, n_up = g_gpu, g_link, n_up + 1
            else:
                cpu_t = c_cpu
        return eligible[:n_up], gpu, link, cpu_t

    def _split_counts(self, eligible, cnt, n_floor, gpu, link, cpu_t, gt, ct, up_s, queued):
        """The greedy past the floor with token counts: it fixes how many misses of each count
        go over PCIe, and the most used of that count are sent; returns as ``_split_decode``."""
        n_up = n_floor
        task, delay = self.costs.cpu_task_s, self.costs.cpu_delay_s
        if self._shortcut and not cpu_t and n_floor < len(eligible):  # as in _split_decode, cheapest count
            g_all, l_all, cheapest = gpu, link, min([ct[cnt[e]] for e in eligible[n_floor:]])
            for e in eligible[n_floor:]:
                g_all += gt[cnt[e]]
                l_all += up_s
            if task + cheapest > max(g_all, l_all):
                return eligible, g_all, l_all, cpu_t
        lag = max(delay - queued, 0.0)
        sent: dict[int, int] = {}  # token count -> how many of the greedy's misses go over PCIe
        for e in eligible[n_floor:]:
            c = cnt[e]
            g_gpu, g_link = gpu + gt[c], link + up_s
            c_cpu = cpu_t + ct[c] + (0.0 if cpu_t else task)
            dg, dk = (delay, lag) if cpu_t else (0.0, 0.0)
            if max(g_gpu + dg, g_link + dk, cpu_t) < max(gpu + delay, link + lag if n_up else 0.0, c_cpu):
                sent[c] = sent.get(c, 0) + 1
                gpu, link, n_up = g_gpu, g_link, n_up + 1
            else:
                cpu_t = c_cpu
        pcie = eligible[:n_floor]
        for e in eligible[n_floor:]:
            c = cnt[e]
            if sent.get(c):
                sent[c] -= 1
                pcie.append(e)
        return pcie, gpu, link, cpu_t

    def layer_time_s(self, d: Decision) -> tuple[float, float]:
        """Predicted expert time of decision ``d`` by the cost model (waiting for the link's queue
        when it uploads), and the link work still queued when the layer ends."""
        if self._planned is not None and self._planned[0] is d:
            return self._planned[1], self._planned[2]
        cm = self.costs
        layer = d.step.layer
        cnt = dict(zip(d.step.experts, d.step.counts)) if d.step.counts is not None else None
        queued = max(self._queue_s - self._layer_s[layer], 0.0)
        gpu = sum(cm.gpu_s(layer, cnt[e] if cnt else 1) for e in d.hits + d.uploads + d.streams)
        cpu = cm.cpu_task_s + sum(cm.cpu_s(layer, cnt[e] if cnt else 1) for e in d.cpu) if d.cpu else 0.0
        n_up = len(d.uploads) + len(d.streams)
        dl = cm.cpu_delay_s if d.cpu else 0.0
        if n_up:
            return max(gpu + dl, cpu, max(queued, dl) + n_up * cm.upload_s[layer]), 0.0
        t = max(gpu + dl, cpu)
        return t, max(queued - t, 0.0)

    def _admit(self, step: Step, hits, pcie: list[int], slots: list[int], cpu) -> Decision:
        """``admit="recency"``: uploads beyond the free slots take the slots of the layer's least
        recently used residents the step does not use; else ``hybrid``'s usage-gated admission."""
        if self.admit != "recency":
            return super()._admit(step, hits, pcie, slots, cpu)
        layer, cache = step.layer, self.cache
        need = len(pcie) - len(slots)
        victims = _unused_residents(self._lru[layer], cache.state[layer], step.experts, need)
        n_up = len(slots) + len(victims)
        slots = list(slots) + [cache.slot[(layer, v)] for v in victims]
        return Decision(step, hits, tuple(pcie[:n_up]), tuple(slots), tuple(pcie[n_up:]), cpu,
                        tuple((layer, v) for v in victims))

    def commit(self, d: Decision) -> float:
        """Commit ``d`` (see ``hybrid``); returns its predicted time (``layer_time_s``)."""
        t, self._queue_s = self.layer_time_s(d)
        to_end = self._lru[d.step.layer].move_to_end
        for e in d.step.experts:
            to_end(e)
        super().commit(d)
        if self.tuner is not None:
            self.floor_256 = self.tuner.observe(d.step, self.floor_256)
        return t

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        token = self.tokens
        super().commit_background(moves)
        up = self.costs.upload_s
        self._queue_s += sum(up[m.layer] for m in moves)
        for m in moves:
            self._bg_token[(m.layer, m.expert)] = token
        if self.tuner is not None:
            self.floor_256 = self.tuner.end_token(self, token)

    def complete(self, layer: int, expert: int) -> None:
        token = self._bg_token.pop((layer, expert), None)
        if token is not None:  # a background copy: the driver's lag is now known
            self.lag_tokens = max(self.tokens - token - 1, 0)
        super().complete(layer, expert)


def _unused_residents(order, state, used, need: int) -> list[int]:
    """The first ``need`` experts of ``order`` that are resident and not in ``used``."""
    out = []
    for v in order:
        if state[v] == RESIDENT and v not in used:
            out.append(v)
            if len(out) == need:
                break
    return out


def _sample_layers(moe_layers: tuple[int, ...], pool_of: list[int], k: int) -> tuple[int, ...]:
    """``k`` of ``moe_layers`` spread evenly (the middle of each of ``k`` equal runs), with every
    layer sharing a cache pool with one of them; ascending."""
    n = len(moe_layers)
    if k >= n:
        return moe_layers
    picked = {moe_layers[(2 * i + 1) * n // (2 * k)] for i in range(k)}
    pools = {pool_of[l] for l in picked if pool_of[l] >= 0}
    return tuple(sorted(picked | {l for l in moe_layers if pool_of[l] in pools}))


def _sub_model(geometry: Geometry, capacity: Capacity, profile: Profile | None, cost_model: CostModel,
               layers: tuple[int, ...]):
    """Geometry, capacity, profile and cost model of ``layers`` alone (whole pools), renumbered
    0.. in order, for the floor tuner's shadows."""
    index = {l: i for i, l in enumerate(layers)}
    sub = Geometry(tuple(geometry.num_experts[l] for l in layers), geometry.top_k,
                   tuple(geometry.expert_bytes[l] for l in layers))
    pools = tuple((tuple(index[l] for l in ls if l in index), n) for ls, n in capacity.pools
                  if any(l in index for l in ls))
    if profile is not None:
        ranked = tuple((index[l], e) for l, e in profile.ranked if l in index)
        freq = None if profile.frequency is None else profile.frequency[list(layers)]
        profile = Profile(len(layers), sub.max_experts, ranked, min(profile.slots, len(ranked)), freq)
    return sub, Capacity(pools), profile, cost_model.of_layers(layers)


class _FloorTuner:
    """Shadow ``hybrid-cost`` policies, one per candidate floor, replayed on the live steps of
    ``layers`` (see ``HybridCostPolicy``): each sums its own predicted time per window of tokens.

    With ``duty`` < 1, after the first ``warmup`` windows each window runs to the end of the token
    in which its routes are reached, then a rest of ``1 / duty - 1`` windows' routes follows in
    which no shadow runs; at the token boundary after a rest, fresh shadows start from the live
    policy's state on those layers (``_seed``)."""

    def __init__(self, make, floors: tuple[int, ...], window_routes: int, hysteresis: float,
                 layers: tuple[int, ...], profile: Profile | None, duty: float, warmup: int):
        self.floors, self.make = floors, make
        self.layers = layers
        self.index = {l: i for i, l in enumerate(layers)}  # live layer -> the shadows' layer
        self.shadows = [make(f, profile) for f in floors]
        self.window_routes, self.hysteresis = window_routes, hysteresis
        self.rest_routes = round(window_routes * (1.0 / duty - 1.0))
        self.routes = 0  # (token, expert) routes seen in this window or rest
        self.window_s = [0.0] * len(floors)
        self.pending: deque[tuple[int, HybridCostPolicy, tuple[Move, ...]]] = deque()
        self.history: list[int] = []  # the floor chosen at each window's end
        self.resting = self.reseed = self.close_due = False
        self.warmup = warmup

    def observe(self, step: Step, floor: int) -> int:
        """Replay one committed live step on every shadow (if its layer is sampled and a window
        is open); returns the live floor from now on (changed when this step closes a window)."""
        self.routes += len(step.experts) if step.counts is None else sum(step.counts)
        if self.resting:
            if self.routes >= self.rest_routes:
                self.reseed, self.routes = True, 0
            return floor
        layer = self.index.get(step.layer)
        if layer is not None:
            step = Step(layer, step.experts, step.counts, step.weights)
            for i, sh in enumerate(self.shadows):
                d = sh.plan(step)
                self.window_s[i] += sh.commit(d)
                for e in d.uploads:
                    sh.complete(layer, e)
                for e in d.promotions:
                    sh.complete(layer, e)
        if self.routes < self.window_routes or self.close_due:
            return floor
        if self._duty_mode():  # a window before a rest spans whole tokens: it closes at the end
            self.close_due = True
            return floor
        return self._close(floor)

    def _duty_mode(self) -> bool:
        return bool(self.rest_routes) and len(self.history) >= self.warmup

    def _close(self, floor: int) -> int:
        """End a window: the live floor from now on; a rest follows in duty mode."""
        cur = self.floors.index(floor)
        best = min(range(len(self.floors)), key=lambda i: (self.window_s[i], i))
        if self.window_s[best] < self.window_s[cur] * (1.0 - self.hysteresis):
            floor = self.floors[best]
        self.window_s = [t * 0.5 for t in self.window_s]  # earlier windows weigh half as much
        self.routes = 0
        self.history.append(floor)
        if self._duty_mode():
            self.resting, self.shadows, self.close_due = True, [], False
            self.pending.clear()
        return floor

    def end_token(self, live: HybridCostPolicy, token: int) -> int:
        """Background work of every shadow after live token ``token`` (after ``live``'s own);
        completes the copies due before the next token starts. Closes a window due to close, or
        starts fresh shadows after a rest. Returns the live floor from now on."""
        lag = live.lag_tokens
        if self.close_due:
            return self._close(live.floor_256)
        if self.reseed:
            self.shadows = [self.make(f, None) for f in self.floors]
            for sh in self.shadows:
                self._seed(sh, live, token, lag)
            self.resting = self.reseed = False
            return live.floor_256
        for sh in self.shadows:
            moves = sh.plan_background()
            sh.commit_background(moves)
            if moves:
                self.pending.append((token + 1 + lag, sh, moves))
        while self.pending and self.pending[0][0] <= token + 1:
            _, sh, moves = self.pending.popleft()
            for m in moves:
                sh.complete(m.layer, m.expert)
        return live.floor_256

    def _seed(self, sh: HybridCostPolicy, live: HybridCostPolicy, token: int, lag: int) -> None:
        """Give shadow ``sh`` the live policy's residents (same slots), usage and token count on
        the sampled layers; live background copies still in flight are in flight in ``sh`` too,
        completing when the live ones do, and queued on its link."""
        cache, width = live.cache, sh._np.shape[1]
        up = sh.costs.upload_s
        due: dict[int, list[Move]] = {}
        for j, l in enumerate(self.layers):
            sh._np[j] = live._np[l, :width]
            sh._lru[j] = OrderedDict(live._lru[l])
            p = cache.pool_of[l]
            if p < 0:
                continue
            for slot, key in enumerate(cache.owner[p]):
                if key is None or key[0] != l:
                    continue
                if key in cache.inflight:
                    sh.cache.reserve((j, key[1]), slot)
                    sh.background.add((j, key[1]))
                    sh._queue_s += up[j]
                    t = live._bg_token.get(key, token) + 1 + lag
                    due.setdefault(t, []).append(Move(j, key[1], slot))
                else:
                    sh.cache.place((j, key[1]), slot)
        sh.tokens = live.tokens
        sh._room = any(sh.cache.free)
        sh._rank_all_residents()
        for t in sorted(due):
            self.pending.append((t, sh, tuple(due[t])))


class BeladyPolicy(BasePolicy):
    """Optimal offline cache with bypass, given every step in replay order.

    After each step the pool keeps the experts (its residents and this step's misses) whose next
    use comes soonest; a miss not kept is streamed (bypass). Before the step, misses take free
    slots and the slots of residents the step does not use; where the best choice is to drop an
    expert the step itself uses, that expert is retired after the step and the miss, streamed,
    is promoted into its slot. Ties keep residents, then lower (layer, expert).
    """

    name = "belady"

    def __init__(self, geometry, capacity, profile=None, *, future: Sequence[Step] = ()):
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


def _by_layer_then(layers: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Order of entries given in (layer, expert) order, sorted by layer, then key, then expert:
    two stable sorts (the same order as ``np.lexsort((experts, keys, layers))``, several times
    faster)."""
    o = np.argsort(keys, kind="stable")
    return o[np.argsort(layers[o], kind="stable")]


from .predict import PredictPolicy  # noqa: E402  (its own module, built on BasePolicy above)

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
}


def make_policy(name: str, geometry: Geometry, capacity: Capacity, profile: Profile | None = None,
                future: Iterable[Step] | None = None, **options):
    """Build a policy by name. ``belady`` needs ``future``; ``static`` needs ``profile``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
    if name == "belady":
        return cls(geometry, capacity, profile, future=list(future or ()), **options)
    return cls(geometry, capacity, profile, **options)
