"""A prefetch awaited inside a token (a policy's ``plan_prefetch``) delays the next layer's
experts, not its dense part: the copy overlaps the dense part and the route readback.

Tiny model with two layers (see test_engine's numbers): dense 4 us, route readback 10 us, an
upload 310 us, a GPU expert batch 3 + 30 us per expert."""
from __future__ import annotations

import pytest

from scheduler import AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from simulate import Costs, Simulator

from .conftest import tiny_model

US = 1e-6


def run(model, hw, exec_cfg, items):
    costs = Costs(model, hw, exec_cfg)
    return Simulator(costs).run(iter(items)).total_s


@pytest.fixture
def model2():
    return tiny_model(num_layers=2)


def token_items(prefetch: bool):
    t = Token(0, 0, 0, "decode", ())
    s0, s1 = Step(0, (0,)), Step(1, (1,))
    items = [RunLayer(t, s0, Decision(s0, (0,)))]
    if prefetch:
        moves = (Move(1, 1, 0),)
        items += [StartBackground(t, moves), AwaitBackground(moves), RunLayer(t, s1, Decision(s1, (1,)))]
    else:
        items += [RunLayer(t, s1, Decision(s1, (), uploads=(1,), slots=(0,)))]
    return items + [EndToken(t)]


def test_prefetch_overlaps_the_next_layers_dense_part(model2, hw, exec_cfg):
    """Prefetched: the copy starts when layer 0 ends and layer 1's dense part and readback run
    meanwhile; on demand the copy starts only after them. Same bytes, 14 us apart."""
    demand = run(model2, hw, exec_cfg, token_items(False))
    prefetched = run(model2, hw, exec_cfg, token_items(True))
    assert demand - prefetched == pytest.approx((4 + 10) * US, abs=0.01 * US)


def test_await_between_tokens_still_blocks_the_dense_part(model2, hw, exec_cfg):
    """Background copies awaited at a token's start keep their old timing: the first layer's
    dense part waits for them."""
    t0, t1 = Token(0, 0, 0, "decode", ()), Token(1, 0, 1, "decode", ())
    s = Step(0, (0,))
    moves = (Move(1, 1, 0),)
    base = [RunLayer(t0, s, Decision(s, (0,))), EndToken(t0)]
    items = base + [StartBackground(t0, moves), AwaitBackground(moves), RunLayer(t1, s, Decision(s, (0,))),
                    EndToken(t1)]
    plain = base + [RunLayer(t1, s, Decision(s, (0,))), EndToken(t1)]
    one = run(model2, hw, exec_cfg, base)
    # the copy (310 us) starts at token 0's end; token 1's work follows it in full
    assert run(model2, hw, exec_cfg, items) == pytest.approx(one + 310 * US + (run(model2, hw, exec_cfg, plain) - one),
                                                             abs=0.01 * US)


def test_host_lane_prefetch_overlaps_the_dense_issue_and_readback(model2, exec_cfg):
    """With measured executor costs (the host lane): the prefetched copy runs while the host
    issues layer 1's dense part (50 us) and reads its router back (10 us); on demand the copy is
    queued only after them."""
    from .conftest import round_hardware

    hw = round_hardware(executor={"host_dense_s": 50 * US, "readback_s": 10 * US})
    demand = run(model2, hw, exec_cfg, token_items(False))
    prefetched = run(model2, hw, exec_cfg, token_items(True))
    assert demand - prefetched == pytest.approx((50 + 10) * US, abs=0.01 * US)
