"""``hybrid``: hits on the GPU, a layer's distinct misses split between PCIe and the CPU pool.

Choice of which misses go over PCIe in ``hybrid`` (documented contract): a step's distinct misses
are ranked by token count (more first), then decayed usage (higher first), then router rank;
the first ``round(n_miss * frac / 256)`` (half rounds up) that are not in flight go over PCIe,
the rest to the CPU. With the default ``MISS_FRAC_256`` = 44 a step with 1 or 2 misses sends none over PCIe and
one with 3 to 8 sends one, so on a top-1 or top-2 model no miss ever does. ``rounding="carry"``
keeps the fraction on average instead: per layer, the remainder (in 1/256ths) of each step's
``n_miss * frac`` is carried to the layer's next step, which sends ``(n_miss * frac + carry) //
256``; the carry is updated at commit, from the step's distinct misses. A PCIe miss is admitted into a free slot when its pool has one; else (with
``admit_uploads``, the default) into the slot of the layer's coldest resident that the step does
not use (by a usage ranking refreshed every ``swap_every`` tokens), when the miss is at least as
used; otherwise it is streamed through a scratch buffer. Misses in flight (a background copy not
yet complete) always go to the CPU: nothing is uploaded twice.

Given a cost model (``cost_model=``, from a hardware file), ``hybrid`` takes its share from it
instead (``CostShare``): per step, the number of PCIe misses that makes the layer's predicted time
least, with the CPU misses charged the reuse they lose (they are not cached); it then admits by
recency (``admit="recency"``: an upload takes the slot of the layer's least recently used
resident the step does not use) and runs no swap rounds, unless ``admit``/``swap_every`` say
otherwise, and caps each token's fills at what the link could carry in its idle time, none after a
prompt chunk (``CostShare.fill_cap``). With ``prompt_fill`` a prompt chunk's step uploads at least its
misses with the most tokens that the layer's free room holds (``prompt_room``): the cache leaves the
prompt holding what the prompt used most, loaded while the prompt runs rather than by fills after it
(which delay the first decode tokens). ``miss_frac_256`` and ``rounding`` apply to the fixed share only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..cache import ABSENT, INFLIGHT, RESIDENT
from ..core import Capacity, Decision, Geometry, Move, Step
from ..costmodel import CostModel
from ..profile import Profile
from .base import MAX_FILLS_PER_TOKEN, BasePolicy

__all__ = ["MISS_FRAC_256", "CostShare", "HybridConfig", "HybridPolicy", "prompt_room"]

MISS_FRAC_256 = 44  # hybrid's default share of a step's distinct misses sent over PCIe, in 1/256ths


@dataclass(frozen=True)
class HybridConfig:
    """``hybrid``'s knobs (see ``HybridPolicy``); an error names the field.

    ``miss_frac_256`` in 0..256; ``swap_every`` (tokens, 0: no swap rounds) and ``max_moves`` >= 0;
    ``max_fills`` in 0..``MAX_FILLS_PER_TOKEN``; ``decay`` in (0, 1]; ``rounding`` "nearest" or
    "carry" (see the module docstring); ``admit`` "usage" or "recency" (see ``HybridPolicy``);
    ``swap_while_filling`` False holds swap rounds back while a slot is free (the seed's hybrid
    before its faster fill; the periodic round "also runs while the cache fills" came with it).
    ``prompt_fill`` (with a cost model): a step of several tokens (more routes than ``top_k``)
    uploads at least as many of its misses, most tokens first, as the layer has room for
    (``prompt_room``). None (the defaults): ``admit`` "recency" with a cost model, "usage"
    without; ``swap_every`` 0 with "recency", 4 with "usage".
    """

    miss_frac_256: int = MISS_FRAC_256
    adaptive: bool = True
    swap_every: int | None = None
    max_moves: int = 96
    gate: float = 2.0
    margin: float = 1.5
    decay: float = 0.7
    max_fills: int = MAX_FILLS_PER_TOKEN
    admit_uploads: bool = True
    rounding: str = "nearest"
    admit: str | None = None
    swap_while_filling: bool = True
    prompt_fill: bool = True

    policy = "hybrid"  # the name errors give (not a field)

    def __post_init__(self) -> None:
        p = self.policy
        if self.rounding not in ("nearest", "carry"):
            raise ValueError(f"{p} rounding: {self.rounding!r}, expected 'nearest' or 'carry'")
        if not 0 <= self.miss_frac_256 <= 256:
            raise ValueError(f"{p} miss_frac_256: {self.miss_frac_256}, expected 0..256")
        for name in ("swap_every", "max_moves"):
            if getattr(self, name) is not None and not getattr(self, name) >= 0:
                raise ValueError(f"{p} {name}: {getattr(self, name)}, expected >= 0")
        if not 0 <= self.max_fills <= MAX_FILLS_PER_TOKEN:
            raise ValueError(f"{p} max_fills: {self.max_fills}, expected 0..{MAX_FILLS_PER_TOKEN}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"{p} decay: {self.decay}, expected in (0, 1]")
        if self.admit not in (None, "usage", "recency"):
            raise ValueError(f"{p} admit: {self.admit!r}, expected 'recency' or 'usage'")


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

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None,
                 config: HybridConfig = HybridConfig(), *, cost_model: CostModel | None = None):
        self.config = config
        self.share = None if cost_model is None else CostShare(cost_model, geometry.num_layers)
        self.rounding = config.rounding
        self._carry = [0] * geometry.num_layers  # remainders of n_miss * miss_frac_256, in 1/256ths
        self.admit_uploads = config.admit_uploads
        self.admit = config.admit or ("usage" if cost_model is None else "recency")
        # per layer, with admit "recency": every expert from least to most recently used (never used first, by id)
        self._lru = [OrderedDict.fromkeys(range(n)) for n in geometry.num_experts] if self.admit == "recency" else None
        self.miss_frac_256 = config.miss_frac_256
        self.adaptive = config.adaptive
        self.swap_every = config.swap_every if config.swap_every is not None else 4 if self.admit == "usage" else 0
        self.max_moves = config.max_moves
        self.gate, self.margin, self.decay = config.gate, config.margin, config.decay
        self.max_fills = config.max_fills
        self.swap_while_filling = config.swap_while_filling
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
        if self.share is not None:
            eligible = [e for e in misses if state[e] != INFLIGHT]
            n_pcie = self.share.uploads(step, hits, eligible, len(misses) - len(eligible), self._u[layer])
            if step.counts is not None and self.config.prompt_fill and sum(step.counts) > self.geometry.top_k:
                n_pcie = max(n_pcie, min(prompt_room(self.cache, self.capacity, layer), len(eligible)))
        elif self.rounding == "carry":
            n_pcie = (len(misses) * self.miss_frac_256 + self._carry[layer]) >> 8
        else:
            n_pcie = (len(misses) * self.miss_frac_256 + 128) >> 8
        if n_pcie == 0:
            return Decision(step, hits, (), (), (), tuple(misses))
        if self.share is None:
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
        """``admit="recency"``: uploads beyond the free slots take the slots of the layer's least
        recently used residents the step does not use. Else (``"usage"``): uploads beyond the free slots replace the coldest residents of the layer that the
        step does not use, while the miss is at least as used as the resident now. "Coldest"
        follows the residents' usage ranking taken every ``swap_every`` tokens (4 without swap
        rounds), after that token's background moves (ascending, ties by id); when that ranking
        has too few such residents left, the layer is ranked afresh for this step."""
        layer = step.layer
        cache = self.cache
        need = len(pcie) - len(slots)
        if self._lru is not None:
            if self.swap_every:
                victims = _unused_residents(self._lru[layer], cache.state[layer], step.experts, need)
            else:
                victims = _recent_victims(self._lru[layer], cache.state[layer], step.experts, need)
            n_up = len(slots) + len(victims)
            slots = list(slots) + [cache.slot[(layer, v)] for v in victims]
            return Decision(step, hits, tuple(pcie[:n_up]), tuple(slots), tuple(pcie[n_up:]), cpu,
                            tuple((layer, v) for v in victims))
        u = self._u[layer]
        used = step.experts
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
        if d.uploads:
            self._take_slots(d)
        self.observe(d)

    def observe(self, d: Decision) -> None:
        """``commit`` less the cache's change: recency, usage, the share's reuse and the token's
        misses (a policy that shares this cache, ``lookahead``'s guard, commits ``d`` itself)."""
        layer = d.step.layer
        if self._lru is not None:
            order = self._lru[layer]
            to_end = order.move_to_end
            for e in d.step.experts:
                if e in order:
                    to_end(e)
                else:  # dropped by _recent_victims while absent
                    order[e] = None
        if self.share is not None:
            self.share.observe(layer, len(d.hits), len(d.step.experts))
            self.share.count(d)
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
        """Refresh every layer's admission ranking (after a swap round): one stable sort per row
        of the usage with every non-resident at +inf, the residents' part of each row kept."""
        mask = self._valid & self.cache.resident_mask
        order = np.argsort(np.where(mask, self._np, np.inf), axis=1, kind="stable")
        self._cold = [order[l, :n].tolist() for l, n in enumerate(mask.sum(axis=1).tolist())]

    # background ------------------------------------------------------------------------------
    def _swap_due(self) -> bool:
        return (bool(self.swap_every) and (self.tokens + 1) % self.swap_every == 0 and not self.background
                and (self.swap_while_filling or not any(self.cache.free)))

    def fill_cap(self) -> int:
        """Fills this token's ``plan_background`` may plan at most: ``max_fills``; with a cost
        model, at most what the link could have carried in the token's idle time (``CostShare.fill_cap``)."""
        return self.max_fills if self.share is None else self.share.fill_cap(self.max_fills)

    def plan_background(self) -> tuple[Move, ...]:
        cache = self.cache
        free_left = [len(f) for f in cache.free]
        fills: list[Move] = []
        taken: set[tuple[int, int]] = set()
        if self.adaptive and self.missed and any(free_left):
            u = self._u
            cands = [k for k in self.missed if k not in cache.slot and cache.pool_of[k[0]] >= 0]
            cands.sort(key=lambda k: -u[k[0]][k[1]])
            cap = self.fill_cap()
            for k in cands:
                if len(fills) >= cap:
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
        if len(sel) > self.max_moves:  # only a swap among the best max_moves by (gain, layer, expert) can be kept
            sel = sel[np.lexsort((ce[sel], cl[sel], -gain[sel]))[: self.max_moves]]
        swaps = list(zip((-gain[sel]).tolist(), cl[sel].tolist(), ce[sel].tolist(), [None] * len(sel),
                         ve[vidx[sel]].tolist()))
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
        self.observe_background(moves, swap_round)

    def placed(self, keys) -> None:
        """Experts made resident by another policy's moves on a shared cache (prefetch, fills):
        kept in the recency order as its least recent, so they stay victims."""
        if self._lru is not None:
            for layer, e in keys:
                order = self._lru[layer]
                if e not in order:
                    order[e] = None
                    order.move_to_end(e, last=False)

    def observe_background(self, moves: tuple[Move, ...], swap_round: bool = False) -> None:
        """``commit_background`` less the cache's change (a token's end; see ``observe``)."""
        self.background.update((m.layer, m.expert) for m in moves)
        if swap_round:
            self._np *= self.decay
        if self.admit_uploads and self._lru is None and (self.tokens + 1) % (self.swap_every or 4) == 0:
            self._rank_all_residents()  # usage admission's ranking (recency admission reads none)
        self.missed.clear()
        if self.share is not None:
            self.share.end_token()
        self._room = any(self.cache.free)  # hybrid frees no slot during a token
        self.tokens += 1


def prompt_room(cache, capacity: Capacity, layer: int) -> int:
    """Free slots a prompt chunk's step at ``layer`` may fill: the layer's share of its pool (the
    pool's slots over its layers, rounded down) less the layer's residents and copies in flight,
    and no more than the pool's free slots (so a pool shared by layers is not taken by the first)."""
    p = cache.pool_of[layer]
    if p < 0:
        return 0
    share = cache.size[p] // len(capacity.pools[p][0])
    held = len(cache.state[layer]) - cache.state[layer].tobytes().count(ABSENT)
    return max(min(share - held, len(cache.free[p])), 0)


def _unused_residents(order, state, used, need: int) -> list[int]:
    """The first ``need`` experts of ``order`` that are resident and not in ``used``."""
    out = []
    for v in order:
        if state[v] == RESIDENT and v not in used:
            out.append(v)
            if len(out) == need:
                break
    return out


def _recent_victims(order, state, used, need: int) -> list[int]:
    """``_unused_residents`` that drops the absent experts it passes from ``order``: with no swap
    rounds an absent expert becomes resident or in flight only when a step routes it, which puts
    it back at the end (``commit``), so the residents' order, and every answer, stay the same."""
    out, gone = [], []
    for v in order:
        s = state[v]
        if s == RESIDENT:
            if v not in used:
                out.append(v)
                if len(out) == need:
                    break
        elif s == ABSENT:
            gone.append(v)
    for v in gone:
        del order[v]
    return out


def _by_layer_then(layers: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Order of entries given in (layer, expert) order, sorted by layer, then key, then expert:
    two stable sorts (the same order as ``np.lexsort((experts, keys, layers))``, several times
    faster)."""
    o = np.argsort(keys, kind="stable")
    return o[np.argsort(layers[o], kind="stable")]


REUSE_SCALE = 32  # the reuse estimate's unit: 1/32 of a step's routes
REUSE_STEPS = 16  # steps of a layer over which its hit share is averaged (moving average)


class CostShare:
    """``hybrid``'s PCIe share from a cost model: how many of a step's misses go over PCIe.

    For ``k`` of the step's ``m`` eligible misses (ranked as ``hybrid`` ranks them) sent over PCIe
    and the rest, with the misses in flight, sent to the CPU pool in one call, the layer's
    predicted time is the cost model's (``CostModel.step_s``: the link, the GPU batches, the
    pool's call with its fixed costs and, with a hardware file's executor costs, the host thread,
    in the order the simulator charges them). Each miss left to the CPU is not cached, so its next
    route misses again: it is charged ``r * (min(cpu_s, upload_s + gpu_s) - gpu_s)`` (one-token
    costs), ``r`` being the layer's share of hits over its last ``REUSE_STEPS`` steps or so (an
    integer moving average, to 1/``REUSE_SCALE``), the chance that an expert just routed is routed
    again while it would still be cached. The ``k`` with the least time plus charges is chosen,
    ties going to more uploads. So when the pool is slower than uploading every miss, however few
    it takes, no miss goes to the CPU (in flight ones excepted). Decode steps (no token counts)
    are looked up by (hits, misses, in flight, ``r``) once computed. Deterministic given the cost
    model and the decisions: a simulator and an executor replaying one trace decide alike.

    Fills (``fill_cap``): after a token, at most as many as the link could have carried in the
    token's idle time (its steps' predicted times and dense parts, less their demand copies), and
    none after a step of several tokens (a prompt chunk: a burst of fills there delays the first
    decode tokens), as ``hybrid-cost`` caps them.
    """

    def __init__(self, cost_model: CostModel, num_layers: int):
        if len(cost_model.upload_s) != num_layers:
            raise ValueError(f"cost_model has {len(cost_model.upload_s)} layers, the model {num_layers}")
        self.costs = cost_model
        one = [(cost_model.gpu_s(l, 1), cost_model.cpu_s(l, 1), cost_model.upload_s[l]) for l in range(num_layers)]
        memos: dict[tuple[float, ...], dict] = {}
        self._one = one
        self._memo = [memos.setdefault(cost_model.decode_key(l), {}) for l in range(num_layers)]  # equal costs: shared
        self._avg = [0] * num_layers  # per layer, the hit share's moving average, in 1/2**16
        self.reuse = [0] * num_layers  # the same in 1/REUSE_SCALE (rounded down): the lookup key
        self._layer_s = cost_model.layer_s or (0.0,) * num_layers
        self._time_memo: list[dict] = [{} for _ in range(num_layers)]  # one-token steps: (hits, up, cpu) -> time
        moe = [l for l in range(num_layers) if cost_model.upload_s[l] > 0]
        self._up_mean = sum(cost_model.upload_s[l] for l in moe) / max(len(moe), 1)
        self._tok_s = self._tok_link_s = 0.0  # this token so far: predicted time, demand copies' link time
        self._tok_batch = False  # a step of this token ran several tokens

    def observe(self, layer: int, n_hits: int, n_experts: int) -> None:
        """Fold a committed step's hit share into the layer's moving average over about
        ``REUSE_STEPS`` steps (integers: the same on every machine)."""
        a = self._avg[layer]
        a += ((n_hits << 16) // n_experts - a) // REUSE_STEPS
        self._avg[layer] = a
        self.reuse[layer] = a * REUSE_SCALE >> 16

    def count(self, d: Decision) -> None:
        """Add committed decision ``d``'s predicted time (``CostModel.step_s`` of its split, one-token
        costs) and demand copies to its token's sums."""
        step = d.step
        if step.counts is not None:
            self._tok_batch = True
            return
        layer = step.layer
        n_up = len(d.uploads) + len(d.streams)
        key = (len(d.hits), n_up, len(d.cpu))
        memo = self._time_memo[layer]
        t = memo.get(key)
        if t is None:
            g, c, _ = self._one[layer]
            cm = self.costs
            t = memo[key] = cm.step_s(layer, key[0] * g, key[0], n_up * g, n_up, cm.pool_s(key[2] * c, key[2]))[0]
        self._tok_s += self._layer_s[layer] + t
        self._tok_link_s += n_up * self.costs.upload_s[layer]

    def fill_cap(self, max_fills: int) -> int:
        """Fills the token just ended may plan at most (see the class docstring)."""
        if self._tok_batch:
            return 0
        if self._up_mean <= 0:
            return max_fills
        return min(max_fills, max(int((self._tok_s - self._tok_link_s) / self._up_mean), 0))

    def end_token(self) -> None:
        self._tok_s = self._tok_link_s = 0.0
        self._tok_batch = False

    def uploads(self, step: Step, hits, eligible: list[int], n_busy: int, usage) -> int:
        """PCIe misses among ``eligible`` (the step's misses not in flight) for ``step`` with
        ``hits`` resident and ``n_busy`` misses in flight; ``usage``: the layer's decayed usage
        (ranks misses of equal token count, as ``hybrid`` does)."""
        layer, m = step.layer, len(eligible)
        if step.counts is None:
            key = (len(hits), m, n_busy, self.reuse[layer])
            memo = self._memo[layer]
            k = memo.get(key)
            if k is None:
                g, c, _ = self._one[layer]
                k = memo[key] = self.best(layer, len(hits) * g, len(hits), [g] * m, [c] * m, n_busy, n_busy * c)[0]
            return k
        cm, cnt = self.costs, dict(zip(step.experts, step.counts))
        ranked = sorted(eligible, key=lambda e: (-cnt[e], -usage[e]))
        busy = [e for e in step.experts if e not in hits and e not in eligible]
        return self.best(layer, sum([cm.gpu_s(layer, cnt[e]) for e in hits]), len(hits),
                         [cm.gpu_s(layer, cnt[e]) for e in ranked], [cm.cpu_s(layer, cnt[e]) for e in ranked],
                         n_busy, sum([cm.cpu_s(layer, cnt[e]) for e in busy]), one_token=False)[0]

    def best(self, layer: int, hits_s: float, n_hits: int, gpu: list[float], cpu: list[float], n_busy: int,
             busy_s: float, one_token: bool = True) -> tuple[int, float]:
        """The ``k`` minimising the layer's time (``CostModel.step_s``; ``hits_s``: the
        ``n_hits`` hits' GPU seconds; ``gpu``/``cpu``: each ranked miss's) + the CPU misses'
        reuse charge (see the class docstring), ties: the larger; and that ``k``'s time (no charge)."""
        m = len(gpu)
        cm = self.costs
        g, c, up = self._one[layer]
        charge = self.reuse[layer] / REUSE_SCALE * max(min(c, up + g) - g, 0.0)  # per miss left uncached
        rest = [0.0] * (m + 1)  # rest[k]: CPU time of misses k.. (suffix sums, exact per k)
        for i in range(m - 1, -1, -1):
            rest[i] = rest[i + 1] + cpu[i]
        best_k, best_t, best_s, up_gpu = 0, float("inf"), 0.0, 0.0
        for k in range(m + 1):
            pool = cm.pool_s(busy_s + rest[k], m - k + n_busy)
            s = cm.step_s(layer, hits_s, n_hits, up_gpu, k, pool, 0.0, one_token)[0]
            t = s + (m - k) * charge
            if t <= best_t:
                best_k, best_t, best_s = k, t, s
            if k < m:
                up_gpu += gpu[k]
        return best_k, best_s
