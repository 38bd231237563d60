"""The dense path on the engine's compute stream (``MOELAB_DENSE_ON_COMPUTE=1``: ``execute.driver.run``
decodes inside the backend's ``on_compute``, ``ExpertEngine.on_compute``). On the host: the switch
enters the backend's context once per run, its default never, another value is one error naming it.
On a GPU: decode tokens of a 6-block model with ``lru`` on 3 of 8 slots (most steps upload) and
``hybrid`` (CPU pairs through the hand-off), block by block, with the token graph and with the late
start: bitwise the logits, routes and decisions of the default (the dense path on the caller's
stream, events between the two streams a step)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from execute import model as M
from execute.experts import ExecutorError
from scheduler import Capacity, make_policy
from scheduler import graph as scheduler_graph

from .conftest import cupy_or_skip, decode_bits


class Counted(M.NumpyExperts):
    """The float32 numpy backend with an ``on_compute`` context that counts its entries."""

    entered = 0

    @contextlib.contextmanager
    def on_compute(self):
        Counted.entered += 1
        yield


@pytest.mark.parametrize("value, entered", [(None, 0), ("0", 0), ("1", 1), ("on", None)])
def test_the_switch_enters_the_backends_stream_context_once_a_run(models, monkeypatch, value, entered):
    from execute.gguf_model import load_model

    if value is None:
        monkeypatch.delenv("MOELAB_DENSE_ON_COMPUTE", raising=False)
    else:
        monkeypatch.setenv("MOELAB_DENSE_ON_COMPUTE", value)
    w = load_model(models())
    g = w.info.geometry()
    Counted.entered = 0

    def run():
        return M.run(M.MoeModel(w, use_gpu=False), Counted(w), make_policy("cpu", g, Capacity.per_layer(g, 0)),
                     [M.TokenInput(i, 0, i, "decode", t) for i, t in enumerate([3, 1, 4])])

    if entered is None:
        with pytest.raises(ExecutorError, match="MOELAB_DENSE_ON_COMPUTE"):
            run()
        return
    assert run().tokens == 3
    assert Counted.entered == entered


def _run(w, tokens, policy: str, graph: bool, late: bool, on_compute: bool, monkeypatch):
    """(logits, route log, decision digest) of ``policy`` on 3 slots per layer."""
    return decode_bits(w, tokens, policy, monkeypatch, TOKEN_GRAPH=str(int(graph)), LATE_START=str(int(late)),
                       DENSE_ON_COMPUTE=str(int(on_compute)))[:3]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_the_dense_path_on_the_compute_stream_gives_the_bits(graph_models, policy, monkeypatch):
    cupy_or_skip()
    w = graph_models("qwen3moe")
    tokens = np.random.default_rng(7).integers(w.info.vocab, size=24).tolist()
    monkeypatch.setattr(scheduler_graph, "MAX_SKIP", 0)  # try the graph on (almost) every token
    logits, routes, digest = _run(w, tokens, policy, False, False, False, monkeypatch)
    for graph, late in ((False, False), (True, False), (False, True)):
        got, r, d = _run(w, tokens, policy, graph, late, True, monkeypatch)
        assert r == routes and d == digest, (graph, late)
        assert np.array_equal(got, logits), (graph, late)
