"""The SimPy model: consumes the scheduler driver's work items and charges them in simulated time.

Resources (one to one with the executor): one copy stream (host -> device, FIFO: on-demand
uploads queue behind background fills and swaps), one GPU compute stream, one CPU pool whose
threads share the host memory bandwidth. One SimPy process runs the whole replay. Within a
token, decode is a chain of dependent layers, so each layer's times are computed arithmetically
from the resources' free times (``copy_free``, ``gpu_free``, ``cpu_free``); the environment's
clock advances once per token and background copies are SimPy events that ``AwaitBackground``
waits on.

A layer (all times from ``costs``):

1. GPU: dense part (attention at the current context, router, shared expert), then the route
   readback; the decision is known at ``decide``.
2. Copy stream: the uploads and streams, one copy each, starting at ``max(decide, copy_free)``.
3. GPU: the hits as one batch from ``decide``; the uploaded/streamed experts as one batch once
   the last copy has landed.
4. CPU pool: hidden state copied to the host, the layer's CPU experts in one parallel call, the
   result copied back; the GPU adds it in.
5. Promotions: device copies from scratch into their slots, on the GPU stream.

The layer ends when all parts have. A background batch awaited inside a token (a policy's
cross-layer prefetch, started after an earlier layer) delays only the next layer's experts, not
its dense part: the executor computes the dense part and router before the driver waits. A hit
on such a prefetch that lands after the step could have started counts as a *late hit*: the
summary's ``hit_rate`` leaves it out (it was waited for, as a miss would be). With measured executor costs (``Costs.host``) the layer
follows the executor's own order on a host lane instead (``_process_host``, docs/FIDELITY.md);
with ``token_graph`` and the graph's costs, a decode token whose experts are resident runs as one
CUDA graph there (``graph_tokens``: ``scheduler.graph``'s rule).
Analytic bound of a layer: max(GPU work, copy work, CPU
work) with perfect overlap and no latency between them; of a token: the sum over its layers plus
the per-token GPU work (output head).
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import numpy as np
import simpy

from scheduler import Audit, AwaitBackground, EndToken, RunLayer, StartBackground

from scheduler.costs import Costs
from scheduler.graph import GRAPH_CPU_AHEAD, GraphBackoff, runs_in_graph

__all__ = ["Simulator", "SimResult"]


@dataclass
class SimResult:
    """What a run produced: per-token times and bounds, busy times, and the scheduler's audit."""

    token_s: np.ndarray  # simulated time of each token (from the previous token's end)
    bound_s: np.ndarray  # analytic lower bound of each token
    decode: np.ndarray  # bool: the token is a decode token
    total_s: float
    gpu_busy_s: float
    copy_busy_s: float
    cpu_busy_s: float
    audit: Audit
    events: list = field(default_factory=list)  # (lane, name, start_s, dur_s) when recorded
    late_hits: int = 0  # hits on a prefetch that landed after its step's experts could start

    def summary(self) -> dict:
        """The headline numbers; throughput over decode tokens (all tokens if none is decode)."""
        sel = self.decode if self.decode.any() else np.ones_like(self.decode)
        t, b = self.token_s[sel], self.bound_s[sel]
        n = int(sel.sum())
        a = self.audit.summary()
        total = self.total_s or 1.0
        served = a["hits"] + a["uploads"] + a["streams"] + a["cpu"]
        return {
            "tokens": n,
            "tokens_per_s": float(n / t.sum()) if n and t.sum() > 0 else 0.0,
            "bound_tokens_per_s": float(n / b.sum()) if n and b.sum() > 0 else 0.0,
            "p50_token_s": float(np.percentile(t, 50)) if n else 0.0,
            "p99_token_s": float(np.percentile(t, 99)) if n else 0.0,
            "hit_rate": float((a["hits"] - self.late_hits) / served) if served else 0.0,
            "late_hits": int(self.late_hits),
            "upload_bytes": int(a["upload_bytes"]),
            "hits": a["hits"], "uploads": a["uploads"], "streams": a["streams"],
            "cpu_experts": a["cpu"], "fills": a["fills"], "swaps": a["swaps"],
            "gpu_busy": float(self.gpu_busy_s / total),
            "pcie_busy": float(self.copy_busy_s / total),
            "cpu_busy": float(self.cpu_busy_s / total),
            "simulated_s": float(self.total_s),
            "all_tokens": int(len(self.token_s)),
        }


class _GraphToken(NamedTuple):
    """Put before a token's items when it tries the token graph: the graph completed the blocks
    before ``blocks`` (all of them: the token), and was launched while the previous token's steps
    were settled (``ahead``). ``cpu``: with the CPU pool inside the graph, each block's CPU experts
    (a count per block), else empty."""

    token: object
    blocks: int
    ahead: bool
    cpu: tuple = ()


def graph_tokens(items, num_layers: int, cpu: bool = False):
    """``items`` with a ``_GraphToken`` before each decode token that tries the token graph, by the
    executor's rule (``scheduler.graph``): one token's items are read ahead to find the first block
    that does not run in the graph (``runs_in_graph``; with ``cpu`` the graph hands its misses to the
    CPU pool; the decisions do not depend on timing, so reading ahead changes none). A token launched
    ahead (the previous one completed in the graph, same sequence, next position; never with
    ``cpu``) is launched before the fills awaited at its start."""
    gate = GraphBackoff()
    buf: list = []
    prev = None  # (seq, pos) of the previous token when the graph completed it
    for item in items:
        buf.append(item)
        if type(item) is not EndToken:
            continue
        tok = item.token
        one = tok.phase == "decode" and tok.num_tokens == 1
        if one and all(it.step.counts is None for it in buf if type(it) is RunLayer) and gate.want():
            ahead = prev == (tok.seq, tok.pos - 1) and not cpu
            arrived: set = set()
            blocks, launched = num_layers, ahead
            for it in buf:
                k = type(it)
                if k is RunLayer:
                    launched = True
                    if not runs_in_graph(it.decision, arrived, cpu):
                        blocks = it.step.layer
                        break
                elif k is AwaitBackground and launched:
                    arrived.update((m.layer, m.expert) for m in it.moves)
            if cpu and blocks < num_layers:
                raise ValueError(f"graph_cpu: token {tok.index} block {blocks} uploads or streams an expert; "
                                 "wrap the policy in scheduler.graph.CpuMisses")
            gate.done(blocks >= num_layers)
            prev = (tok.seq, tok.pos) if blocks >= num_layers else None
            per = [0] * num_layers
            if cpu:
                for it in buf:
                    if type(it) is RunLayer and it.step.layer < blocks:
                        per[it.step.layer] = len(it.decision.cpu)
            yield _GraphToken(tok, blocks, ahead, tuple(per) if cpu else ())
        else:
            prev = None
        for it in buf:  # scores a token that skipped the graph (scheduler.graph)
            gate.see(it)
        yield from buf
        buf = []
    yield from buf


BACKGROUND_WAITS = ("host", "device")  # how the executor waits for awaited background copies
SWAP_WAITS = ("await", "stream")  # whether an awaited swap holds the token (Simulator.swaps)


class Simulator:
    """Runs driver items through the cost model; ``record=True`` keeps every span for a timeline.
    ``token_graph``: decode tokens may run as one CUDA graph, as ``moelab run`` does (with a host
    lane whose costs have ``graph_block_s``; ``scheduler.graph``). ``background_wait`` (host lane
    only), as ``execute.engine.ExpertEngine``'s: "device" (its default), the GPU's next expert work
    waits for awaited background copies and the host goes on, and a batch with a swap waits for the
    GPU work queued before it; "host", the host blocks until they land (polling, half of
    ``wait_poll_s`` charged) and every batch waits for the GPU work queued before it.
    ``swaps`` (without a host lane): "await" (default), an awaited batch holds the token until all
    its copies land; "stream": the fills (moves without a victim) started in a token hold the next
    token until they land, whatever the driver's lag; a swap never holds a token, and a step's hit
    on a swapped-in expert waits for that expert's copy (a copy stream's per-expert event: the
    seeds' pull request, whose fills follow the token that missed and whose swap rounds run beside
    generation). ``graph_cpu`` (with ``token_graph``): the graph hands a block's misses to the CPU
    pool (``scheduler.graph.CpuMisses`` decisions, ``execute.graph_cpu``): the host submits one call
    per block after the launch (``cpu_submit_s`` each), a block's put waits for its call, the pool
    starts ``handoff_in_s`` after the put and the block ends no earlier than ``handoff_out_s`` after
    the pool does; ``graph_cpu_block_s`` replaces ``graph_block_s`` for such a graph's blocks (a
    measured figure: its blocks launch more kernels than the resident-only graph's), and
    ``graph_cpu_pair_s`` is added to a block for each of its CPU pairs (measured: a CPU graph's block
    grows by about that much a pair, beyond what the pool's call alone would give; 0: the pool's
    call overlaps the block's GPU work).
    ``graph_cpu_stream`` (``MOELAB_GRAPH_CPU_STREAM=1``): the host settles block ``l``'s step
    (``graph_step_s``) once the graph's put of block ``l`` has run, submitting the first
    ``GRAPH_CPU_AHEAD`` calls after the launch and call ``l + GRAPH_CPU_AHEAD`` after settling block
    ``l``; it waits for the graph's end only after the last step."""

    def __init__(self, costs: Costs, record: bool = False, token_graph: bool = False,
                 background_wait: str = "device", swaps: str = "await", graph_cpu: bool = False,
                 graph_cpu_block_s: float | None = None, graph_cpu_stream: bool = False,
                 graph_cpu_pair_s: float = 0.0):
        if background_wait not in BACKGROUND_WAITS:
            raise ValueError(f"background_wait: {background_wait!r}, expected one of {', '.join(BACKGROUND_WAITS)}")
        if swaps not in SWAP_WAITS:
            raise ValueError(f"swaps: {swaps!r}, expected one of {', '.join(SWAP_WAITS)}")
        self.costs = costs
        self.record = record
        self.token_graph = token_graph
        self.graph_cpu = graph_cpu
        if graph_cpu_block_s is not None and not graph_cpu_block_s > 0:
            raise ValueError(f"graph_cpu_block_s: {graph_cpu_block_s}, expected > 0 seconds (or None)")
        self.graph_cpu_block_s = graph_cpu_block_s  # a CPU graph's block time, else graph_block_s
        if not graph_cpu_pair_s >= 0:
            raise ValueError(f"graph_cpu_pair_s: {graph_cpu_pair_s}, expected >= 0 seconds")
        self.graph_cpu_pair_s = graph_cpu_pair_s  # a CPU graph's block time per CPU pair
        self.graph_cpu_stream = graph_cpu_stream  # the host settles a CPU graph's blocks while it runs
        self.background_wait = background_wait
        self.swaps = swaps

    def run(self, items: Iterable, audit: Audit | None = None) -> SimResult:
        """Simulate ``items`` (from ``scheduler.drive``); each is also fed to ``audit``."""
        env = simpy.Environment()
        if audit is None:
            audit = Audit(self._geometry(), keep_records=False)
        out: dict = {}
        proc = self._process if self.costs.host is None else self._process_host
        env.process(proc(env, items, audit, out))
        env.run()
        return SimResult(audit=audit, **out)

    def _geometry(self):
        return self.costs.model.geometry()

    def _process(self, env, items, audit, out):
        c = self.costs
        dense_s, kv_s, gexp, up_s, cpu_call, promo_s = (c.dense_s, c.kv_s_per_pos, c.gpu_expert_s, c.upload_s,
                                                        c.cpu_call_s, c.promote_s)
        launch, route_s, small, combine, token_s = (c.expert_launch_s, c.route_s, c.small_copy_s, c.combine_s,
                                                    c.token_s)
        observe = audit.observe
        events = [] if self.record else None
        pending: deque = deque()  # (completion event, time) of background batches, FIFO
        tok_times, bounds, decode = array("d"), array("d"), array("b")  # per token, 17 bytes
        t = gpu_free = copy_free = cpu_free = 0.0
        gpu_busy = copy_busy = cpu_busy = 0.0
        tok_start = 0.0
        tok_bound = 0.0
        ends: deque = deque()  # completion time of each pending batch
        ready, mid = 0.0, False  # prefetch awaited inside the token: the next layer's experts wait
        land: dict = {}  # (layer, expert) -> when its background copy lands
        stream = self.swaps == "stream"
        streamed: dict = {}  # (layer, expert) -> when its swap's copy lands (swaps="stream")
        hold = 0.0  # swaps="stream": when the fills started so far land (the next token waits for them)
        late = 0
        for item in items:
            observe(item)
            kind = type(item)
            if kind is RunLayer:
                d = item.decision
                step = d.step
                tok = item.token
                l = step.layer
                if t < gpu_free:
                    t = gpu_free
                t0 = t
                if step.counts is None and tok.num_tokens == 1:
                    g = dense_s[l] + (tok.pos + 1) * kv_s[l]
                    nh = len(d.hits)
                    hit_s = launch + nh * gexp[l] if nh else 0.0
                    nu = len(d.uploads) + len(d.streams)
                    upc_s = launch + nu * gexp[l] if nu else 0.0
                    nc = len(d.cpu)
                    cpu_s = cpu_call(l, nc)
                else:
                    g, hit_s, upc_s, cpu_s, nu, nc = self._multi(d, tok)
                decide = t0 + g + route_s
                if streamed:  # a hit on a swapped-in expert waits for its copy
                    for e in d.hits:
                        at = streamed.get((l, e), 0.0)
                        if at > decide:
                            decide = at
                if ready > decide:
                    late += sum(1 for e in d.hits if land.get((l, e), 0.0) > decide)
                    decide = ready
                ready, mid = 0.0, True
                gpu = decide + hit_s
                if events is not None:
                    events.append(("gpu", f"L{l} dense", t0, g))
                    if hit_s:
                        events.append(("gpu", f"L{l} hits x{len(d.hits)}", decide, hit_s))
                p = 0.0
                if nu:
                    u = up_s[l]
                    cs = copy_free if copy_free > decide else decide
                    p = nu * u
                    copy_free = cs + p
                    if copy_free > gpu:
                        gpu = copy_free
                    if events is not None:
                        for i, e in enumerate(d.uploads + d.streams):
                            events.append(("copy", f"L{l} E{e}", cs + i * u, u))
                        events.append(("gpu", f"L{l} uploaded x{nu}", gpu, upc_s))
                    gpu += upc_s
                if nc:
                    c0 = decide + small
                    if cpu_free > c0:
                        c0 = cpu_free
                    cpu_free = c0 + cpu_s
                    cend = cpu_free + small
                    if cend > gpu:
                        gpu = cend
                    if events is not None:
                        events.append(("cpu", f"L{l} cpu x{nc}", c0, cpu_s))
                        events.append(("gpu", f"L{l} add cpu", gpu, combine))
                    gpu += combine
                    cpu_busy += cpu_s
                pro_s = 0.0
                if d.promotions:
                    pro_s = len(d.promotions) * promo_s[l]
                    if events is not None:
                        events.append(("gpu", f"L{l} promote x{len(d.promotions)}", gpu, pro_s))
                    gpu += pro_s
                gwork = g + hit_s + upc_s + (combine if nc else 0.0) + pro_s
                gpu_busy += gwork
                copy_busy += p
                tok_bound += max(gwork, p, cpu_s)
                t = gpu_free = gpu
            elif kind is EndToken:
                tok = item.token
                if events is not None:
                    events.append(("gpu", "head", t, token_s))
                t += token_s
                gpu_busy += token_s
                if hold > t:  # swaps="stream": this token's fills land before the next token starts
                    if events is not None:
                        events.append(("gpu", "await fills", t, hold - t))
                    t = hold
                gpu_free = t
                tok_times.append(t - tok_start)
                bounds.append(tok_bound + token_s)
                decode.append(tok.phase == "decode")
                if events is not None:
                    events.append(("token", f"token {tok.index}", tok_start, t - tok_start))
                tok_start, tok_bound = t, 0.0
                mid = False
                yield env.timeout(t - env.now)
            elif kind is StartBackground:
                start = copy_free if copy_free > t else t
                cs = held = start
                for m in item.moves:
                    u = up_s[m.layer]
                    if events is not None:
                        events.append(("copy", f"bg L{m.layer} E{m.expert}", cs, u))
                    cs += u
                    land[m.layer, m.expert] = cs
                    if stream and m.victim is not None:
                        streamed[m.layer, m.expert] = cs
                    else:
                        held = cs
                if not stream:
                    held = cs
                elif held > hold:
                    hold = held
                copy_busy += cs - start
                copy_free = cs
                pending.append(env.timeout(held - env.now))
                ends.append(held)
            elif kind is AwaitBackground:
                done, end = pending.popleft(), ends.popleft()
                if mid:
                    ready = max(ready, end)
                elif not done.processed:
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    if not done.processed:
                        yield done
                    if env.now > t:
                        if events is not None:
                            events.append(("gpu", "await background", t, env.now - t))
                        t = env.now
            else:
                raise TypeError(f"simulator cannot run {kind.__name__}")
        out.update(token_s=np.array(tok_times), bound_s=np.array(bounds), decode=np.array(decode, dtype=bool),
                   total_s=t, gpu_busy_s=gpu_busy, copy_busy_s=copy_busy, cpu_busy_s=cpu_busy,
                   events=events or [], late_hits=late)
        if t > env.now:
            yield env.timeout(t - env.now)

    def _process_host(self, env, items, audit, out):
        """The executor's order (``execute.engine.ExpertEngine._run_gpu``) on four lanes: host thread
        ``h`` (issues everything, waits at read-backs), GPU compute stream ``g``, copy engine ``cf``,
        CPU pool ``p``. Per layer: scheduler plan; dense issued (the GPU runs it from when the host
        starts issuing); router logits read back (the host waits for the GPU); the engine plans;
        with CPU experts, the input is fetched and the job submitted (the pool starts
        ``cpu_start_s`` after the submit) and the GIL handed over; uploads queued (the copy engine
        starts as the first is queued); the GPU experts queued (they run after the copies); with
        CPU experts the host waits for the pool (plus ``cpu_return_s``) and queues the rows'
        upload; the combine. The token ends when the head's sampled id is read back. The engine's
        plan takes ``plan_copy_s`` longer per copy the previous layer queued, and a layer with
        copies pays ``copy_round_s`` once to open its copy round. With the mapped-memory hand-off
        (``HostCosts.handoff``) a one-token layer's CPU experts are submitted gated, the GPU puts
        their input after the dense part, the pool starts ``handoff_in_s`` later, the GPU's combine
        waits until ``handoff_out_s`` after the pool ends, and the host never waits for the pool.
        A one-token step of hits and uploads only takes the engine's one-token path
        (``engine._run_one``): with ``Costs.one_s`` its experts cost the GPU ``one_s`` +
        ``one_expert_s`` each, the combine included. A one-token step with streamed experts and none on
        the CPU takes the engine's general path: the host pays ``host_stream_layer_s`` + ``host_stream_s``
        per streamed expert (the hardware file's executor keys, 0 where absent) before its copies. The
        pool's rows come back by a host -> device copy on the one copy engine, so a layer with CPU
        experts ends no earlier than the copies queued before them (background fills and swaps
        included: the copy engine serves them in order)."""
        c, hc = self.costs, self.costs.host
        dense_s, kv_s, gexp, up_s, cpu_call, promo_s = (c.dense_s, c.kv_s_per_pos, c.gpu_expert_s, c.upload_s,
                                                        c.cpu_call_s, c.promote_s)
        batch, combine = c.expert_launch_s, c.combine_s
        one_s, one_e = c.one_s, c.one_expert_s
        ex = c.hw.executor or {}
        stream_layer_s, stream_s = ex.get("host_stream_layer_s", 0.0), ex.get("host_stream_s", 0.0)
        observe = audit.observe
        events = [] if self.record else None
        pending: deque = deque()
        tok_times, bounds, decode = array("d"), array("d"), array("b")  # per token, 17 bytes
        h = g = cf = p = 0.0
        prev_nu = 0  # copies queued by the previous layer
        gpu_busy = copy_busy = cpu_busy = 0.0
        tok_start = tok_bound = 0.0
        ready, mid = 0.0, False  # as in _process
        device_wait = self.background_wait == "device"
        land: dict = {}
        late = 0
        L = len(dense_s)
        settle, whole, launch_next = -1, False, 0.0  # token graph: steps below settle were computed by it
        streamed = False  # the settled steps were charged inside the graph's chain
        table_dirty = False  # the slot table changed since the last graph's launch (its staged copy goes up)
        if self.token_graph and hc.graph_block_s > 0:
            items = graph_tokens(items, L, self.graph_cpu)
            cum_dense, cum_kv = np.concatenate(([0.0], np.cumsum(dense_s))), float(np.sum(kv_s))
        for item in items:
            kind = type(item)
            if kind is _GraphToken:  # the graph on the GPU, the host waits for it (execute.token_graph)
                m, pos1 = item.blocks, item.token.pos + 1
                blk = self.graph_cpu_block_s if item.cpu and self.graph_cpu_block_s else hc.graph_block_s
                gg = (m * blk + float(cum_dense[L] - cum_dense[min(m, L)]) + pos1 * cum_kv + c.head_s
                      + sum(item.cpu) * self.graph_cpu_pair_s)
                if item.ahead:
                    g0 = max(g, launch_next)
                else:  # a changed slot table goes up by a copy queued behind the copies before it
                    h += hc.graph_token_s
                    g0 = max(g, h, cf) if table_dirty else max(g, h)
                table_dirty = False
                gpu_busy += gg
                busy = 0.0
                streamed = bool(item.cpu) and self.graph_cpu_stream
                if item.cpu:  # the blocks' CPU calls, submitted after the launch, in the graph's chain
                    g, p, busy, spans, hs = _graph_cpu_chain(g0, h, p, item.cpu, pos1, c, hc, self.graph_cpu_block_s,
                                                             streamed, self.graph_cpu_pair_s)
                    h = hs
                    cpu_busy += busy
                    if events is not None:
                        events.extend(spans)
                else:
                    g = g0 + gg
                h = max(h, g)
                whole = m >= L
                if whole:  # its logits are final: sample, launch the next token, then settle these steps
                    h += hc.graph_token_s
                    launch_next = h
                settle = m
                tok_bound += max(gg, hc.graph_token_s + m * hc.graph_step_s, busy)
                if events is not None:
                    events.append(("gpu", f"token graph {m}/{L} blocks", g0, gg))
                continue
            observe(item)
            if kind is RunLayer and item.decision.step.layer < settle:  # computed by the graph: settled
                h += 0.0 if streamed else hc.graph_step_s
                prev_nu = 0
                ready, mid = 0.0, True
                continue
            if kind is RunLayer:
                d = item.decision
                tok = item.token
                l = d.step.layer
                if d.uploads or d.evictions or d.promotions:
                    table_dirty = True
                h += hc.plan_s
                comb = combine
                if d.step.counts is None and tok.num_tokens == 1:
                    gd = dense_s[l] + (tok.pos + 1) * kv_s[l]
                    n_gpu = len(d.hits) + len(d.uploads) + len(d.streams)
                    nc = len(d.cpu)
                    if one_s is not None and n_gpu and not (nc or d.streams or d.promotions):  # engine._run_one
                        gx, comb = one_s + n_gpu * one_e[l], 0.0
                    else:
                        gx = batch + n_gpu * gexp[l] if n_gpu else 0.0
                    cpu_s = cpu_call(l, nc)
                    nu = len(d.uploads) + len(d.streams)
                else:
                    gd, hit_s, upc_s, cpu_s, nu, nc = self._multi(d, tok)
                    n_gpu = len(d.hits) + nu
                    gx = hit_s + upc_s - (batch if d.hits and nu else 0.0)
                h0 = h
                g = max(g, h0) + gd
                if events is not None:
                    events.append(("gpu", f"L{l} dense", g - gd, gd))
                lp = hc.layer_plan_s + prev_nu * hc.plan_copy_s  # the previous layer's copies in flight
                prev_nu = nu
                h = max(h0 + hc.dense_s, g) + hc.readback_s + lp
                wait_g = 0.0  # device wait: the layer's experts start after the awaited copies
                if ready > h:
                    late += sum(1 for e in d.hits if land.get((l, e), 0.0) > h)
                    if device_wait:
                        wait_g = ready
                    else:
                        h = ready + hc.wait_poll_s / 2
                ready, mid = 0.0, True
                h_lane = hc.plan_s + hc.dense_s + hc.readback_s + lp
                handoff = nc and hc.handoff and d.step.counts is None and tok.num_tokens == 1
                if handoff:  # gated submit; the GPU puts the input after the dense part, the pool waits for it
                    h += hc.cpu_submit_s
                    g = max(g, h)
                    c0 = max(p, g + hc.handoff_in_s)
                    p = c0 + cpu_s
                    cpu_busy += cpu_s
                    h_lane += hc.cpu_submit_s
                    if events is not None:
                        events.append(("cpu", f"L{l} cpu x{nc}", c0, cpu_s))
                elif nc:
                    h += hc.cpu_submit_s
                    c0 = max(p, h + hc.cpu_start_s)
                    p = c0 + cpu_s
                    cpu_busy += cpu_s
                    h += hc.cpu_handoff_s
                    h_lane += hc.cpu_submit_s + hc.cpu_handoff_s + hc.cpu_combine_s
                    if events is not None:
                        events.append(("cpu", f"L{l} cpu x{nc}", c0, cpu_s))
                if d.streams and not nc and d.step.counts is None and tok.num_tokens == 1:  # the general path
                    hs = stream_layer_s + len(d.streams) * stream_s  # (host_stream_*: scheduler.hardware)
                    h += hs
                    h_lane += hs
                pcopy = 0.0
                if nu:
                    cs = max(cf, h)
                    hq = hc.copy_round_s + nu * hc.copy_s
                    h += hq
                    pcopy = nu * up_s[l]
                    cf = cs + pcopy
                    copy_busy += pcopy
                    h_lane += hq
                    if events is not None:
                        events.append(("copy", f"L{l} x{nu}", cs, pcopy))
                if n_gpu:
                    q = (hc.cpu_queue_s if nc else hc.gpu_queue_s) + (n_gpu - 1) * hc.gpu_expert_s
                    h += q
                    h_lane += q
                    g0 = max(g, h, cf if nu else 0.0, wait_g)
                    g = g0 + gx
                    if events is not None:
                        events.append(("gpu", f"L{l} experts x{n_gpu}", g0, gx))
                if handoff:  # the combine kernel waits for the pool's rows; the host does not
                    g = max(g, p + hc.handoff_out_s, cf)  # the rows' copy in, behind the copies queued before
                elif nc:
                    h = max(h, p + hc.cpu_return_s) + hc.cpu_combine_s
                    g = max(g, h, cf)
                else:
                    h += hc.layer_combine_s
                    h_lane += hc.layer_combine_s
                pro_s = len(d.promotions) * promo_s[l]
                g += comb + pro_s
                gwork = gd + gx + comb + pro_s
                gpu_busy += gwork
                tok_bound += max(gwork, pcopy, cpu_s, h_lane)
            elif kind is EndToken:
                tok = item.token
                if whole:  # the head ran in the graph
                    bounds.append(tok_bound)
                else:
                    h0 = h
                    g = max(g, h0) + c.head_s
                    gpu_busy += c.head_s
                    h = max(h0 + hc.head_s, g) + hc.readback_s
                    bounds.append(tok_bound + max(c.head_s, hc.head_s) + hc.readback_s)
                tok_times.append(h - tok_start)
                decode.append(tok.phase == "decode")
                if events is not None:
                    if not whole:
                        events.append(("gpu", "head", g - c.head_s, c.head_s))
                    events.append(("token", f"token {tok.index}", tok_start, h - tok_start))
                settle, whole = -1, False
                tok_start, tok_bound = h, 0.0
                mid = False
                yield env.timeout(h - env.now)
            elif kind is StartBackground:  # a batch that may overwrite a slot read by queued kernels waits for them
                table_dirty = table_dirty or bool(item.moves)
                kernels = not device_wait or any(m.victim is not None for m in item.moves)
                cs = max(cf, h, g) if kernels else max(cf, h)
                n = len(item.moves)
                h += n * hc.copy_s
                p_bg = 0.0
                for m in item.moves:
                    p_bg += up_s[m.layer]
                    land[m.layer, m.expert] = cs + p_bg
                cf = cs + p_bg
                copy_busy += p_bg
                if events is not None and n:
                    events.append(("copy", f"background x{n}", cs, p_bg))
                pending.append(cf)
            elif kind is AwaitBackground:
                done = pending.popleft()
                table_dirty = table_dirty or bool(item.moves)
                if mid or device_wait:  # device: the next layer's experts wait, whether or not inside a token
                    ready = max(ready, done)
                elif done > h:
                    if events is not None:
                        events.append(("token", "await background", h, done - h))
                    h = done + hc.wait_poll_s / 2
            else:
                raise TypeError(f"simulator cannot run {kind.__name__}")
        out.update(token_s=np.array(tok_times), bound_s=np.array(bounds), decode=np.array(decode, dtype=bool),
                   total_s=h, gpu_busy_s=gpu_busy, copy_busy_s=copy_busy, cpu_busy_s=cpu_busy,
                   events=events or [], late_hits=late)
        if h > env.now:
            yield env.timeout(h - env.now)

    def _multi(self, d, tok):
        """Times of a step with token counts (prefill or verification batches)."""
        c = self.costs
        step = d.step
        l = step.layer
        cnt = dict(zip(step.experts, step.counts)) if step.counts is not None else {}
        n = tok.num_tokens
        g = c.dense(l, tok.pos + n, n)
        hit_s = c.expert_launch_s + c.gpu_experts(l, [cnt.get(e, 1) for e in d.hits]) if d.hits else 0.0
        up = d.uploads + d.streams
        upc_s = c.expert_launch_s + c.gpu_experts(l, [cnt.get(e, 1) for e in up]) if up else 0.0
        cpu_s = c.cpu_call_s(l, len(d.cpu), [cnt.get(e, 1) for e in d.cpu])
        return g, hit_s, upc_s, cpu_s, len(up), len(d.cpu)


def _graph_cpu_chain(g0: float, h0: float, p: float, cpu: tuple, pos1: int, c, hc,
                     block_s: float | None = None, stream: bool = False, pair_s: float = 0.0) -> tuple:
    """A token graph whose blocks hand ``cpu[l]`` misses each to the pool (``Simulator``'s
    ``graph_cpu``), launched at ``g0`` by the host at ``h0``, the pool free at ``p``, each block
    ``block_s`` (None: ``graph_block_s``) plus its attention and ``pair_s`` a CPU pair: -> (the
    graph's end, the pool's, the pool's busy seconds, CPU spans for the timeline, the host's time
    after its submits; with
    ``stream`` after settling every block's step too, ``Simulator``'s ``graph_cpu_stream``)."""
    t, busy, spans = g0, 0.0, []
    base = hc.graph_block_s if block_s is None else block_s
    L = len(cpu)
    first = min(GRAPH_CPU_AHEAD, L) if stream else L
    sub = [h0 + (l + 1) * hc.cpu_submit_s for l in range(first)]  # when each call is submitted
    h, puts = h0 + first * hc.cpu_submit_s, []
    for l, nc in enumerate(cpu):
        if l >= first:  # submitted once the host has settled the block GRAPH_CPU_AHEAD before it
            h = max(h, puts[l - first]) + hc.graph_step_s + hc.cpu_submit_s
            sub.append(h)
        block = base + pos1 * c.kv_s_per_pos[l]
        dense = min(c.dense_s[l] + pos1 * c.kv_s_per_pos[l], block)
        put = max(t + dense, sub[l])  # the put waits for the host's call
        puts.append(put)
        end = put + block - dense + nc * pair_s
        if nc:
            cpu_s = c.cpu_call_s(l, nc)
            c0 = max(p, put + hc.handoff_in_s)
            p = c0 + cpu_s
            busy += cpu_s
            end = max(end, p + hc.handoff_out_s)
            spans.append(("cpu", f"L{l} cpu x{nc}", c0, cpu_s))
        t = end
    if stream:
        for l in range(L - first, L):  # the steps settled after the last submit
            h = max(h, puts[l]) + hc.graph_step_s
    return t + c.head_s, p, busy, spans, h
