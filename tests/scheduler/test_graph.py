"""The token graph's rule (scheduler.graph): the back-off and which blocks the graph runs."""
from __future__ import annotations

import ast
from pathlib import Path

from scheduler import Decision, Step
from scheduler.graph import MAX_SKIP, GraphBackoff, resident_at_launch


def test_backoff_doubles_after_incomplete_tokens_and_resets_after_a_complete_one():
    g = GraphBackoff()
    pattern = []
    for _ in range(40):
        tried = g.want()
        pattern.append(tried)
        if tried:
            g.done(False)
    # tried, skip 1, tried, skip 2, tried, skip 4, tried, skip 8, tried, skip 16 ...
    tries = [i for i, t in enumerate(pattern) if t]
    assert tries[:6] == [0, 2, 5, 10, 19, 36]
    while not g.want():
        pass
    g.done(True)  # a complete token: the next one tries again, and an incomplete one after it skips 1
    assert g.want() and g.backoff == 1
    g.done(False)
    assert not g.want() and g.want()


def test_backoff_is_capped():
    g = GraphBackoff()
    for _ in range(20):
        g.done(False)
    assert g.skip == MAX_SKIP and g.backoff == MAX_SKIP


def test_a_block_runs_in_the_graph_only_when_every_routed_expert_was_resident_at_launch():
    s = Step(3, (1, 2))
    assert resident_at_launch(Decision(s, (1, 2)))
    assert not resident_at_launch(Decision(s, (1,), uploads=(2,), slots=(0,)))
    assert not resident_at_launch(Decision(s, (1,), cpu=(2,)))
    assert not resident_at_launch(Decision(s, (1, 2)), arrived={(3, 2)})  # a hit that arrived after the launch
    assert resident_at_launch(Decision(s, (1, 2)), arrived=[(4, 2)])


def test_the_executors_token_graph_uses_the_same_cap():
    """execute.token_graph keeps the back-off on the host; its cap must be this one (read from the
    source: importing it needs CuPy)."""
    src = Path(__file__).resolve().parents[2] / "execute" / "token_graph.py"
    tree = ast.parse(src.read_text())
    caps = [n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "_MAX_SKIP" for t in n.targets)]
    uses = "GraphBackoff" in src.read_text()
    assert uses or caps == [MAX_SKIP]
