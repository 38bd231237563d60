"""Audit of a replay: one record per token, a summary per run, and the decision log.

Counts are of expert executions (one per (step, expert)); bytes are expert weight bytes moved
host -> device (on-demand uploads, streams and background moves). A *profile hit* is a hit on an
expert placed by the profile that has stayed resident since: once evicted it never counts again,
even if it comes back later.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable

from .core import Geometry, Policy, Token
from .drive import AwaitBackground, EndToken, RunLayer, StartBackground, drive
from .files import atomic_open

__all__ = ["Audit", "COUNTERS", "replay"]

COUNTERS = ("hits", "uploads", "streams", "cpu", "fills", "swaps", "upload_bytes", "profile_hits")


class Audit:
    """Observes driver items (``observe``); ``records`` per token, ``summary()`` per run.

    ``keep_log=True`` also keeps every decision and move for ``log`` / ``digest``.
    ``record_routes=True`` adds each token's routing to its record, as
    ``"routes": [[layer, [expert, ...], [weight, ...] or null], ...]`` (experts in router-rank
    order), so that an audit file is also a routing trace (``moelab trace import audit``). A
    multi-token batch (``num_tokens`` > 1 in its record) routes each position to its own top-k,
    which the batch's union of experts cannot tell apart: ``write_jsonl(positions=...)`` adds each
    position's routing, so that such a batch imports as one trace row per position.
    """

    def __init__(self, geometry: Geometry, profile_residents=(), keep_log: bool = False,
                 keep_records: bool = True, record_routes: bool = False):
        self.geometry = geometry
        self.expert_bytes = geometry.expert_bytes
        self.profile = set(profile_residents)
        self.keep_log, self.keep_records = keep_log, keep_records
        self.record_routes = record_routes
        self.records: list[dict] = []
        self.log: list[tuple] = []
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.tokens = 0
        self._reset_token()

    def _reset_token(self) -> None:
        self.cur = [0] * len(COUNTERS)  # this token's counters, in COUNTERS order
        self.added: list[tuple[int, int]] = []
        self.removed: list[tuple[int, int]] = []
        self.routes: list[list] = []

    def observe(self, item) -> None:
        t = type(item)
        if t is RunLayer:
            d = item.decision
            c = self.cur
            layer = d.step.layer
            nh, nu, ns, nc = len(d.hits), len(d.uploads), len(d.streams), len(d.cpu)
            c[0] += nh
            c[3] += nc
            if nu or ns:
                c[1] += nu
                c[2] += ns
                c[6] += (nu + ns) * self.expert_bytes[layer]
            if self.profile:
                prof = self.profile
                c[7] += sum(1 for e in d.hits if (layer, e) in prof)
                for v in d.evictions:
                    prof.discard(v)
            if d.evictions:
                self.removed.extend(d.evictions)
            if nu:
                self.added.extend((layer, e) for e in d.uploads)
            if d.retired:
                self.removed.extend(d.retired)
                self.added.extend((layer, e) for e in d.promotions)
                if self.profile:
                    self.profile.difference_update(d.retired)
            if self.record_routes:
                st = d.step
                self.routes.append([layer, list(st.experts), None if st.weights is None else [float(w) for w in st.weights]])
            if self.keep_log:
                self.log.append((item.token.index, layer, d.hits, d.uploads, d.slots, d.streams, d.cpu, d.evictions,
                                 d.promotions, d.promotion_slots, d.retired))
        elif t is StartBackground:
            c = self.cur
            for m in item.moves:
                c[6] += self.expert_bytes[m.layer]
                if m.victim is None:
                    c[4] += 1
                else:
                    c[5] += 1
                    self.removed.append(m.victim)
                    self.profile.discard(m.victim)
                self.added.append((m.layer, m.expert))
            if self.keep_log:
                self.log.append((item.token.index, "moves", tuple((m.layer, m.expert, m.slot, m.victim) for m in item.moves)))
        elif t is EndToken:
            tok = item.token
            totals = self.totals
            for k, v in zip(COUNTERS, self.cur):
                totals[k] += v
            if self.keep_records:
                rec = {"token": tok.index, "seq": tok.seq, "pos": tok.pos, "phase": tok.phase}
                if tok.num_tokens != 1:
                    rec["num_tokens"] = tok.num_tokens
                rec.update(zip(COUNTERS, self.cur))
                rec["added"] = self.added
                rec["removed"] = self.removed
                if self.record_routes:
                    rec["routes"] = self.routes
                self.records.append(rec)
            self.tokens += 1
            self._reset_token()
        elif t is AwaitBackground:
            pass
        else:
            raise TypeError(f"audit cannot observe {t.__name__}")

    # results ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        t = self.totals
        served = t["hits"] + t["uploads"] + t["streams"] + t["cpu"]
        return {
            "tokens": self.tokens,
            "experts_served": served,
            **t,
            "hit_rate": t["hits"] / served if served else 0.0,
            "profile_hit_rate": t["profile_hits"] / served if served else 0.0,
            "upload_mib": t["upload_bytes"] / 2**20,
        }

    def digest(self) -> str:
        """SHA-256 of the decision log (needs ``keep_log=True``)."""
        if not self.keep_log:
            raise ValueError("Audit.digest needs keep_log=True")
        return hashlib.sha256(repr(self.log).encode()).hexdigest()

    def write_jsonl(self, path: str | os.PathLike, run: dict | None = None, positions=None) -> None:
        """Write one JSON line per token, then a summary line (``"summary": true``), atomically.

        ``positions``: None, or per record the routing of each position of its batch, as
        ``(pos, [(layer, experts, weights), ...])`` pairs (``execute.model.MoeModel.route_log``, split
        by batch); written as the record's ``"positions"``."""
        if positions is not None and len(positions) != len(self.records):
            raise ValueError(f"positions: {len(positions)} batches, the audit has {len(self.records)} records")
        geometry = {"num_experts": list(self.geometry.num_experts), "top_k": self.geometry.top_k,
                    "expert_bytes": list(self.geometry.expert_bytes)}
        with atomic_open(path, "w") as f:
            for i, rec in enumerate(self.records):
                if positions is not None:
                    rec = {**rec, "positions": [_position(p, routes) for p, routes in positions[i]]}
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            f.write(json.dumps({"summary": True, "geometry": geometry, **(run or {}), **self.summary()}) + "\n")


def _position(pos: int, routes) -> dict:
    """One position's routing as an audit record holds it."""
    return {"pos": int(pos), "routes": [[int(l), [int(e) for e in ids], None if ws is None else [float(w) for w in ws]]
                                        for l, ids, ws in routes]}


def replay(policy: Policy, tokens: Iterable[Token], lag_tokens: int = 1, audit=None):
    """Drive ``policy`` over ``tokens`` with no timing; feed each item to ``audit`` if given.

    Returns the audit (a fresh :class:`~scheduler.audit.Audit` when none is given).
    """
    if audit is None:
        audit = Audit(policy.geometry)
    observe = audit.observe
    for item in drive(policy, tokens, lag_tokens):
        observe(item)
    return audit
