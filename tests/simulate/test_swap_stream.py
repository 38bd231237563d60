"""Swaps beside generation (``Simulator(swaps="stream")``, the seeds' pull request): a token's
fills hold the next token until they land, whatever the driver's lag; a swap holds no token, and
a hit on a swapped-in expert waits for that expert's copy."""
from __future__ import annotations

import pytest

from scheduler import AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from simulate import Costs, ExecConfig, Simulator

from .conftest import round_hardware, tiny_model

UP = 3e6 / 5e9  # one F16 expert of 3 MB, pageable at 5 GB/s


def run(moves_of, swaps: str, hit_next=()):
    """Token 0 hits expert 0 and starts ``moves_of``; token 1 (the batch awaited at its start) hits
    expert 0 and ``hit_next``; token 2 hits expert 0. Returns the three token times."""
    model = tiny_model(num_experts=8)
    c = Costs(model, round_hardware(copy_latency_s=0.0), ExecConfig(pinned=False))
    toks = [Token(i, 0, i, "decode", (Step(0, (0,) + (tuple(hit_next) if i == 1 else ())),)) for i in range(3)]
    out = []
    for i, t in enumerate(toks):
        if i == 1:
            out.append(AwaitBackground(moves_of))
        s = t.steps[0]
        out.append(RunLayer(t, s, Decision(s, s.experts)))
        if i == 0:
            out.append(StartBackground(t, moves_of))
        out.append(EndToken(t))
    return Simulator(c, swaps=swaps).run(out).token_s


def test_a_swap_holds_no_token_and_a_fill_still_holds_the_next():
    fills, swaps = (Move(0, 1, 1), Move(0, 2, 2)), (Move(0, 1, 1, victim=(0, 5)), Move(0, 2, 2, victim=(0, 6)))
    plain = run((), "await")
    assert run(swaps, "await").sum() > plain.sum() + UP  # awaited swaps hold token 1 for their copies
    assert run(swaps, "stream").tolist() == pytest.approx(plain.tolist())  # nothing waits for them
    for mode in ("await", "stream"):  # fills hold the next token either way
        assert run(fills, mode).sum() > plain.sum() + UP


def test_a_hit_on_a_swapped_in_expert_waits_for_its_copy():
    swaps = (Move(0, 1, 1, victim=(0, 5)), Move(0, 2, 2, victim=(0, 6)))
    plain = run((), "stream", hit_next=(2,))
    waits = run(swaps, "stream", hit_next=(2,))  # expert 2 lands after both copies
    assert waits[1] > plain[1] + UP
    with pytest.raises(ValueError, match="swaps: 'later'"):
        Simulator(Costs(tiny_model(), round_hardware(), ExecConfig()), swaps="later")
