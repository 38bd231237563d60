"""``hybrid-cost``: ``hybrid`` whose miss split comes from a cost model (see ``HybridCostPolicy``)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..cache import INFLIGHT, RESIDENT
from ..core import Capacity, Decision, Geometry, Move, Step
from ..costmodel import CostModel
from ..profile import Profile
from .hybrid import REUSE_SCALE, REUSE_STEPS, HybridConfig, HybridPolicy, prompt_room
from .prefetch import LinkPrefetch
from .base import BasePolicy
from .tuner import FloorTuner

__all__ = ["HybridCostConfig", "HybridCostPolicy"]


@dataclass(frozen=True)
class HybridCostConfig(HybridConfig):
    """``hybrid-cost``'s knobs (see ``HybridCostPolicy``) and ``hybrid``'s, checked as there; an
    error names the field.

    ``floors_256``: distinct candidate floors in 0..256 (the first is the starting floor; the
    default, 0 alone, tunes nothing: on the development routing of ``experiments/hybrid_split.py``
    the tuner over 0..128 stayed within 0.3% of floor 0 once CPU misses pay their lost reuse, and
    its shadows cost planning time);
    ``tune_every`` >= 1 (tokens' worth of routes per window); ``hysteresis`` in [0, 1);
    ``shadow_layers`` >= 1; ``tune_duty`` in (0, 1]; ``tune_warmup`` >= 0 (windows);
    ``admit`` "recency" or "usage". ``swap_every`` None: 0 (no swap rounds) with "recency", 4 with
    "usage". ``rounding`` must be "nearest" (the floor is rounded to nearest). ``reuse_charge``: price
    each CPU miss its lost reuse (see ``HybridCostPolicy``). ``prefetch``: most experts copied into
    each next layer's idle link window (0: no prefetch; ``scheduler.policies.prefetch``), those of
    forecast chance >= ``prefetch_confidence`` (in [0, 1]); a swap needs its victim less likely by
    ``prefetch_margin`` (>= 0); the forecast's memory ``prefetch_memory`` (> 1, steps);
    ``prefetch_fills``: held-over recurrence swaps in later windows too. The prefetch's settings are
    ``PREFETCH_GRID``'s entry that ``experiments/policies_eval.py`` chooses on its development set,
    except ``prefetch`` itself, 0 (off): the executor on the H200 ran slower with it than the
    simulator charges (docs/POLICIES.md; docs/perf/bench_executor_hardware_h200: 0.67-0.72x ``lru``
    with ``prefetch=4``, its copies' host time not in the simulator's charge).
    """

    swap_every: int | None = None
    floors_256: tuple[int, ...] = (0,)
    tune_every: int = 8
    hysteresis: float = 0.01
    shadow_layers: int = 4
    tune_duty: float = 0.25
    tune_warmup: int = 16
    admit: str = "recency"
    reuse_charge: bool = True
    prefetch: int = 0
    prefetch_confidence: float = 0.3
    prefetch_margin: float = 0.1
    prefetch_memory: float = 8.0
    prefetch_fills: bool = False

    policy = "hybrid-cost"

    def __post_init__(self) -> None:
        if self.admit not in ("recency", "usage"):
            raise ValueError(f"hybrid-cost admit: {self.admit!r}, expected 'recency' or 'usage'")
        if self.rounding != "nearest":
            raise ValueError("hybrid-cost rounding: its floor is rounded to nearest; 'carry' is hybrid's")
        if self.swap_every is None:
            object.__setattr__(self, "swap_every", 0 if self.admit == "recency" else 4)
        floors = tuple(int(f) for f in self.floors_256)
        if not floors or any(not 0 <= f <= 256 for f in floors) or len(set(floors)) != len(floors):
            raise ValueError(f"hybrid-cost floors_256: {self.floors_256}, expected distinct values in 0..256")
        object.__setattr__(self, "floors_256", floors)
        if not self.tune_every >= 1:
            raise ValueError(f"hybrid-cost tune_every: {self.tune_every}, expected >= 1")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ValueError(f"hybrid-cost hysteresis: {self.hysteresis}, expected in [0, 1)")
        if not self.shadow_layers >= 1:
            raise ValueError(f"hybrid-cost shadow_layers: {self.shadow_layers}, expected >= 1")
        if not 0.0 < self.tune_duty <= 1.0:
            raise ValueError(f"hybrid-cost tune_duty: {self.tune_duty}, expected in (0, 1]")
        if not self.tune_warmup >= 0:
            raise ValueError(f"hybrid-cost tune_warmup: {self.tune_warmup}, expected >= 0")
        if not 0 <= self.prefetch <= 64:
            raise ValueError(f"hybrid-cost prefetch: {self.prefetch}, expected 0..64")
        if not 0.0 <= self.prefetch_confidence <= 1.0:
            raise ValueError(f"hybrid-cost prefetch_confidence: {self.prefetch_confidence}, expected in [0, 1]")
        if not self.prefetch_margin >= 0.0:
            raise ValueError(f"hybrid-cost prefetch_margin: {self.prefetch_margin}, expected >= 0")
        if not self.prefetch_memory > 1.0:
            raise ValueError(f"hybrid-cost prefetch_memory: {self.prefetch_memory}, expected > 1")
        super().__post_init__()


class HybridCostPolicy(HybridPolicy):
    """``hybrid`` whose miss split comes from a cost model instead of a fixed fraction.

    Per step: the hits stay on the GPU; in-flight misses go to the CPU. The other misses are
    ranked by token count (more first), then decayed usage (higher first), then router rank; the
    first ``k`` go over PCIe and the rest to the CPU pool, where ``k`` is chosen exactly: every
    ``k`` from ``round(n * floor_256 / 256)`` (half up; the *floor*) to ``n`` is priced by the cost
    model's layer time (``CostModel.step_s``: the link, the GPU batch, the pool's call with its
    fixed costs once and, with a hardware file's executor costs, the host thread that issues
    them, in the order the simulator charges them), and the least wins, ties going to fewer
    uploads (the CPU moves no bytes). With ``reuse_charge`` (the default) each miss left to the CPU
    is also charged the reuse it loses, as ``hybrid``'s ``CostShare`` charges it (the layer's hit
    share over its last ``REUSE_STEPS`` steps or so, to 1/``REUSE_SCALE``, times a one-token
    miss's cost over a hit's); the predicted time (``layer_time_s``) leaves the charge out. An
    expert with many tokens is worth uploading; one with a single token is often cheaper on the
    CPU (HybriMoE, Fiddler); a share of uploads beyond that buys future hits, which the charge
    and the floor's shadows price.

    The link is modelled as a queue: background copies (fills and swaps) committed after a token
    are queued on it, and drain while layers run (``CostModel.layer_s`` of each layer's other
    work, then the layer's predicted time); a step's uploads start behind what is left. A step
    with no upload does not wait for the link.

    With several ``floors_256`` the floor is chosen online: one shadow copy of the policy per candidate
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
    earlier windows weigh less. A single candidate fixes the floor.

    Caching (``admit``): with ``"recency"`` (the default) a PCIe miss beyond the free slots always
    takes the slot of the layer's least recently used resident the step does not use (within a
    step, in router order; never used: by id): its bytes cross the link anyway, and on a trace with the locality of the
    qwen3 preset, recency kept more hits than usage (simulated, calibrated H200 file: hit rate
    0.751 against 0.643 for hybrid's usage-gated admission when every miss goes over PCIe); swap
    rounds are then off unless ``swap_every`` is given, since they refill by usage what recency
    evicted. ``"usage"``: ``hybrid``'s admission and swap rounds. Fills are ``hybrid``'s, and so is
    ``prompt_fill``: a prompt chunk's step uploads at least its misses with the most tokens that the
    layer's free room holds (the floor of its split).

    Prefetch (``prefetch`` > 0; off by default; ``scheduler.policies.prefetch``): after each one-token
    step, the next MoE layer's likeliest absent experts (recurrence and co-activation learnt online)
    are copied only in the link's idle window before that layer's decision (its dense part and
    router read-back, less the link's queue), into free slots or over the layer's least recently used
    resident when that one is less likely; a guess its layer's step does not route is that layer's
    first victim.
    """

    name = "hybrid-cost"

    def __init__(self, geometry: Geometry, capacity: Capacity, profile: Profile | None = None, *,
                 cost_model: CostModel | None = None, config: HybridCostConfig = HybridCostConfig()):
        if cost_model is None:
            raise ValueError("policy 'hybrid-cost' needs cost_model= (scheduler.CostModel)")
        if len(cost_model.upload_s) != geometry.num_layers:
            raise ValueError(f"cost_model has {len(cost_model.upload_s)} layers, the model {geometry.num_layers}")
        floors = config.floors_256
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
        self.reuse_charge = config.reuse_charge
        self._hit_avg = [0] * geometry.num_layers  # per layer, the hit share's moving average, in 1/2**16
        self._per_reuse = [max(min(c, u + g) - g, 0.0) / REUSE_SCALE
                           for g, c, u in zip(self._gpu1, self._cpu1, cost_model.upload_s)]
        memos: dict = {}  # decode splits with no link queue, shared by layers of equal costs
        self._memo = [memos.setdefault(cost_model.decode_key(l), {})
                      for l in range(geometry.num_layers)]
        self.committed_s = 0.0  # predicted expert time of the last committed decision
        # this token so far: predicted time (dense parts and expert steps), the demand copies' link
        # time, and whether a step ran several tokens (see plan_background)
        self._tok_s = self._tok_link_s = 0.0
        self._tok_batch = False
        self._up_mean = sum(cost_model.upload_s[l] for l in geometry.moe_layers) / max(len(geometry.moe_layers), 1)
        super().__init__(geometry, capacity, profile, config)
        self.prefetcher = None if not (config.prefetch or config.prefetch_fills) else LinkPrefetch(
            self, config.prefetch, config.prefetch_confidence, config.prefetch_margin, config.prefetch_memory,
            config.prefetch_fills)
        if self.prefetcher is not None and not self.prefetcher.able:  # no window holds a copy: it would never move
            self.prefetcher = None
        self._prefetching = False  # the next commit_background commits a prefetch, not a token's end
        self.tuner = None
        if len(floors) > 1:
            n_moe = len(geometry.moe_layers)  # shadows plan no more layer-steps than the live policy
            layers = _sample_layers(geometry.moe_layers, self.cache.pool_of,
                                    min(config.shadow_layers, max(n_moe // len(floors), 1)))
            parts = _sub_model(geometry, capacity, profile, cost_model, layers)
            n = len(layers)
            cut = replace(config, max_moves=-(-self.max_moves * n // n_moe), max_fills=-(-self.max_fills * n // n_moe))
            make = lambda f, prof: HybridCostPolicy(*parts[:2], prof, cost_model=parts[3],
                                                    config=replace(cut, floors_256=(f,)))
            routes = config.tune_every * geometry.top_k * n_moe
            self.tuner = FloorTuner(make, floors, routes, config.hysteresis, layers, parts[2], config.tune_duty,
                                    config.tune_warmup)

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
        one = counts is None
        misses = [e for e in experts if state[e] != RESIDENT]
        queued = self._queue_s - self._layer_s[layer]
        queued = queued if queued > 0.0 else 0.0
        if one:
            gpu_s, cpu_s = self._gpu1[layer], self._cpu1[layer]
        else:
            gt, ct = self._tables(layer, max(counts))
            cnt = dict(zip(experts, counts))
        if not misses:
            d = Decision(step, experts)
            if one and queued == 0.0:  # decode steps that hit alone: one time per count, shared as the memos are
                got = self._memo[layer].get(len(experts))
                if got is None:
                    got = self._memo[layer][len(experts)] = self.costs.step_s(layer, len(experts) * gpu_s,
                                                                              len(experts), 0.0, 0, 0.0)
                self._planned = (d, *got)
                return d
            hits_s = len(experts) * gpu_s if one else sum([gt[c] for c in counts])
            self._planned = (d, *self.costs.step_s(layer, hits_s, len(experts), 0.0, 0, 0.0, queued, one))
            return d
        hits = tuple([e for e in experts if state[e] == RESIDENT])
        eligible = [e for e in misses if state[e] != INFLIGHT]
        n_busy = len(misses) - len(eligible)  # in flight: on the CPU
        u = self._u[layer]
        if len(eligible) > 1:  # more used first; stable, so router rank breaks ties
            eligible.sort(key=u.__getitem__ if one else (lambda e: (cnt[e], u[e])), reverse=True)
        n_floor = (len(eligible) * self.floor_256 + 128) >> 8
        if not one and self.config.prompt_fill and sum(counts) > self.geometry.top_k:  # hybrid's prompt rule
            n_floor = max(n_floor, min(prompt_room(self.cache, self.capacity, layer), len(eligible)))
        charge = self._charge(layer)
        if one:
            key = (len(hits), len(eligible), n_busy, n_floor, charge)
            memo = self._memo[layer] if queued == 0.0 else None
            got = memo.get(key) if memo is not None else None
            if got is None:
                m = len(eligible)
                got = self._split(layer, len(hits) * gpu_s, len(hits), [gpu_s] * m, [cpu_s] * m, n_busy,
                                  n_busy * cpu_s, n_floor, queued, True, charge)
                if memo is not None:
                    memo[key] = got
        else:
            busy_s = sum([ct[cnt[e]] for e in misses if state[e] == INFLIGHT])
            got = self._split(layer, sum([gt[cnt[e]] for e in hits]), len(hits), [gt[cnt[e]] for e in eligible],
                              [ct[cnt[e]] for e in eligible], n_busy, busy_s, n_floor, queued, False, charge)
        n_up, t, left = got
        pcie = eligible[:n_up]
        cpu = tuple([e for e in misses if e not in pcie]) if n_up else tuple(misses)
        slots = self.cache.free_slots(layer, len(pcie))
        n_slot = len(slots)
        if n_slot < len(pcie) and self.admit_uploads:
            d = self._admit(step, hits, pcie, slots, cpu)
        else:
            d = Decision(step, hits, tuple(pcie[:n_slot]), tuple(slots), tuple(pcie[n_slot:]), cpu)
        self._planned = (d, t, left)
        return d

    def _split(self, layer: int, hits_s: float, num_hits: int, gpu: list[float], cpu: list[float], n_busy: int,
               busy_s: float, n_floor: int, queued: float, one: bool, charge: float = 0.0) -> tuple[int, float, float]:
        """How many of the ranked eligible misses (GPU and CPU seconds ``gpu``/``cpu`` each) go
        over PCIe: every ``k`` from ``n_floor`` to all is priced by ``CostModel.step_s`` (the
        first ``k`` uploaded, the rest with the ``n_busy`` in-flight misses in one pool call);
        the least time wins, ties going to fewer uploads. Returns (k, its time, link work left)."""
        cm = self.costs
        m = len(gpu)
        rest = [0.0] * (m + 1)  # rest[k]: CPU seconds of misses k.. (suffix sums)
        for i in range(m - 1, -1, -1):
            rest[i] = rest[i + 1] + cpu[i]
        up = sum(gpu[:n_floor])
        best = None
        for k in range(n_floor, m + 1):
            n_cpu = m - k + n_busy
            t, left = cm.step_s(layer, hits_s, num_hits, up, k, cm.pool_s(busy_s + rest[k], n_cpu), queued, one)
            c = t + (m - k) * charge
            if best is None or c < best[3]:
                best = (k, t, left, c)
            if k < m:
                up += gpu[k]
        return best[:3]

    def _charge(self, layer: int) -> float:
        """``reuse_charge``: what leaving one miss uncached costs the layer later (``hybrid``'s
        ``CostShare`` charge: the layer's recent hit share, to 1/``REUSE_SCALE``, times a one-token
        miss's cost over a hit's)."""
        if not self.reuse_charge:
            return 0.0
        return (self._hit_avg[layer] * REUSE_SCALE >> 16) * self._per_reuse[layer]

    def layer_time_s(self, d: Decision) -> tuple[float, float]:
        """Predicted expert time of decision ``d`` by the cost model (``CostModel.step_s``), and
        the link work still queued when the layer ends."""
        if self._planned is not None and self._planned[0] is d:
            return self._planned[1], self._planned[2]
        cm = self.costs
        layer = d.step.layer
        cnt = dict(zip(d.step.experts, d.step.counts)) if d.step.counts is not None else None
        queued = max(self._queue_s - self._layer_s[layer], 0.0)
        up = d.uploads + d.streams
        hits_s = sum(cm.gpu_s(layer, cnt[e] if cnt else 1) for e in d.hits)
        up_s = sum(cm.gpu_s(layer, cnt[e] if cnt else 1) for e in up)
        pool = cm.pool_s(sum(cm.cpu_s(layer, cnt[e] if cnt else 1) for e in d.cpu), len(d.cpu))
        return cm.step_s(layer, hits_s, len(d.hits), up_s, len(up), pool, queued, cnt is None)

    def commit(self, d: Decision) -> None:
        """Commit ``d`` (see ``hybrid``); its predicted time (``layer_time_s``) is kept in
        ``committed_s``."""
        self.committed_s, self._queue_s = self.layer_time_s(d)
        layer = d.step.layer
        self._tok_s += self._layer_s[layer] + self.committed_s
        self._tok_link_s += (len(d.uploads) + len(d.streams)) * self.costs.upload_s[layer]
        self._tok_batch |= d.step.counts is not None
        a = self._hit_avg[d.step.layer]
        self._hit_avg[d.step.layer] = a + ((len(d.hits) << 16) // len(d.step.experts) - a) // REUSE_STEPS
        super().commit(d)
        if self.prefetcher is not None:
            self.prefetcher.learn(d.step)
        if self.tuner is not None:
            self.floor_256 = self.tuner.observe(d.step, self.floor_256)

    def plan_prefetch(self, step: Step) -> tuple[Move, ...]:
        """With ``prefetch``: the next layer's likely experts in its idle link window, after a
        one-token step (``scheduler.policies.prefetch``); else none."""
        if self.prefetcher is None:
            return ()
        moves = self.prefetcher.plan(step, self._queue_s)
        self._prefetching = bool(moves)
        return moves

    def fill_cap(self) -> int:
        """At most as many fills as the link could have carried in the idle time of the token just
        planned (its predicted time less its demand copies and the link work still queued), so that
        copies queued after a token do not hold the next token's misses back; none after a step of
        several tokens (a prompt chunk: its idle link time says nothing of a decode token's, and a
        burst of fills there delays the first decode tokens; free slots are filled during decode)."""
        if self._tok_batch:
            return 0
        if self._up_mean <= 0:
            return self.max_fills
        spare = self._tok_s - self._tok_link_s - self._queue_s
        return min(self.max_fills, max(int(spare / self._up_mean), 0))

    def plan_background(self) -> tuple[Move, ...]:
        """``hybrid``'s fills (at most ``fill_cap``) and swaps; this token's sums start over."""
        moves = super().plan_background()
        self._tok_s = self._tok_link_s = 0.0
        self._tok_batch = False
        self._prefetching = False
        if self.prefetcher is not None:
            self.prefetcher.end_token()
        return moves

    def commit_background(self, moves: tuple[Move, ...]) -> None:
        if self._prefetching:  # a prefetch inside the token: on the cache and the link, not a token's end
            self._prefetching = False
            BasePolicy.commit_background(self, moves)
            link = self.prefetcher.committed(moves)
            self._queue_s += link
            self._tok_link_s += link
            return
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
