"""What a copy costs the executor beyond the copy: a probe of uploads, streams and swaps.

Four scripted workloads decode the same tokens through ``ExpertEngine`` and the dense stand-in
(``replay_engine``: the loop every replay uses), each layer routed to 8 resident experts except
for one expert of each layer that the workload moves:

- ``hits``: the 8 experts resident (the baseline);
- ``upload``: 7 hits and one upload into a slot, evicting the expert the previous token put there;
- ``stream``: 7 hits and one streamed expert (copied to scratch, run, dropped); ``stream2``: 6 hits
  and two (is a stream's cost per expert or per layer?);
- ``swap``: 8 hits, and after every token one background swap per layer (``Move`` with a victim,
  awaited with the driver's one-token lag, ``drive``'s ``lag_tokens=1``);
- ``fill``: 8 hits, and after every token one background fill per layer (into a slot no expert held:
  no wait for the kernels queued before it; ``FILL_SLOTS`` slots a layer);
- ``cpu``: 7 hits and one expert on the CPU pool; ``cpuswap``, ``cpufill``: the same with ``swap``'s
  swaps or ``fill``'s fills (their cost beside the pool's hand-off); ``cpustream``: 6 hits, one
  stream and one CPU expert (``BASE``: these three measured against ``cpu``). ``GPU_KINDS`` leave
  the pool idle and fit in ``SLOTS`` slots a layer.

So each workload has ``EVENTS[kind]`` events per layer more than its ``BASE`` workload, of one kind. The workloads run
interleaved over rounds (every other round reversed), each on a fresh engine after warm-up
tokens. ``moves_summary`` reduces the runs to seconds per token, the engine's host phases per
token, and per event the difference from ``hits`` (``delta_s``); the simulator replays the same
items (``ScriptedPolicy`` through ``scheduler.drive``) to compare (``moelab.sim_vs_real``).
"""
from __future__ import annotations

import os
import time

import numpy as np

from scheduler.core import Capacity, Decision, Geometry, Move, Step, Token

__all__ = ["KINDS", "GPU_KINDS", "EVENTS", "BASE", "ScriptedPolicy", "moves_tokens", "measure_moves", "moves_summary",
           "moves_fields", "apply_moves", "calibration_moves", "RESIDENT", "SLOTS"]

KINDS = ("hits", "upload", "stream", "stream2", "swap", "fill", "cpu", "cpuswap", "cpufill", "cpustream")
GPU_KINDS = KINDS[:5]  # no CPU expert: no pool call (no Numba compile), SLOTS slots a layer
EVENTS = {"hits": 0, "upload": 1, "stream": 1, "stream2": 2, "swap": 1, "fill": 1, "cpu": 1, "cpuswap": 1,
          "cpufill": 1, "cpustream": 1}  # moved experts per layer and token
BASE = {"cpuswap": "cpu", "cpufill": "cpu", "cpustream": "cpu"}  # what a kind is measured against (else hits)
FILL_SLOTS = 64  # slots a layer the fill kinds need: slots 27 + t fill with expert 30 + t (t < 30)
RESIDENT = 24  # experts 0..23 resident in slots 0..23 of every layer: the hits
SLOTS = 32  # slots per layer: 24 the upload target, 25 and 26 the swaps' (alternating tokens)
UPLOAD, STREAM, SWAP, CPU, FILL = 100, 110, 120, 60, 30  # moved experts: 100/101, 110..117, 120..123, 60..67, 30..59


def _hits(t: int, layer: int, n: int) -> tuple[int, ...]:
    return tuple((3 * t + 5 * layer + j) % RESIDENT for j in range(n))


def moves_tokens(kind: str, num_layers: int, num_tokens: int, top_k: int = 8, start: int = 0) -> tuple:
    """Decode tokens ``start .. start + num_tokens - 1`` of workload ``kind``: per layer ``top_k``
    experts, the last ones the moved experts (``upload``: 101 on even tokens, 100 on odd; ``stream``:
    110 + t % 8; ``stream2``: that and 110 + (t + 4) % 8), the others resident."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r}, expected one of {', '.join(KINDS)}")
    if not 2 <= top_k <= RESIDENT:
        raise ValueError(f"top_k: {top_k}, expected 2..{RESIDENT}")
    out = []
    for t in range(start, start + num_tokens):
        steps = []
        for l in range(num_layers):
            if kind == "upload":
                ex = _hits(t, l, top_k - 1) + (UPLOAD + 1 - t % 2,)
            elif kind == "stream":
                ex = _hits(t, l, top_k - 1) + (STREAM + t % 8,)
            elif kind == "stream2":
                ex = _hits(t, l, top_k - 2) + (STREAM + t % 8, STREAM + (t + 4) % 8)
            elif kind in ("cpu", "cpuswap", "cpufill"):
                ex = _hits(t, l, top_k - 1) + (CPU + t % 8,)
            elif kind == "cpustream":
                ex = _hits(t, l, top_k - 2) + (STREAM + t % 8, CPU + t % 8)
            else:
                ex = _hits(t, l, top_k)
            steps.append(Step(l, ex))
        out.append(Token(t - start, 0, t, "decode", tuple(steps)))
    return tuple(out)


class ScriptedPolicy:
    """Decides ``moves_tokens``' steps as the workload says (no cache logic): resident experts
    are hits; 100/101 is uploaded into slot 24, evicting the other; 110..117 streamed; under
    ``swap`` every token ends with one swap per layer into slot 25 + t % 2 (122/120 alternating in
    slot 25, 123/121 in slot 26, the other the victim). Tokens are counted by ``plan_background``
    from ``start``."""

    def __init__(self, geometry: Geometry, kind: str, start: int = 0):
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r}, expected one of {', '.join(KINDS)}")
        self.geometry, self.kind, self.t = geometry, kind, start

    def residents(self) -> dict:
        """(layer, expert) -> slot before the first token."""
        out = {}
        for l in range(self.geometry.num_layers):
            out.update({(l, e): e for e in range(RESIDENT)})
            out[l, UPLOAD] = 24
            out[l, SWAP], out[l, SWAP + 1] = 25, 26
        return out

    def plan(self, step: Step) -> Decision:
        l, ex = step.layer, step.experts
        hits = tuple(e for e in ex if e < RESIDENT)
        streams = tuple(e for e in ex if STREAM <= e < STREAM + 8)
        cpu = tuple(e for e in ex if CPU <= e < CPU + 8)
        up = tuple(e for e in ex if e in (UPLOAD, UPLOAD + 1))
        if up:
            return Decision(step, hits, uploads=up, slots=(24,), evictions=((l, 2 * UPLOAD + 1 - up[0]),))
        return Decision(step, hits, streams=streams, cpu=cpu)

    def commit(self, d: Decision) -> None:
        pass

    def complete(self, layer: int, expert: int) -> None:
        pass

    def plan_background(self) -> tuple:
        t, self.t = self.t, self.t + 1
        if self.kind in ("fill", "cpufill"):
            if t >= 30:
                raise ValueError(f"{self.kind}: token {t}, the fills have slots for 30 tokens")
            return tuple(Move(l, FILL + t, 27 + t) for l in range(self.geometry.num_layers))
        if self.kind not in ("swap", "cpuswap"):
            return ()
        slot, base = 25 + t % 2, SWAP + t % 2
        new, old = base + 2 * ((t // 2 + 1) % 2), base + 2 * ((t // 2) % 2)
        return tuple(Move(l, new, slot, victim=(l, old)) for l in range(self.geometry.num_layers))

    def commit_background(self, moves) -> None:
        pass


def measure_moves(cp, gx, layers, dense, threads: int, rounds: int = 3, tokens: int = 24, warm: int = 4,
                  top_k: int = 8, seed: int = 5, kinds=KINDS) -> list[dict]:
    """Run every workload ``rounds`` times, interleaved (every other round reversed): a fresh
    engine (``SLOTS`` per layer, residents uploaded), ``warm`` tokens, then ``tokens`` timed (wall
    seconds per token, the engine's host phases and its ``start_background`` and ``await_background``
    calls' host seconds). ``gx``: the ``GpuExperts`` to share (at least ``SLOTS`` slots a layer,
    ``FILL_SLOTS`` with a fill kind)."""
    from .calibrate_replay import RUN_PHASES, replay_engine
    from .engine import ExpertEngine

    L, E = len(layers), layers[0].num_experts
    if E <= SWAP + 3:
        raise ValueError(f"measure_moves: {E} experts per layer, expected > {SWAP + 3}")
    geo = Geometry((E,) * L, top_k, (layers[0].expert_bytes,) * L)
    caps = {n: Capacity.per_layer(geo, n) for n in (SLOTS, FILL_SLOTS)}
    with gx.compute:
        x0 = cp.asarray(np.random.default_rng(seed).standard_normal((1, layers[0].hidden)).astype(np.float32))
    out = []
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            pol = ScriptedPolicy(geo, kind)
            cap = caps[FILL_SLOTS if kind.endswith("fill") else SLOTS]
            engine = ExpertEngine(layers, cap, threads=threads, use_gpu=True, timeout_s=60, gpu=gx)
            try:
                engine.load_residents(pol.residents())
                bg = {"start_background": 0.0, "await_background": 0.0}  # host seconds in the calls
                for name in bg:
                    setattr(engine, name, _timed(getattr(engine, name), bg, name))
                replay_engine(cp, engine, pol, moves_tokens(kind, L, warm, top_k), dense, x0)
                engine.synchronize()
                st = engine.stats
                s0 = {p: getattr(st, p) for p in RUN_PHASES}
                bg.update(dict.fromkeys(bg, 0.0))
                t0 = time.perf_counter()
                _, times, _ = replay_engine(cp, engine, pol, moves_tokens(kind, L, tokens, top_k, warm), dense, x0)
                engine.synchronize()
                out.append({"kind": kind, "round": r, "layers": L, "warm": warm, "top_k": top_k,
                            "token_s": times, "wall_s": time.perf_counter() - t0,
                            "host_s": {**{p: getattr(st, p) - s0[p] for p in RUN_PHASES},
                                       **{f"{k}_s": v for k, v in bg.items()}},
                            "uploads": st.uploads, "streams": st.streams})
            finally:
                engine.close()
    return out


def _timed(fn, acc: dict, key: str):
    """``fn`` whose host seconds are added to ``acc[key]``."""
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] += time.perf_counter() - t0
    return call


def moves_summary(runs: list[dict]) -> dict:
    """Per workload: seconds per token (the median over rounds of each run's mean; the rounds'
    spread), host phases per token (medians); per moved expert (``EVENTS[kind]`` per layer and
    token) the difference from its ``BASE`` (``delta_s``) and, for ``stream``, from ``upload``
    (``stream_over_upload_s``)."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["kind"], []).append(r)
    out: dict = {}
    for kind, rs in by.items():
        per = np.array([np.mean(r["token_s"]) for r in rs])
        host = {p: float(np.median([r["host_s"][p] / len(r["token_s"]) for r in rs])) for p in rs[0]["host_s"]}
        out[kind] = {"token_s": float(np.median(per)), "spread": float((per.max() - per.min()) / np.median(per)),
                     "rounds": len(rs), "host_token_s": host, "layers": int(rs[0]["layers"])}
    for kind, v in out.items():
        base = out.get(BASE.get(kind, "hits"))
        if kind != "hits" and base:
            v["delta_s"] = (v["token_s"] - base["token_s"]) / (v["layers"] * EVENTS[kind])
        if "stream" in out and "upload" in out:
            out["stream"]["stream_over_upload_s"] = (out["stream"]["token_s"] - out["upload"]["token_s"]) / out["stream"]["layers"]
    return out


ENGINE_HOST = ("host_plan_s", "host_queue_s", "host_combine_s")  # run_layer's host phases


def moves_fields(summary: dict, executor: dict) -> dict:
    """The streamed steps' executor keys from ``moves_summary`` (its host phases per layer; the
    hardware file's ``executor`` for the lane's own terms): ``host_stream_s`` = a second stream's
    host time (``stream2`` over ``stream``) beyond the ``host_copy_s`` the lane charges a copy, less
    the hit it replaced (``host_gpu_expert_s``); ``host_stream_layer_s`` = a streamed step's over an
    uploading one (``stream`` over ``upload``: one copy each) less ``host_stream_s``. Each at least
    0; {} where a workload is missing."""
    if not all(k in summary for k in ("upload", "stream", "stream2")):
        return {}
    host = lambda k: sum(summary[k]["host_token_s"].get(p, 0.0) for p in ENGINE_HOST) / summary[k]["layers"]
    per = max(host("stream2") - host("stream") - executor.get("host_copy_s", 0.0)
              + executor.get("host_gpu_expert_s", 0.0), 0.0)
    return {"host_stream_layer_s": max(host("stream") - host("upload") - per, 0.0), "host_stream_s": per}


CALIBRATE_MOVES = os.environ.get("MOELAB_CALIBRATE_MOVES", "0") == "1"  # off until the probe has run on a GPU


def calibration_moves(cp, gx, layers, args, rounds: int = 2) -> dict:
    """``moves_summary`` of ``measure_moves`` (the GPU workloads, ``rounds`` rounds) as ``moelab
    calibrate`` runs it on its own experts and stand-in, with ``MOELAB_CALIBRATE_MOVES=1`` (else
    {"skipped": ...}: no stream keys are written); {"error": ...} (with a warning) where it cannot
    run (fewer experts or slots than the workloads need)."""
    import sys

    from .calibrate_replay import replay_setup

    if not CALIBRATE_MOVES:
        return {"skipped": "MOELAB_CALIBRATE_MOVES is not 1"}
    try:
        dense = replay_setup(cp, gx, layers, args, None)[2]
        return moves_summary(measure_moves(cp, gx, layers, dense, args.threads, rounds=rounds, top_k=args.top_k,
                                           kinds=GPU_KINDS))
    except Exception as exc:  # noqa: BLE001 - the rest of the calibration stands without the stream keys
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"moelab calibrate: warning: the moves probe did not run ({msg})", file=sys.stderr)
        return {"error": msg}


def apply_moves(hw: dict, m: dict, src: dict) -> None:
    """Put ``moves_fields`` of ``m["moves"]`` (a ``moves_summary``) into hardware file ``hw``'s executor
    block and their source into ``src``, where measured."""
    fields = moves_fields(m.get("moves") or {}, hw.get("executor") or {})
    if fields and "executor" in hw:
        hw["executor"] = {**hw["executor"], **fields}
        src["executor.host_stream"] = ("measured: the moves probe's host phases per step (calibrate_moves: a "
                                       "streamed step over an uploading one, a second stream over one)")
