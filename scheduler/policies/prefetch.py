"""``hybrid-cost``'s cross-layer prefetch: the next layer's likely experts, in the link's idle time only.

After each one-token step at layer ``l`` (``plan_prefetch``), :class:`LinkPrefetch` forecasts the
next MoE layer ``n``'s routes and copies the likeliest absent experts of ``n`` while the link would
otherwise idle, so that they land before ``n``'s routes are known:

- *window*: the time from ``l``'s end to ``n``'s decision by the cost model (``n``'s dense part
  and router read-back, ``CostModel.layer_s``; with the executor's host lane also the host's lead
  after ``l``, ``LaneCosts.lead_s``, and its read-back and engine plan, ``LaneCosts.decide_s``), less the link work still queued at ``l``'s end (the
  policy's own model of the link's queue). At most ``window // upload_s[n]`` experts go, each
  charged the host's issue of a copy (``LaneCosts.copy_s``) too; none when the window holds none.
- *forecast*: an expert's chance to be routed at ``n`` is the larger of its *recurrence* (the share
  of ``n``'s recent steps that routed it: a moving average over about ``memory`` steps, prompt
  chunks counted by their tokens' share) and its *co-activation* with the step just run (for each
  expert ``e`` routed at ``l``, the decayed count of one-token steps in which ``e`` at ``l`` was
  followed by it at ``n`` over the decayed count of ``e``'s steps at ``l`` plus one; the largest
  over ``e``), both learnt online from the committed steps only. Experts below ``confidence`` are
  never copied.
- *slots*: a free slot of ``n``'s pool first; else the slot of ``n``'s least recently used resident
  (not in flight), and only when the guess is more likely than that resident by ``margin``
  (a resident as likely as the guess is never evicted for it). Such swaps are *audited*: each
  planned swap scores +1 if ``n``'s step routes its expert and -1 if it routes its victim; the
  score decays over 64 audited steps and swaps go only while it is positive (they are still planned
  and scored while held back, so they resume once they pay). Copies into free slots always go.
- *release*: a prefetched expert is placed least recent in the layer's recency order until a step
  routes it, so a wrong guess is the first victim of the next upload at its layer (the driver
  completes a prefetch before the next step, so a copy is not stopped in flight; its slot is
  given back).

Deterministic, no clock: the executor and the simulator replaying a trace decide alike.
"""
from __future__ import annotations

import numpy as np

from ..cache import ABSENT, RESIDENT
from ..core import Move, Step

__all__ = ["LinkPrefetch", "AUDIT_DECAY", "PREFETCH_GRID"]

# hybrid-cost's prefetch settings that experiments/policies_eval.py chooses among on its development
# set (leave-one-trace-out), each written out in full; the choice is HybridCostConfig's default
PREFETCH_GRID = tuple({"prefetch": n, "prefetch_fills": f, "prefetch_confidence": c}
                      for n, f, c in ((0, False, 0.5), (4, False, 0.3), (4, False, 0.5), (4, True, 0.3)))

AUDIT_DECAY = 1.0 - 1.0 / 64  # per audited step: the decay of the swap audit's score
HELD_MAX = 64  # held-over swaps kept at a token's end
RESCALE = 1e150  # co-activation weights grow by 1 / (1 - 1/memory) a step; renormalised past this


class LinkPrefetch:
    """The forecast, window, slots, audit and release of the module docstring, for a
    ``hybrid-cost`` policy (``owner``: its cache, recency order, cost model and link queue)."""

    def __init__(self, owner, most: int, confidence: float, margin: float, memory: float, fills: bool = False):
        g = owner.geometry
        L, E = g.num_layers, max(g.max_experts, 1)
        self.owner = owner
        self.most, self.confidence, self.margin = most, confidence, margin
        self.rate = 1.0 / memory
        self.grow = 1.0 / (1.0 - self.rate)
        moe = g.moe_layers
        self.next_layer = {l: moe[i + 1] for i, l in enumerate(moe[:-1])}  # the token's last layer: none
        # moving averages kept as sums of growing weights (a step's weight is 1 / (1 - 1/memory)
        # times the last one's), so that no step decays a whole row; renormalised past RESCALE
        self.recur = np.zeros((L, E))  # per layer: weighted routes of each expert
        self.r_weight = np.ones(L)  # per layer: the weight of its next step
        self.co_n = np.zeros((L, E))  # per layer l and expert e: weighted one-token steps routing e at l
        self.co = np.zeros((L, E, E))  # ... and of them, those followed by each expert at the next layer
        self._co_mv = memoryview(self.co.reshape(-1))
        self._co_rows = self.co.reshape(L * E, E)
        self.weight = np.ones(L)  # per layer, the weight of its next co-activation step
        # the rows as memoryviews: a step's few experts are updated faster from Python
        self._rrow = [memoryview(self.recur[l]) for l in range(L)]
        self._nrow = [memoryview(self.co_n[l]) for l in range(L)]
        self.prev = None  # this token's last one-token step: (layer, experts, its block's offset in co)
        self.E = E
        cm = owner.costs
        ln = cm.lane
        self.up_s = cm.upload_s
        layer_s = cm.layer_s or (0.0,) * L
        lead = ln.lead_s if ln is not None and ln.lead_s else (0.0,) * L
        extra = ln.decide_s if ln is not None else 0.0
        self.span = [layer_s[self.next_layer[l]] + lead[l] + extra if l in self.next_layer else 0.0
                     for l in range(L)]
        self.issue_s = ln.copy_s if ln is not None else 0.0
        # whether any layer's window can ever hold one copy (else the owner drops the prefetch: no move)
        least = min((self.up_s[l] for l in moe), default=0.0) + self.issue_s
        self.able = least <= 0.0 or any(sp >= least for sp in self.span)
        self.trials: dict[int, list[tuple[int, int]]] = {}  # layer -> planned swaps (expert, victim)
        self.gain = 0.0
        self.fills = fills
        self.tokens = 0  # tokens ended
        self.fill_trials: dict[int, list[tuple[int, int]]] = {}  # layer -> dispensed swaps (expert, victim)
        self.fill_gain = 0.0
        self.held: list[tuple[float, int, int]] = []  # (-recurrence, layer, expert) to dispense
        self.pending: dict[int, list[int]] = {}  # layer -> prefetched experts not yet seen by its step
        self.moved = 0  # prefetches issued
        self.used = 0  # of them, routed by their layer's next step

    # learning ----------------------------------------------------------------------------------
    def learn(self, step: Step) -> None:
        """A committed step: recurrence, co-activation with this token's previous step, the
        audit's score and the release of wrong guesses at its layer."""
        layer, experts = step.layer, step.experts
        w = float(self.r_weight[layer])
        if step.counts is None:  # a handful of experts: Python on memoryviews beats numpy's calls
            row = self._rrow[layer]
            for e in experts:
                row[e] += w
            prev = self.prev
            if prev is not None and self.next_layer.get(prev[0]) == layer:
                pl, pe, base = prev
                cw = float(self.weight[pl])
                row, co, E = self._nrow[pl], self._co_mv, self.E
                for e in pe:
                    row[e] += cw
                    r = base + e * E
                    for f in experts:
                        co[r + f] += cw
                cw *= self.grow
                if cw > RESCALE:
                    self.co_n[pl] /= cw
                    self.co[pl] /= cw
                    cw = 1.0
                self.weight[pl] = cw
            self.prev = (layer, experts, layer * self.E * self.E)
        else:  # a prompt chunk: each expert's share of its tokens
            c = np.asarray(step.counts, dtype=np.float64)
            self.recur[layer, list(experts)] += w * np.minimum(c * (self.owner.geometry.top_k / c.sum()), 1.0)
            self.prev = None
        w *= self.grow
        if w > RESCALE:
            self.recur[layer] /= w
            w = 1.0
        self.r_weight[layer] = w
        tried = self.trials.pop(layer, None)
        if tried:
            used = set(experts)
            self.gain = self.gain * AUDIT_DECAY + sum((e in used) - (v in used) for e, v in tried)
        tried = self.fill_trials.pop(layer, None)
        if tried:
            used = set(experts)
            self.fill_gain = self.fill_gain * AUDIT_DECAY + sum((e in used) - (v in used) for e, v in tried)
        wrong = self.pending.pop(layer, None)
        if wrong:
            used = set(experts)
            self.used += sum(e in used for e in wrong)

    def end_token(self) -> None:
        self.prev = None
        self.tokens += 1
        self.hold()

    def hold(self) -> None:
        """At a token's end (``fills``): the swaps to dispense in the next token's layer windows,
        per MoE layer the absent experts of recurrence >= ``confidence``, best first."""
        owner = self.owner
        self.held = []
        if not self.fills or owner._lru is None:
            return
        cache = owner.cache
        out = []
        for l in owner.geometry.moe_layers:
            p = cache.pool_of[l]
            if p < 0 or cache.size[p] == 0:
                continue
            r = self.recurrence(l)[:owner.geometry.num_experts[l]]
            cand = np.flatnonzero((r >= self.confidence) & (cache._view[l, :len(r)] == ABSENT))
            out += [(-float(r[e]), l, e) for e in cand.tolist()]
        out.sort()
        self.held = out[:HELD_MAX]

    def recurrence(self, layer: int) -> np.ndarray:
        """(max_experts,) each expert's routes per step of ``layer``, moving average (a new array)."""
        return self.recur[layer] * (self.rate / self.r_weight[layer])

    def forecast(self, layer: int, nl: int, experts) -> np.ndarray:
        """(max_experts,) chance of each expert of ``nl`` to be routed at its next step, after a
        step of ``layer`` routing ``experts`` (module docstring)."""
        p = self.recurrence(nl)
        row = self._nrow[layer]
        n = [row[e] for e in experts]
        if max(n) > 0.0:
            w, E = float(self.weight[layer]), self.E
            co = self._co_rows[[layer * E + e for e in experts]]
            co /= np.array([x + w for x in n])[:, None]
            np.maximum(p, co.max(axis=0), out=p)
        return p

    # planning ----------------------------------------------------------------------------------
    def plan(self, step: Step, queued_s: float) -> tuple[Move, ...]:
        """The prefetch after ``step`` (one-token steps only) with ``queued_s`` seconds of link
        work left at its end: the next layer's likely experts, then held-over swaps."""
        if step.counts is not None:
            return ()
        layer = step.layer
        nl = self.next_layer.get(layer)
        if nl is None:
            return ()
        window = self.span[layer] - queued_s
        moves: list[Move] = []
        if self.most and window >= self.up_s[nl] > 0.0:
            moves = self._next(step, nl, min(int(window / (self.up_s[nl] + self.issue_s)), self.most))
            window -= len(moves) * (self.up_s[nl] + self.issue_s)
        if self.held and window > 0.0:
            moves += self._dispense(window, moves)
        return tuple(moves)

    def _next(self, step: Step, nl: int, room: int) -> list[Move]:
        owner = self.owner
        cache = owner.cache
        p = cache.pool_of[nl]
        if room <= 0 or p < 0 or cache.size[p] == 0:
            return []
        f = self.forecast(step.layer, nl, step.experts)
        n = owner.geometry.num_experts[nl]
        row = cache.state[nl]
        absent = cache._view[nl, :n] == ABSENT
        if room == 1:  # the likeliest absent expert (the first of equals), if likely enough
            g = np.where(absent, f[:n], -1.0)
            e = int(g.argmax())
            if g[e] < self.confidence:
                return []
            cands = [e]
        else:
            idx = np.flatnonzero((f[:n] >= self.confidence) & absent)
            if not len(idx):
                return []
            cands = idx[np.argsort(-f[idx], kind="stable")][:room].tolist()
        free = cache.free_slots(nl, len(cands))
        moves = [Move(nl, e, s, None, float(f[e])) for e, s in zip(cands, free)]
        rest = cands[len(free):]
        if rest and owner._lru is not None:
            swaps = []
            victims = _victims(owner._lru[nl], row, len(rest))
            for e, v in zip(rest, victims):
                if f[e] < f[v] + self.margin:
                    break
                swaps.append(Move(nl, e, cache.slot[(nl, v)], (nl, v), float(f[e] - f[v])))
            if swaps:
                self.trials[nl] = [(m.expert, m.victim[1]) for m in swaps]
                if self.gain > 0.0:
                    moves += swaps
        return moves

    def _dispense(self, window: float, taken: list[Move]) -> list[Move]:
        """Held-over swaps that still apply and fit ``window`` (seconds of link time), best first:
        the expert still absent, the victim its layer's least recently used resident now (not
        taken), less likely by ``margin``. Planned swaps are audited whether issued or not."""
        owner = self.owner
        cache = owner.cache
        keys = {(m.layer, m.expert) for m in taken}
        victims = {m.victim for m in taken if m.victim is not None}
        out, keep, tried = [], [], []
        for item in self.held:
            _, l, e = item
            row = cache.state[l]
            if row[e] != ABSENT or (l, e) in keys:
                continue
            u = self.up_s[l] + self.issue_s
            if u > window:
                keep.append(item)
                continue
            v = next((v for v in _victims(owner._lru[l], row, 4) if (l, v) not in victims), None)
            r = self.recurrence(l)
            if v is None or r[e] < r[v] + self.margin:
                continue
            tried.append(Move(l, e, cache.slot[(l, v)], (l, v), float(r[e] - r[v])))
            window -= u
            keys.add((l, e))
            victims.add((l, v))
        self.held = keep
        for m in tried:
            self.fill_trials.setdefault(m.layer, []).append((m.expert, m.victim[1]))
        if self.fill_gain > 0.0:
            out = tried
        return out

    def committed(self, moves: tuple[Move, ...]) -> float:
        """Prefetch ``moves`` were committed on the owner's cache: place them least recent in
        their layer's recency order; returns their link time."""
        order = self.owner._lru
        link = 0.0
        for m in moves:
            if order is not None:
                o = order[m.layer]
                o.pop(m.expert, None)
                o[m.expert] = None
                o.move_to_end(m.expert, last=False)
            self.pending.setdefault(m.layer, []).append(m.expert)
            link += self.up_s[m.layer]
        self.moved += len(moves)
        return link


def _victims(order, row, need: int) -> list[int]:
    """The first ``need`` residents (not in flight) of a recency order, least recent first."""
    out = []
    for v in order:
        if row[v] == RESIDENT:
            out.append(v)
            if len(out) == need:
                break
    return out
