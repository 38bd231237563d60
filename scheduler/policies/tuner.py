"""The floor tuner of ``hybrid-cost``: shadow policies, one per candidate floor."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from ..core import Move, Step
from ..profile import Profile


__all__ = ["FloorTuner"]


class FloorTuner:
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
        self.pending: deque[tuple[int, Any, tuple[Move, ...]]] = deque()
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
                sh.commit(d)
                self.window_s[i] += sh.committed_s
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

    def end_token(self, live, token: int) -> int:
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

    def _seed(self, sh, live, token: int, lag: int) -> None:
        """Give shadow ``sh`` the live policy's residents (same slots), usage and token count on
        the sampled layers; live background copies still in flight are in flight in ``sh`` too,
        completing when the live ones do, and queued on its link."""
        cache, width = live.cache, sh._np.shape[1]
        up = sh.costs.upload_s
        due: dict[int, list[Move]] = {}
        for j, l in enumerate(self.layers):
            sh._np[j] = live._np[l, :width]
            sh._hit_avg[j] = live._hit_avg[l]
            if live._lru is not None:  # admit="recency"
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
