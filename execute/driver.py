"""The run loop: inputs (``TokenInput``, ``ChunkInput``) become scheduler Tokens whose steps run
the model lazily; ``run`` drives a policy over them with real compute (the model's dense path, a
backend's experts) and measures it (``RunResult``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .xp import env_switch
from .xp import host as _host

__all__ = ["TokenInput", "ChunkInput", "RunResult", "run", "settled_steps"]


@dataclass(frozen=True, slots=True)
class TokenInput:
    """One token to run: its trace identity, the input token id, and optional forced routes."""

    index: int
    seq: int
    pos: int
    phase: str
    token_id: int
    routes: tuple | None = None  # per block: Route or None


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """T tokens run as one batch (one scheduler Token of ``num_tokens`` T) at positions ``pos ..
    pos + T - 1``: a prefill chunk or a speculative verification batch. A ``pos`` before the end
    of what the sequence has run rolls the KV cache back to it first (rejected drafts)."""

    index: int
    seq: int
    pos: int
    phase: str
    token_ids: tuple[int, ...]
    routes: tuple | None = None  # per token: per block Route or None (or None: the router's)
    all_logits: bool = False  # keep every token's logits (verification), else the last one's

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("ChunkInput.token_ids: expected at least one token")
        if self.routes is not None and len(self.routes) != len(self.token_ids):
            raise ValueError(f"ChunkInput.routes: {len(self.routes)} entries, expected one per token "
                             f"({len(self.token_ids)})")


@dataclass
class RunResult:
    """What a run measured. Times are host wall-clock seconds, summed over tokens. ``tokens``
    counts positions run (a batch of T counts T), ``steps`` the batches (scheduler Tokens)."""

    audit: object
    tokens: int
    wall_s: float
    dense_s: np.ndarray  # (layers,) attention + router, per block
    experts_s: np.ndarray  # (layers,) the backend's run_layer, per block
    other_s: float  # head, background starts and waits, bookkeeping
    logits: list  # host (vocab,) arrays when kept: one per token (per kept row of a batch)
    steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict:
        per = max(self.tokens, 1)
        return {"tokens": self.tokens, "steps": self.steps, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "dense_ms_per_token": 1e3 * float(self.dense_s.sum()) / per,
                "experts_ms_per_token": 1e3 * float(self.experts_s.sum()) / per,
                "other_ms_per_token": 1e3 * self.other_s / per,
                "per_layer_ms_per_token": [{"layer": l, "dense": 1e3 * float(d) / per, "experts": 1e3 * float(e) / per}
                                           for l, (d, e) in enumerate(zip(self.dense_s, self.experts_s))]}


def settled_steps(model, ids: np.ndarray, weights: np.ndarray, id_rows: list, weight_rows: list, inputs):
    """The Steps of one token's blocks ``0 .. len(ids) - 1``, computed already (by a token graph):
    each is yielded with ``model.step_done`` set, so that ``run`` settles it instead of running it,
    and ``model.last_input`` / ``last_ids`` / ``last_weights`` set to ``inputs[l]`` and the block's
    rows of ``ids`` ``(m, k)`` int64 and ``weights`` ``(m, k)`` float32; ``id_rows`` and
    ``weight_rows`` are the same as lists (weights as float64), as ``ids.tolist()`` gives them."""
    from scheduler import Step

    model._route_len = [ids.shape[1]]
    for l in range(len(id_rows)):
        model.last_input, model.last_ids, model.last_weights = inputs[l], ids[l:l + 1], weights[l:l + 1]
        model.step_done = True
        try:
            yield Step(l, tuple(id_rows[l]), None, tuple(weight_rows[l]))
        finally:
            model.step_done = False


def _tokens(model, inputs) -> Iterator:
    """scheduler Tokens whose steps run the model lazily; a new sequence (or position 0) resets the
    KV cache, a position before the end of what the sequence has run rolls it back.

    With a token graph, the next input may be taken while a token is still being settled
    (``TokenGraph.ahead``): when a token's graph completes, its logits are final, so the next input
    (chosen from them, when a generation loop gives the inputs) is taken then and, when it is the
    sequence's next token, its graph is launched at once (``execute.token_graph``: Pipelining)."""
    from scheduler import Token

    it = iter(inputs)
    held: list = []  # an input taken ahead
    seq, end = None, 0
    tg = getattr(model, "token_graph", None)
    if tg is not None:
        def ahead(pos: int):
            t = next(it, None)
            if t is None:
                return None
            held.append(t)
            if (isinstance(t, TokenInput) and t.routes is None and t.seq == seq and t.pos == end == pos
                    and pos != 0):
                return t.token_id
            return None

        tg.ahead = ahead
    while True:
        t = held.pop() if held else next(it, None)
        if t is None:
            return
        if isinstance(t, ChunkInput):
            ids, routes, all_logits = t.token_ids, t.routes, t.all_logits
        else:
            ids, routes, all_logits = (t.token_id,), None if t.routes is None else (t.routes,), False
        back = 0
        if t.seq != seq or t.pos == 0:
            model.reset()
            seq, end = t.seq, t.pos
        elif t.pos < end:
            back, end = end - t.pos, t.pos
        end += len(ids)
        steps = model.chunk_steps(ids, routes, all_logits, back)
        if model.router_predictor is not None:
            steps = model.router_predictor.phased(t.phase, steps)
        yield Token(t.index, t.seq, t.pos, t.phase, steps, len(ids))


def run(model, backend, policy, inputs, lag_tokens: int = 1, audit=None,
        keep_logits: bool = False, progress=None) -> RunResult:
    """Drive ``policy`` over ``inputs`` (TokenInputs and ChunkInputs) with real compute: the model's
    dense path and ``backend`` for the experts (``run_layer(item, x (T, hidden), ids (T, k),
    weights (T, k)) -> y (T, hidden)``, ``start_background``, ``await_background``, optionally
    ``prepare(policy)`` before the first item; ``begin_layer(layer, x, ids)`` as each block's routing
    is known, before its step is planned; ``token_graph(model)``, a ``TokenGraph`` or None, to run
    decode tokens as one graph, whose steps then go to ``settle_layer(item)`` instead of
    ``run_layer``); ``device_chunk(model)``, a ``DeviceChunk`` or None, to run prefill chunks whose
    experts are all resident with no host wait per block (their steps settled likewise). With a
    token graph or a device chunk, the graph's or chunk's time is counted in block 0's dense time. Every
    driver item is also given to ``audit`` (an ``Audit``) if any; ``progress(tokens)`` is called
    after each batch with the positions run."""
    import contextlib
    import dataclasses
    import sys
    import time

    from scheduler import drive
    from scheduler.drive import AwaitBackground, EndToken, RunLayer, StartBackground

    begin = getattr(backend, "begin_layer", None)

    def started(steps):
        for step in steps:
            if not model.step_done:
                begin(step.layer, model.last_input, model.last_ids)
            yield step

    n_layers = model.info.num_layers
    dense, experts = [0.0] * n_layers, [0.0] * n_layers
    logits, tokens, steps = [], 0, 0
    prepare = getattr(backend, "prepare", None)
    if prepare is not None:
        prepare(policy)
    attach = getattr(backend, "token_graph", None)
    if attach is not None and getattr(model, "token_graph", 0) is None:
        model.token_graph = attach(model)
    attach = getattr(backend, "device_chunk", None)
    if attach is not None and getattr(model, "device_chunk", 0) is None:
        model.device_chunk = attach(model) or False  # False: asked once, the path does not apply
    gate = getattr(getattr(model, "token_graph", None), "gate", None)
    # MOELAB_DENSE_ON_COMPUTE=1: the dense path on the backend's compute stream (no events between the
    # two streams a step; off until measured on a GPU)
    streams = contextlib.ExitStack()
    on_compute = getattr(backend, "on_compute", None)
    if on_compute is not None and env_switch("MOELAB_DENSE_ON_COMPUTE", default="0"):
        streams.enter_context(on_compute())
    t0 = mark = time.perf_counter()
    other = 0.0
    tokens_in = _tokens(model, inputs)
    if begin is not None:
        tokens_in = (dataclasses.replace(t, steps=started(t.steps)) for t in tokens_in)
    clock = time.perf_counter
    settle = getattr(backend, "settle_layer", None)
    observe = audit.observe if audit is not None else None
    try:
        for item in drive(policy, tokens_in, lag_tokens):
            now = clock()
            kind = type(item)
            if kind is RunLayer:
                l = item.step.layer
                dense[l] += now - mark
                if model.step_done:  # the token's graph computed it
                    settle(item)
                else:
                    model.deliver(backend.run_layer(item, model.last_input, model.last_ids, model.last_weights))
                mark = clock()
                experts[l] += mark - now
            else:
                other += now - mark
                if kind is StartBackground:
                    backend.start_background(item.moves)
                elif kind is AwaitBackground:
                    backend.await_background(item.moves)
                elif kind is EndToken:
                    tokens += item.token.num_tokens
                    steps += 1
                    if keep_logits:
                        logits.extend(_host(model.chunk_logits).copy())
                    if progress is not None:
                        progress(tokens)
                mark = clock()
                other += mark - now
            if observe is not None:
                observe(item)
            if gate is not None:  # scores a token that skipped the graph (scheduler.graph)
                gate.see(item)
    finally:
        tg = getattr(model, "token_graph", None)
        if tg is not None:  # no input is taken ahead after the run; a graph launched ahead is waited for
            tg.ahead = None
            tg.drop()
        streams.__exit__(*sys.exc_info())  # (an error in flight: the stream context sees it)
    return RunResult(audit, tokens, time.perf_counter() - t0, np.array(dense), np.array(experts), other, logits, steps)
