"""``lookahead``: forecasts and a cost model together; every move has to earn its link time.

Per step, with a :class:`~scheduler.costmodel.CostModel` (the simulator's timing model, or a
calibration):

- *split*: the step's misses are ranked by their value (below), highest first, ties by their routes
  so far (``uses``, as ``hybrid`` ranks its misses), then router rank; the first ``n`` go over PCIe
  and the rest to the CPU pool, with ``n`` the one whose predicted layer time, less what the
  uploads are worth later, is least (the largest ``n`` within ``slack``, a share of the fastest
  split's time). The layer time is the simulator's: the hits as one GPU batch; the uploads after the
  link's queue, then their own batch (``gpu_batch_s``); the pool's task, its experts and the hidden
  state's copies (``cpu_copy_s``), then the combine (``cpu_combine_s``). An upload is worth
  ``reuse_weight`` x (its value - its victim's, or 0) x one CPU expert's time, which grows with
  ``n``, so with ``slack`` 0 the all-upload plan (``lru``'s) is never predicted faster than the one
  chosen. Misses still in flight go to the CPU. An upload beyond the free slots takes the slot of
  the pool's resident of lowest value the step does not use, if the upload's value is at least
  that; otherwise it is streamed;
- *prefetch* (``plan_prefetch``, after each step): the link is modelled as a queue (what the
  policy put on it, draining while layers run); the next MoE layer's dense part, less that queue,
  is the window in which it would idle. Into it go, best first, at most ``max_prefetch`` of the
  next layer's experts whose forecast value is at least ``confidence`` (into free slots or over
  residents worth at least ``margin`` less), then fills held over from the last token's end (still
  absent, their victims still resident and not routed since); the batch lands before the next
  layer's routes are known, so by the model it delays nothing;
- *release*: a prefetched expert that the next step of its layer does not route was forecast
  wrong: until it is routed it ranks below every other resident as a victim (the driver completes
  a prefetch before the next step is planned, so it cannot be stopped in flight; its slot is what
  is given back);
- *fills* (``plan_background``, after each token): within ``fill_share`` of the time the link
  idled in the token (its predicted time less the policy's copies), non-residents of highest fill
  value take free slots, then replace residents of lower value (by ``margin`` x top_k / experts),
  best gains first. How many go at the token's end (``fill_window``): ``"priced"``, the most whose
  predicted delay of the token just ended, replayed layer by layer with them queued on the link
  ahead of it (each layer's split chosen again), is at most their worth, ``fill_price`` x the
  share of fills routed at their layer's first step once landed (``HIT_MEMORY``) x one expert's
  CPU time each; ``"windows"``, first as many as the next token's layer windows carry (dense part
  over upload, summed) held over, to land within that token, not after it, the rest ``"priced"``;
  ``"demand"``, those that land before that token's first upload that its split wanted with the
  link free; ``"idle"``, all. The rest are held over for the next token's layer windows
  (prefetch, above), so demand uploads never queue behind them;
- *audit* (``audit=True``): every swap the prefetch or the fills plan (issued or not) is scored at
  the first step of its layer that it could serve (a fill lands a token later): +1 when its expert
  is routed there, -1 for each step until then that routes its victim; the score decays over 64
  audited steps. Until a kind's score is positive its swaps are held back (its moves into free
  slots still go) and still scored, so they go once they have shown that they pay;
- *guard* (``guard_memory`` > 0, ``LookaheadPolicy``; ``guard.py``): a shadow ``hybrid`` priced by
  the same model; while it is predicted faster (by ``guard_margin``) over the last
  ``guard_memory`` tokens, the next ``guard_probe`` tokens follow hybrid (on this cache, evicting
  first what hybrid's lacks; once it holds hybrid's experts, exactly hybrid's decisions).

Values come from ``value`` / ``next_value`` / ``fill_value``: :class:`LookaheadPolicy` learns them online,
never from later steps; ``oracle`` (``oracle.py``) gives them from the future. ``plan`` reads the state only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache import ABSENT, INFLIGHT, RESIDENT
from ..core import Capacity, Decision, Geometry, Move, Step
from ..costmodel import CostModel
from ..profile import Profile
from .base import MAX_FILLS_PER_TOKEN, BasePolicy
from .guard import Guard
from .predict import PredictConfig, PredictPolicy

__all__ = ["LookaheadConfig", "LookaheadPolicy", "CostPlanner"]


VALUES = ("forecast", "recency", "frequency")  # lookahead's value functions (LookaheadPolicy)
AUDIT_DECAY = 1.0 - 1.0 / 64  # per audited step: the decay of the swap audit's score
AUDIT_MIN = 0.0  # swaps go only while the audit's score is above this (they have to prove themselves)
ADAPTIVE = ("recency", "frequency")  # values="adaptive" chooses between these
SHADOW_MEMORY = 64.0  # steps: the decay of the shadow caches' hit counts (values="adaptive")
ADAPT_MARGIN = 0.05  # the second value function replaces the first only when its shadow hits this much more
PRICED_MAX = 64  # fill_window="priced": fills per token end priced at most
HIT_MEMORY = 32.0  # fills: the decay of the share routed at their layer's first step after they land


def _split(rec, queued: float) -> tuple[int, list[float]]:
    """(uploads, predicted layer time for each number of uploads) of a split record (``plan``)
    with ``queued`` seconds of link work ahead of its copies: the least time less worth, the
    most uploads within ``slack`` x the fastest."""
    rows, comb, slack = rec
    times, score = [], []
    for pre, dl, link, post, cpu, on_cpu, wv in rows:
        g = max(pre, (queued if queued > dl else dl) + link) + post if link else pre
        t = (g if g > cpu else cpu) + comb if on_cpu else g
        times.append(t)
        score.append(t - wv)
    best = min(score) + slack * min(times) + 1e-15
    return max(i for i, x in enumerate(score) if x <= best), times


def _replay(want, queue: float) -> float:
    """Predicted time of a token's layers (``want``: their records) with ``queue`` seconds of
    link work at its start, each layer's split chosen again."""
    total = 0.0
    for _, _, window, rec in want:
        queued = queue - window if queue > window else 0.0
        if isinstance(rec, float):  # every expert a hit
            t = rec
            queue = queued - t if queued > t else 0.0
        else:
            n, times = _split(rec, queued)
            t = times[n]
            queue = 0.0 if n else (queued - t if queued > t else 0.0)
        total += window + t
    return total


def _absent(scores: np.ndarray, row, ok=None) -> list[int]:
    """Experts by ``scores``, highest first (stable), that are ABSENT in ``row`` (a cache state row)
    and, if given, true in ``ok`` (a bool array); numpy over the row's bytes."""
    order = np.argsort(-scores, kind="stable")
    keep = np.frombuffer(row, np.uint8)[order] == ABSENT
    return order[keep if ok is None else keep & ok[order]].tolist()


@dataclass(frozen=True)
class LookaheadConfig:
    """``lookahead``'s knobs (see the module docstring); an error names the field.

    ``confidence`` in [0, 1] (forecast routes at the next step to prefetch), ``margin`` >= 0,
    ``max_prefetch`` in 0..``MAX_FILLS_PER_TOKEN``, ``fill_share`` in [0, 1], ``slack`` >= 0,
    ``memory`` > 1 (steps, the forecaster's), ``reuse_weight`` >= 0, ``fills`` ("values" or
    "frequency"), ``values`` (``VALUES`` or "adaptive"), ``audit``, ``fill_window`` ("windows",
    "priced", "demand" or "idle"), ``fill_price`` >= 0, ``guard_memory`` 0 (no guard) or > 1
    (tokens), ``guard_margin`` in [0, 1), ``guard_probe`` >= 1, ``guard_backoff`` >= 1 (guard.py).
    ``fill_price`` defaults to the grid configuration (``simulate.heldout.LOOKAHEAD_GRID``) that
    ``experiments/policies_eval.py`` chooses on its development set; the guard's fields,
    ``fill_window`` and ``values`` to an earlier grid's choice there; the other
    defaults and the module's constants were set by hand on that set; the held-out figures are on
    test families no tuning saw.
    """

    confidence: float = 0.3
    margin: float = 0.1
    max_prefetch: int = 8
    fill_share: float = 1.0
    slack: float = 0.0
    memory: float = 16.0
    reuse_weight: float = 0.25
    fills: str = "values"
    values: str = "adaptive"
    audit: bool = True
    fill_window: str = "windows"
    fill_price: float = 2.0
    guard_memory: float = 32.0
    guard_margin: float = 0.01
    guard_probe: int = 32
    guard_backoff: float = 1.0

    def __post_init__(self) -> None:
        for name, allowed in (("fills", ("frequency", "values", "long")), ("fill_window", ("windows", "priced", "demand",
                              "idle")), ("values", VALUES + ("adaptive",))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"lookahead {name}: {getattr(self, name)!r}, expected one of {', '.join(allowed)}")
        checks = {"confidence": 0.0 <= self.confidence <= 1.0, "margin": self.margin >= 0.0,
                  "max_prefetch": 0 <= self.max_prefetch <= MAX_FILLS_PER_TOKEN, "fill_share": 0.0 <= self.fill_share <= 1.0,
                  "slack": self.slack >= 0.0, "memory": self.memory > 1.0, "reuse_weight": self.reuse_weight >= 0.0,
                  "fill_price": self.fill_price >= 0.0, "guard_memory": self.guard_memory == 0.0 or self.guard_memory > 1.0,
                  "guard_margin": 0.0 <= self.guard_margin < 1.0, "guard_probe": self.guard_probe >= 1,
                  "guard_backoff": self.guard_backoff >= 1.0}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"lookahead {name}: {getattr(self, name)} out of range (see LookaheadConfig)")


class CostPlanner(BasePolicy):
    """The split, admission, prefetch, release and fills of the module docstring, over values
    that a subclass supplies (``value``, ``next_value``, ``fill_value``, ``learn``)."""

    name = "cost-planner"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None, cost_model: CostModel | None,
                 config: LookaheadConfig):
        if cost_model is None:
            raise ValueError(f"policy {self.name!r} needs cost_model= (scheduler.CostModel)")
        if len(cost_model.upload_s) != geometry.num_layers:
            raise ValueError(f"cost_model has {len(cost_model.upload_s)} layers, the model {geometry.num_layers}")
        self.config = config
        self.costs = cost_model
        L = geometry.num_layers
        self.up_s = cost_model.upload_s
        self.layer_s = cost_model.layer_s or (0.0,) * L
        self._queue = 0.0  # link work left when the last committed layer ended
        self._token_s = 0.0  # predicted time of the current token so far
        self._link_s = 0.0  # link time the policy used in it
        self._planned = None  # (decision, layer time, link work left)
        self.split_times: list[float] = []
        self._ending = False  # plan_background was called: the next commit_background ends a token
        self._pf: set[tuple[int, int]] = set()  # prefetched, not yet seen by their layer's next step
        self._wrong: set[tuple[int, int]] = set()  # prefetched and not routed: first victims
        # swap audit: each planned swap (issued or held back), scored at its layer's next step
        self._trials: dict[str, dict[int, list[tuple[int, int]]]] = {"prefetch": {}, "fill": {}, "fill2": {}}
        self._gain = {"prefetch": 0.0, "fill": 0.0}
        self._want: list[tuple[float, float]] = []  # this token: (layer start, link time its split wanted)
        self._first = 0.0  # the last token's time until its first wanted upload (0: none yet)
        self._spare: list[Move] = []  # fills planned at the last token's end that did not fit its window
        self._spare_keys: set[tuple[int, int]] = set()  # of the batch in flight: fills, not prefetches
        self._routed: set[tuple[int, int]] = set()  # routed in the current token
        self._watch: dict[tuple[int, int], None] = {}  # fills not yet seen by a step of their layer
        self._hit = 0.5  # share of fills routed at their layer's first step once landed (decayed)
        moe = geometry.moe_layers
        self.next_layer = {l: moe[(i + 1) % len(moe)] for i, l in enumerate(moe)}
        self.uses = np.zeros((L, max(geometry.max_experts, 1)))  # routes so far (LookaheadPolicy's learn)
        self.guard: Guard | None = None  # lookahead's: hybrid's decisions while its own moves do not pay
        super().__init__(geometry, capacity, profile)

    # values (subclasses) ---------------------------------------------------------------------
    def value(self, layer: int, experts=None) -> np.ndarray:
        """(max_experts,) worth of keeping each expert of ``layer`` resident, higher better; after
        a step of ``layer`` that routes ``experts`` (None: after its last committed step)."""
        raise NotImplementedError

    def next_value(self, step: Step, layer: int) -> np.ndarray:
        """(max_experts,) expected routes of each expert of ``layer`` at its next step, known
        after ``step`` (the step just committed)."""
        raise NotImplementedError

    def fill_value(self, layer: int) -> np.ndarray:
        """(max_experts,) long-run worth of each expert of ``layer`` for background fills."""
        raise NotImplementedError

    def fillable(self, layer: int) -> np.ndarray | None:
        """Which experts of ``layer`` a fill may bring in (a bool array; None, the default: all)."""
        return None

    def learn(self, step: Step) -> None:
        """A step was committed (statistics may change)."""

    def end_token(self) -> None:
        """A token ended."""

    # steps -----------------------------------------------------------------------------------
    def _times(self, layer: int, step: Step):
        """Per-expert GPU and CPU seconds of ``step``'s experts (dicts by expert)."""
        cm = self.costs
        if step.counts is None:
            g, c = cm.gpu_s(layer, 1), cm.cpu_s(layer, 1)
            return dict.fromkeys(step.experts, g), dict.fromkeys(step.experts, c)
        return ({e: cm.gpu_s(layer, n) for e, n in zip(step.experts, step.counts)},
                {e: cm.cpu_s(layer, n) for e, n in zip(step.experts, step.counts)})

    def plan(self, step: Step) -> Decision:
        if self.guard is not None and self.guard.active:
            d, t, left = self.guard.plan(step, self._queue)
            self._planned = (d, t, left, 0.0, t)
            return d
        layer, cache = step.layer, self.cache
        state = cache.state[layer]
        experts = step.experts
        queued = max(self._queue - self.layer_s[layer], 0.0)
        gt, ct = self._times(layer, step)
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        gpu = sum(gt[e] for e in hits)
        if len(hits) == len(experts):
            d = Decision(step, experts)
            self._planned = (d, gpu, max(queued - gpu, 0.0), 0.0, gpu)
            return d
        busy = [e for e in experts if state[e] == INFLIGHT]
        elig = [e for e in experts if state[e] == ABSENT]
        v = self.value(layer, experts)
        u = self.uses[layer]
        elig.sort(key=lambda e: (-v[e], -u[e]))  # stable: routes so far, then router rank break ties
        cm = self.costs
        task, delay, up = cm.cpu_task_s + cm.cpu_copy_s, cm.cpu_delay_s, self.up_s[layer]
        batch, comb = cm.gpu_batch_s, cm.cpu_combine_s
        gpu_h = gpu + batch if hits else 0.0
        rec, worth = [], 0.0  # per n: (GPU ready, CPU delay, link time, GPU after the copies, CPU end, pool used, worth)
        cpu_all = sum(ct[e] for e in elig) + sum(ct[e] for e in busy)
        g_up = cpu_up = 0.0
        # what an upload is worth later: its value over its victim's (free slots first), times
        # the CPU time of a miss, times reuse_weight
        n_free = cache.num_free(layer)
        vict = [q for q, _ in self._ranked(layer, v, set(experts))] if len(elig) > n_free and self.config.reuse_weight else []
        w = self.config.reuse_weight * ct[elig[0]] if elig else 0.0
        for n in range(len(elig) + 1):
            if n:
                e = elig[n - 1]
                g_up += gt[e]
                cpu_up += ct[e]
                j = n - 1 - n_free
                base = 0.0 if j < 0 else (max(vict[j], 0.0) if j < len(vict) else float(v[e]))
                worth += w * max(float(v[e]) - base, 0.0)
            on_cpu = bool(n < len(elig) or busy)
            dl = delay if on_cpu else 0.0
            rec.append((gpu_h + dl, dl, n * up, batch + g_up if n else 0.0,
                        task + cpu_all - cpu_up if on_cpu else 0.0, on_cpu, worth))
        rec = (tuple(rec), comb, self.config.slack)
        n, times = _split(rec, queued)
        self.split_times = times  # predicted layer time with the first n misses over PCIe (read by tests)
        n0 = _split(rec, 0.0)[0]  # the split it would want with the link free
        pcie, cpu_experts = elig[:n], elig[n:] + busy
        t = times[n]
        left = 0.0 if n else max(queued - t, 0.0)
        cpu = tuple(e for e in experts if e in cpu_experts)
        slots = cache.free_slots(layer, len(pcie))
        uploads, evictions, streams = list(pcie[:len(slots)]), [], []
        rest = pcie[len(slots):]
        if rest:
            victims = self._ranked(layer, v, set(experts))
            for e in rest:
                if victims and v[e] >= victims[0][0]:
                    key = victims.pop(0)[1]
                    uploads.append(e)
                    slots.append(cache.slot[key])
                    evictions.append(key)
                else:
                    streams.append(e)
        d = Decision(step, hits, tuple(uploads), tuple(slots), tuple(streams), cpu, tuple(evictions))
        self._planned = (d, t, left, n0 * up, rec)
        return d

    def _ranked(self, layer: int, v: np.ndarray, used=()) -> list[tuple[float, tuple[int, int]]]:
        """(value, key) of the residents of ``layer``'s pool but ``layer``'s experts in ``used``,
        lowest first (released prefetches below all; ties by layer, expert); ``v`` values
        ``layer``'s, other layers of a shared pool their own ``value``."""
        cache = self.cache
        p = cache.pool_of[layer]
        state, wrong = cache.state, self._wrong
        memo = {layer: v}
        out = []
        for k in cache.owner[p]:
            if k is None or state[k[0]][k[1]] != RESIDENT or (k[0] == layer and k[1] in used):
                continue
            q = memo.get(k[0])
            if q is None:
                q = memo[k[0]] = self.value(k[0])
            out.append((-1.0 if k in wrong else float(q[k[1]]), k))
        out.sort()
        return out

    def commit(self, d: Decision) -> None:
        if self._planned is not None and self._planned[0] is d:
            _, t, left, want, rec = self._planned
        else:
            t, left, want, rec = 0.0, 0.0, 0.0, 0.0
        self._planned = None
        layer = d.step.layer
        if self._watch:
            self._score_fills(layer, d.step.experts)
        self._take_slots(d)
        if self.guard is not None:
            self.guard.step(d)
        self._queue = left
        self._want.append((self._token_s + self.layer_s[layer], want, self.layer_s[layer], rec))
        self._routed.update((layer, e) for e in d.step.experts)
        self._token_s += self.layer_s[layer] + t
        self._link_s += (len(d.uploads) + len(d.streams)) * self.up_s[layer]
        used = set(d.step.experts)
        for k in [k for k in self._pf if k[0] == layer]:
            self._pf.discard(k)
            if k[1] not in used:
                self._wrong.add(k)
        if self._wrong:
            self._wrong.difference_update((layer, e) for e in used)
        trials = self._trials
        tried = trials["prefetch"].pop(layer, None)
        if tried:
            self._gain["prefetch"] = self._gain["prefetch"] * AUDIT_DECAY + sum((e in used) - (v in used) for e, v in tried)
        landed = trials["fill2"].pop(layer, None)  # a fill lands a token later: scored at the step after
        tried = trials["fill"].pop(layer, None)  # its victim is lost from the next step on
        if tried or landed:
            self._gain["fill"] = (self._gain["fill"] * AUDIT_DECAY - sum(v in used for _, v in tried or ())
                                  + sum((e in used) - (v in used) for e, v in landed or ()))
        if tried:
            trials["fill2"][layer] = tried
        self.learn(d.step)

    def _score_fills(self, layer: int, used) -> None:
        """Fills of ``layer`` resident (or evicted) by now: the share routed, decayed."""
        row = self.cache.state[layer]
        for k in [k for k in self._watch if k[0] == layer and row[k[1]] != INFLIGHT]:
            del self._watch[k]
            self._hit += ((row[k[1]] == RESIDENT and k[1] in used) - self._hit) / HIT_MEMORY

    def _swaps_ok(self, kind: str, moves: list[Move]) -> list[Move]:
        """``moves`` less their swaps unless the audit of ``kind`` says swaps lately brought more
        routes than they lost; every swap planned is put on trial (module docstring: audit)."""
        if not self.config.audit:
            return moves
        for m in moves:
            if m.victim is not None and m.victim[0] == m.layer:
                self._trials[kind].setdefault(m.layer, []).append((m.expert, m.victim[1]))
        if self._gain[kind] > AUDIT_MIN:
            return moves
        return [m for m in moves if m.victim is None]

    # prefetch --------------------------------------------------------------------------------
    def plan_prefetch(self, step: Step) -> tuple[Move, ...]:
        """Within the next layer's idle window (the link's queue drained before its routes are
        known): the next layer's likeliest experts, then fills held over from the last token's end
        (module docstring)."""
        cfg = self.config
        if self.guard is not None and self.guard.active:
            self._spare_keys = set()
            return ()
        nl = self.next_layer[step.layer]
        window = self.layer_s[nl] - self._queue
        moves: list[Move] = []
        if cfg.max_prefetch and window > 0:
            moves = self._prefetch(step, nl, window)
        window -= sum(self.up_s[m.layer] for m in moves)
        self._spare_keys = set()
        if self._spare and window > 0:
            fills = self._dispense(window, moves)
            self._spare_keys = {(m.layer, m.expert) for m in fills}
            moves += fills
        return tuple(moves)

    def _prefetch(self, step: Step, nl: int, window: float) -> list[Move]:
        cfg = self.config
        cache = self.cache
        p = cache.pool_of[nl]
        if p < 0 or cache.size[p] == 0:
            return []
        room = int(window // self.up_s[nl]) if self.up_s[nl] > 0 else cfg.max_prefetch
        room = min(room, cfg.max_prefetch)
        if room <= 0:
            return []
        r = self.next_value(step, nl)
        n = self.geometry.num_experts[nl]
        row = cache.state[nl]
        cands = _absent(r[:n], row, r[:n] >= cfg.confidence)
        if not cands:
            return []
        free = cache.free_slots(nl, len(cands))
        moves = [Move(nl, e, s, None, float(r[e])) for e, s in zip(cands[:room], free)]
        if len(moves) < room and len(cands) > len(free):
            for e, (vq, key) in zip(cands[len(free):], self._ranked(nl, r)):
                gain = float(r[e]) - vq
                if gain < cfg.margin or len(moves) == room:
                    break
                moves.append(Move(nl, e, cache.slot[key], key, gain))
        self._trials["prefetch"].pop(nl, None)
        return self._swaps_ok("prefetch", moves)

    def _dispense(self, window: float, taken: list[Move]) -> list[Move]:
        """Held-over fills that still apply and fit ``window`` (seconds of link time), best first:
        a fill's expert still absent, its slot still free (or another free one of its pool), its
        victim still resident in that slot and not routed since the fills were planned."""
        cache = self.cache
        keys = {(m.layer, m.expert) for m in taken}
        victims = {m.victim for m in taken if m.victim is not None}
        used = {(cache.pool_of[m.layer], m.slot) for m in taken}
        out: list[Move] = []
        keep: list[Move] = []
        for m in self._spare:
            key, u = (m.layer, m.expert), self.up_s[m.layer]
            if cache.state[m.layer][m.expert] != ABSENT or key in keys:
                continue  # routed in (or prefetched) since: nothing to fill
            p = cache.pool_of[m.layer]
            if m.victim is None:
                slot = next((s for s in reversed(cache.free[p]) if (p, s) not in used), None)
                if slot is None:
                    continue
                m = Move(m.layer, m.expert, slot, None, m.gain)
            elif (cache.slot.get(m.victim) != m.slot or m.victim in self._routed or m.victim in victims
                  or cache.state[m.victim[0]][m.victim[1]] != RESIDENT):
                continue
            if u > window:
                keep.append(m)
                continue
            window -= u
            out.append(m)
            keys.add(key)
            used.add((p, m.slot))
            if m.victim is not None:
                victims.add(m.victim)
        self._spare = keep
        return out

    def plan_background(self) -> tuple[Move, ...]:
        """Fills while the link would idle (module docstring); marks the token's end."""
        self._ending = True
        share = self.config.fill_share
        want, self._want = self._want, []
        self._spare = []
        if self.guard is not None:
            self.guard.decide(self._token_s)
            if self.guard.active:
                return self.guard.plan_background()
        if not share:
            return ()
        cache = self.cache
        up = [self.up_s[l] for l in self.geometry.moe_layers]
        mean_up = sum(up) / len(up) if up else 0.0
        budget = share * (self._token_s - self._link_s) - self._queue
        if mean_up <= 0 or budget < mean_up:
            return ()
        room = min(int(budget // mean_up), MAX_FILLS_PER_TOKEN)
        moves: list[Move] = []
        taken: set[tuple[int, int]] = set()
        g = self.geometry
        margin = self.config.margin * g.top_k / g.max_experts  # in routes per step: a share of a uniform expert's
        for l in self.geometry.moe_layers:
            p = cache.pool_of[l]
            if p < 0 or cache.size[p] == 0:
                continue
            f = self.fill_value(l)
            row = cache.state[l]
            n = self.geometry.num_experts[l]
            cands = _absent(f[:n], row, self.fillable(l))
            if not cands:
                continue
            free = [s for s in cache.free_slots(l, len(cands))]
            for e, s in zip(cands, free):
                if f[e] > 0.0:
                    moves.append(Move(l, e, s, None, float(f[e])))
            victims = [(vq, k) for vq, k in self._ranked_fill(l, f) if k not in taken]
            for e, (vq, key) in zip(cands[len(free):], victims):
                gain = float(f[e]) - vq
                if gain < margin:
                    break
                taken.add(key)
                moves.append(Move(l, e, cache.slot[key], key, gain))
        moves.sort(key=lambda m: -m.gain)
        moves = self._swaps_ok("fill", moves[:room])
        mode = self.config.fill_window
        if mode == "idle" or not moves:
            return tuple(moves)
        if mode == "demand":
            # only what lands before the next token's first upload (the last token's, with the
            # link free); the rest is held over for the next token's layer windows
            first = min((t for t, w, _, _ in want if w > 0), default=budget + self._queue) - self._queue
            n, spent = 0, 0.0
            while n < len(moves) and spent + self.up_s[moves[n].layer] <= first:
                spent += self.up_s[moves[n].layer]
                n += 1
        else:  # priced (windows: first what the next token's layer windows carry, held over; the rest priced)
            room = sum(int(self.layer_s[l] // self.up_s[l]) for l in g.moe_layers if self.up_s[l] > 0)
            hold, moves = (moves[:room], moves[room:]) if mode == "windows" else ([], moves)
            base, n, q, worth, price = _replay(want, self._queue), 0, self._queue, 0.0, self.config.fill_price * self._hit
            for i, m in enumerate(moves[:PRICED_MAX]):
                q += self.up_s[m.layer]
                worth += price * self.costs.cpu_s(m.layer, 1)
                if _replay(want, q) - base <= worth + 1e-15:
                    n = i + 1
            self._spare = hold
        self._spare = self._spare + moves[n:]
        return tuple(moves[:n])

    def complete(self, layer: int, expert: int) -> None:
        super().complete(layer, expert)
        if self.guard is not None:
            self.guard.complete(layer, expert)

    def _ranked_fill(self, layer: int, f: np.ndarray) -> list[tuple[float, tuple[int, int]]]:
        """Residents of ``layer``'s pool by fill value, lowest first (released prefetches below)."""
        cache = self.cache
        p = cache.pool_of[layer]
        out = []
        memo = {layer: f}
        for k in cache.owner[p]:
            if k is None or cache.state[k[0]][k[1]] != RESIDENT:
                continue
            q = memo.get(k[0])
            if q is None:
                q = memo[k[0]] = self.fill_value(k[0])
            out.append((-1.0 if k in self._wrong else float(q[k[1]]), k))
        out.sort()
        return out

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        super().commit_background(moves)
        if self.guard is not None:
            self.guard.moved(moves, self._ending)
        self._queue += sum(self.up_s[m.layer] for m in moves)
        if self.config.fill_window in ("priced", "windows"):
            for m in moves:
                if self._ending or (m.layer, m.expert) in self._spare_keys:
                    self._watch[m.layer, m.expert] = None
        if self._ending:
            self._ending = False
            if self.guard is not None:
                self.guard.end_token()
            self._token_s = self._link_s = 0.0
            self._routed = set()
            self.end_token()
        else:
            self._pf.update(k for k in ((m.layer, m.expert) for m in moves) if k not in self._spare_keys)
            self._link_s += sum(self.up_s[m.layer] for m in moves)


class LookaheadPolicy(CostPlanner):
    """``lookahead`` with values learnt online (module docstring): ``value`` is the temporal
    forecast of ``predict``'s statistics, the recency of each expert's last use (1 / (1 + steps of
    its layer since)), or its routes per step decayed over ``SHADOW_MEMORY`` steps (``values``;
    ``"adaptive"``: recency unless frequency's shadow, a demand cache of the layer's size run on the
    same steps, hit ``ADAPT_MARGIN`` more lately); ``next_value`` is predict's cross-layer forecast,
    ``fill_value`` the values, or predict's decayed frequency (``fills``)."""

    name = "lookahead"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 cost_model: CostModel | None = None, config: LookaheadConfig = LookaheadConfig()):
        full = Capacity.per_layer(geometry, geometry.max_experts)
        # the forecaster: predict's statistics, fed every step (only where prefetch, fills or values
        # read it); its own cache is never used
        self.forecaster = PredictPolicy(geometry, full, None, PredictConfig(memory=config.memory, max_prefetch=0))
        self._forecast = bool(config.max_prefetch) or config.fills == "frequency" or config.values == "forecast"
        L, E = geometry.num_layers, max(geometry.max_experts, 1)
        self._clock = np.zeros(L)  # steps of each layer so far
        self._last = np.full((L, E), -np.inf)  # the step of each expert's last use
        self._freq = np.zeros((L, E))  # routes per step, decayed by 1 / SHADOW_MEMORY
        modes = ADAPTIVE if config.values == "adaptive" else (config.values,)
        self._modes = modes
        self._shadow = [[set() for _ in modes] for _ in range(L)]
        self._score = np.zeros(len(modes))
        # fill shadows: each layer's top residents by the mode's values at a token's end, serving
        # from the token after the next (a fill lands a token later); scored the same way
        self._fshadow = [[set() for _ in modes] for _ in range(L)]
        self._fpending = [[set() for _ in modes] for _ in range(L)]
        self._fscore = np.zeros(len(modes))
        self._admit = 1.0  # share of misses uploaded (decayed): how much the demand shadows count
        super().__init__(geometry, capacity, profile, cost_model, config)
        if config.guard_memory:
            self.guard = Guard(geometry, capacity, cost_model, self.cache, profile, config.guard_memory,
                               config.guard_margin, config.guard_probe, config.guard_backoff)
        cap = self.cache
        share = {p: sum(1 for l in geometry.moe_layers if cap.pool_of[l] == p) for p in set(cap.pool_of)}
        self._cap = [cap.size[cap.pool_of[l]] // max(share[cap.pool_of[l]], 1) if cap.pool_of[l] >= 0 else 0
                     for l in range(L)]

    def _mode_value(self, mode: str, layer: int, experts) -> np.ndarray:
        if mode == "forecast":
            f = self.forecaster
            return f.forecast(layer, f.prev[layer] if experts is None else experts)
        if mode == "recency":
            v = 1.0 / (1.0 + self._clock[layer] - self._last[layer])
        else:
            v = self._freq[layer].copy()
        if experts is not None:
            v[list(experts)] = 1.0 if mode == "recency" else v[list(experts)] + 1.0 / SHADOW_MEMORY
        return v

    def mode(self) -> str:
        """The value function in use (``values``; adaptive: the best shadow's)."""
        sc = self._admit * self._score + (1.0 - self._admit) * self._fscore
        best = int(np.argmax(sc))
        return self._modes[best] if sc[best] > sc[0] * (1.0 + ADAPT_MARGIN) else self._modes[0]

    def value(self, layer, experts=None):
        return self._mode_value(self.mode(), layer, experts)

    def next_value(self, step, layer):
        return self.forecaster.forecast_below(layer, step.experts)

    def fill_value(self, layer):
        if self.config.fills == "values":
            return self.value(layer)
        if self.config.fills == "long":
            return self._freq[layer].copy()
        return self.forecaster.frequency(layer)

    def learn(self, step):
        layer, experts = step.layer, step.experts
        if len(self._modes) > 1 and self._cap[layer]:
            decay = 1.0 - 1.0 / SHADOW_MEMORY
            cap = self._cap[layer]
            for i, mode in enumerate(self._modes):
                sh = self._shadow[layer][i]
                miss = [e for e in experts if e not in sh]
                self._score[i] = self._score[i] * decay + (len(experts) - len(miss))
                if len(sh) + len(miss) > cap:
                    v = self._mode_value(mode, layer, experts)
                    out = sorted((e for e in sh if e not in experts), key=lambda e: (v[e], e))
                    sh.difference_update(out[:len(sh) + len(miss) - cap])
                sh.update(miss[:max(cap - len(sh), 0)])
                self._fscore[i] = self._fscore[i] * decay + sum(e in self._fshadow[layer][i] for e in experts)
        self._clock[layer] += 1
        self._last[layer, list(experts)] = self._clock[layer]
        self.uses[layer, list(experts)] += 1.0 if step.counts is None else np.asarray(step.counts, float)
        self._freq[layer] *= 1.0 - 1.0 / SHADOW_MEMORY
        self._freq[layer, list(experts)] += 1.0 / SHADOW_MEMORY
        if self._forecast:
            self.forecaster.commit(Decision(step, experts))

    def commit(self, d):
        super().commit(d)
        if d.uploads or d.streams or d.cpu:
            up = len(d.uploads) + len(d.streams)
            self._admit += (up / (up + len(d.cpu)) - self._admit) / SHADOW_MEMORY

    def end_token(self):
        if len(self._modes) > 1:
            for l in self.geometry.moe_layers:
                cap = self._cap[l]
                if not cap:
                    continue
                n = self.geometry.num_experts[l]
                for i, mode in enumerate(self._modes):
                    v = self._mode_value(mode, l, None)[:n]
                    self._fshadow[l][i] = self._fpending[l][i]
                    self._fpending[l][i] = set(np.argsort(-v, kind="stable")[:cap].tolist())
        if self._forecast:
            self.forecaster.commit_background(())
