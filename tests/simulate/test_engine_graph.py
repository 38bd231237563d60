"""The token graph lane (simulate.engine, scheduler.graph): decode tokens whose experts are all
resident run as one CUDA graph, the host out of the loop but for one launch and read-back per
token and the settling of each step; the next token is launched while the host settles."""
from __future__ import annotations

import pytest

from scheduler import AwaitBackground, Decision, EndToken, Move, RunLayer, StartBackground, Step, Token
from simulate import Costs, ExecConfig, Simulator
from simulate.engine import _GraphToken, graph_tokens

from .conftest import round_hardware, tiny_model

US = 1e-6
L = 4
HOST = {"host_dense_s": 50 * US, "readback_s": 10 * US, "plan_s": {"gpu": 1 * US, "lru": 4 * US}}


def token_items(index: int, misses: dict | None = None, pos: int | None = None) -> list:
    """One decode token over L layers routed to experts (0, 1); ``misses`` {layer: expert}: uploaded."""
    t = Token(index, 0, index if pos is None else pos, "decode", ())
    out = []
    for l in range(L):
        s = Step(l, (0, 1))
        e = (misses or {}).get(l)
        d = (Decision(s, tuple(x for x in (0, 1) if x != e), uploads=(e,), slots=(2,)) if e is not None
             else Decision(s, (0, 1)))
        out.append(RunLayer(t, s, d))
    return out + [EndToken(t)]


def costs(graph: dict | None, policy: str = "gpu") -> Costs:
    return Costs(tiny_model(num_layers=L), round_hardware(executor={**HOST, **(graph or {})}), ExecConfig(policy=policy))


def times(c: Costs, items: list, graph: bool = True) -> list[float]:
    return list(Simulator(c, token_graph=graph).run(iter(items)).token_s)


def graph_s(c: Costs, pos: int, block: float) -> float:
    return L * block + (pos + 1) * sum(c.kv_s_per_pos) + c.head_s


@pytest.mark.parametrize("block_us, step_us", [(300, 3), (5, 30)])
def test_all_resident_tokens_pipeline_the_settling_behind_the_next_graph(block_us, step_us):
    """The next token's graph waits for this one's logits (read back, sampled, launched: the
    per-token host cost), then runs while the host settles this token's steps."""
    g = {"graph_block_s": block_us * US, "graph_step_s": step_us * US, "graph_token_s": 20 * US}
    c = costs(g)
    items = [it for i in range(6) for it in token_items(i)]
    t = times(c, items)
    for i in range(2, 6):
        assert t[i] == pytest.approx(20 * US + max(graph_s(c, i, block_us * US), L * step_us * US), rel=1e-6)
    # the first token is launched by the host and waited for, then settled: nothing overlaps
    assert t[0] == pytest.approx(20 * US + graph_s(c, 0, block_us * US) + (20 + L * step_us) * US, rel=1e-6)


def test_settled_steps_charge_the_policys_planning_in_place_of_gpus():
    g = {"graph_block_s": 5 * US, "graph_step_s": 30 * US, "graph_token_s": 20 * US}  # host-bound
    items = [it for i in range(4) for it in token_items(i)]
    gpu, lru = times(costs(g, "gpu"), items), times(costs(g, "lru"), items)
    assert lru[3] - gpu[3] == pytest.approx(L * 3 * US)  # lru plans 4 us a step, gpu 1


def test_without_graph_costs_or_with_the_lane_off_the_host_lane_is_unchanged():
    items = [it for i in range(3) for it in token_items(i)]
    plain = times(costs(None), items)
    g = {"graph_block_s": 5 * US, "graph_step_s": 3 * US, "graph_token_s": 20 * US}
    assert times(costs(g), items, graph=False) == plain
    assert times(costs(None), items, graph=True) == plain
    assert sum(times(costs(g), items)) < sum(plain)


def test_a_miss_halts_the_graph_and_backs_off():
    """Token 0 misses at layer 2: the graph ran blocks 0-1 (and every block's dense part), the host
    runs 2-3 block by block; token 1 skips the graph (back-off), token 2 tries it again."""
    items = token_items(0, {2: 3}) + token_items(1, {1: 3}) + token_items(2)
    marks = [it for it in graph_tokens(iter(items), L) if type(it) is _GraphToken]
    assert [(m.token.index, m.blocks, m.ahead) for m in marks] == [(0, 2, False), (2, L, False)]
    g = {"graph_block_s": 5 * US, "graph_step_s": 3 * US, "graph_token_s": 20 * US}
    with_g, plain = times(costs(g), items), times(costs(None), items)
    assert with_g[1] == pytest.approx(plain[1])  # block by block, as without the graph
    assert with_g[0] > plain[0] - 2 * (50 + 10) * US  # the halted graph's wasted dense launches are paid


def test_fills_awaited_after_a_launch_ahead_are_not_in_the_graph():
    """A token launched ahead was launched before the fills awaited at its start: a hit on one of
    them halts its graph; a token launched by the host sees them."""
    fill = AwaitBackground((Move(1, 0, 2),))
    items = token_items(0) + [fill] + token_items(1)
    marks = [it for it in graph_tokens(iter(items), L) if type(it) is _GraphToken]
    assert [(m.blocks, m.ahead) for m in marks] == [(L, False), (1, True)]
    items = token_items(0, {0: 3}) + [fill] + token_items(1) + [fill] + token_items(2)
    marks = [it for it in graph_tokens(iter(items), L) if type(it) is _GraphToken]
    assert [(m.token.index, m.blocks, m.ahead) for m in marks] == [(0, 0, False), (2, L, False)]


def test_batches_and_prefill_never_run_as_a_graph():
    t = Token(0, 0, 0, "prefill", (), 8)
    s = Step(0, (0, 1), (4, 4))
    items = [RunLayer(t, s, Decision(s, (0, 1))), EndToken(t)]
    assert not [it for it in graph_tokens(iter(items), L) if type(it) is _GraphToken]


# graph_cpu: the graph hands a block's misses to the CPU pool (scheduler.graph.CpuMisses decisions)

def cpu_items(index: int, cpu: dict | None = None) -> list:
    """One decode token over L layers routed to (0, 1); ``cpu`` {layer: expert}: a miss on the CPU."""
    t = Token(index, 0, index, "decode", ())
    out = []
    for l in range(L):
        s = Step(l, (0, 1))
        e = (cpu or {}).get(l)
        out.append(RunLayer(t, s, Decision(s, tuple(x for x in (0, 1) if x != e), cpu=(e,)) if e is not None
                            else Decision(s, (0, 1))))
    return out + [EndToken(t)]


GCPU = {"graph_block_s": 40 * US, "graph_step_s": 3 * US, "graph_token_s": 20 * US, "handoff_in_s": 2 * US,
        "handoff_out_s": 5 * US, "host_cpu_submit_s": 4 * US}


def test_with_graph_cpu_every_token_completes_and_its_blocks_cpu_counts_are_marked():
    items = cpu_items(0, {1: 1}) + cpu_items(1) + cpu_items(2, {0: 0, 3: 1})
    marks = [it for it in graph_tokens(iter(items), L, cpu=True) if type(it) is _GraphToken]
    assert [(m.blocks, m.ahead, m.cpu) for m in marks] == [(L, False, (0, 1, 0, 0)), (L, False, (0,) * L),
                                                           (L, False, (1, 0, 0, 1))]
    # without graph_cpu a CPU pair halts the graph there
    assert [m.blocks for m in graph_tokens(iter(cpu_items(0, {1: 1})), L) if type(m) is _GraphToken] == [1]


def test_a_miss_on_the_cpu_holds_its_block_until_the_pool_is_done():
    """The block's put waits for the host's call, the pool starts handoff_in_s after it and the block
    ends handoff_out_s after the pool; a token without misses costs the graph's blocks alone."""
    c = costs(GCPU, "lru")
    cpu_s = c.cpu_call_s(1, 1)
    assert cpu_s > 40 * US  # the pool is the longer part of the block
    hit = times_cpu(c, cpu_items(0) + cpu_items(1))
    miss = times_cpu(c, cpu_items(0) + cpu_items(1, {1: 1}))
    block1 = 40 * US + 2 * sum(c.kv_s_per_pos[1:2])
    dense1 = min(c.dense_s[1] + 2 * c.kv_s_per_pos[1], block1)
    assert miss[1] - hit[1] == pytest.approx(2 * US + cpu_s + 5 * US - (block1 - dense1), rel=1e-6)


def test_graph_cpu_gives_the_same_decisions_and_refuses_an_upload():
    from scheduler import Audit

    items = cpu_items(0, {1: 1}) + cpu_items(1, {2: 0})
    a, b = Audit(tiny_model(num_layers=L).geometry(), keep_log=True), Audit(tiny_model(num_layers=L).geometry(),
                                                                           keep_log=True)
    Simulator(costs(GCPU, "lru"), token_graph=True, graph_cpu=True).run(iter(items), a)
    Simulator(costs(GCPU, "lru"), token_graph=False).run(iter(items), b)
    assert a.digest() == b.digest()
    with pytest.raises(ValueError, match="CpuMisses"):
        times_cpu(costs(GCPU, "lru"), token_items(0, {1: 3}))


def times_cpu(c: Costs, items: list) -> list[float]:
    return list(Simulator(c, token_graph=True, graph_cpu=True).run(iter(items)).token_s)


@pytest.mark.parametrize("policy", ["lru", "hybrid", "cpu"])
@pytest.mark.parametrize("lag", [0, 1])
def test_graph_cpu_on_a_random_trace_gives_the_replays_decisions_and_never_beats_the_bound(policy, lag):
    import numpy as np

    from scheduler import Capacity, drive, make_policy, replay
    from scheduler.graph import CpuMisses

    from .conftest import decode_tokens

    rng = np.random.default_rng(3)
    model = tiny_model(num_layers=L, num_experts=8, top_k=2)
    g = model.geometry()
    toks = decode_tokens([[tuple(int(e) for e in rng.choice(8, 2, replace=False)) for _ in range(L)]
                          for _ in range(30)])
    new = lambda: CpuMisses(make_policy(policy, g, Capacity.per_layer(g, 3)))
    c = Costs(model, round_hardware(executor={**HOST, **GCPU}), ExecConfig(policy=policy))
    from scheduler import Audit

    sim = Audit(g, keep_log=True, keep_records=False)
    r = Simulator(c, token_graph=True, graph_cpu=True, graph_cpu_stream=lag == 1).run(drive(new(), toks, lag), sim)
    ref = replay(new(), toks, lag, Audit(g, keep_log=True, keep_records=False))
    assert sim.digest() == ref.digest() and sim.summary() == ref.summary()
    assert np.all(r.token_s >= r.bound_s * (1 - 1e-12))
    if policy != "cpu":
        assert sim.summary()["uploads"] == 0 and sim.summary()["fills"] > 0


def test_a_cpu_graphs_own_block_time_replaces_the_resident_only_one():
    c = costs(GCPU, "lru")
    items = cpu_items(0) + cpu_items(1)
    base = list(Simulator(c, token_graph=True, graph_cpu=True).run(iter(items)).token_s)
    slow = list(Simulator(c, token_graph=True, graph_cpu=True, graph_cpu_block_s=100 * US).run(iter(items)).token_s)
    assert slow[1] - base[1] == pytest.approx(L * 60 * US, rel=1e-6)  # 40 -> 100 us a block, no miss
    with pytest.raises(ValueError, match="graph_cpu_block_s"):
        Simulator(c, graph_cpu=True, graph_cpu_block_s=0.0)


@pytest.mark.parametrize("ahead", [2, 15])
def test_streamed_settling_overlaps_the_graph_and_keeps_the_decisions(ahead, monkeypatch):
    """graph_cpu_stream: block l's step is settled once its put has run, the calls past the first
    GRAPH_CPU_AHEAD submitted as the host settles; the host's settling hides behind the graph."""
    import simulate.engine as E
    from scheduler import Audit

    monkeypatch.setattr(E, "GRAPH_CPU_AHEAD", ahead)
    c = costs(GCPU, "lru")
    items = cpu_items(0, {1: 1}) + cpu_items(1) + cpu_items(2, {0: 0, 3: 1})
    runs = {}
    for stream in (False, True):
        a = Audit(tiny_model(num_layers=L).geometry(), keep_log=True)
        r = Simulator(c, token_graph=True, graph_cpu=True, graph_cpu_stream=stream).run(iter(items), a)
        runs[stream] = (list(r.token_s), a.digest(), r.bound_s)
    (off, d0, _), (on, d1, bound) = runs[False], runs[True]
    assert d0 == d1
    for t0, t1, b in zip(off, on, bound):
        assert b * (1 - 1e-12) <= t1 <= t0 and t0 - t1 <= L * c.host.graph_step_s * (1 + 1e-9)
    assert sum(off) - sum(on) > 0


def with_fill(items: list, moves: tuple) -> list:
    """A token's items with a background batch started after its last step (before its EndToken),
    as ``scheduler.drive`` yields a token's fills."""
    return items[:-1] + [StartBackground(items[-1].token, moves)] + items[-1:]


def test_a_graph_launched_after_the_slot_table_changed_waits_for_the_copies_queued_before_it():
    """The host stages a changed slot table by a copy on the one copy engine, so a graph launched by
    the host after fills were started runs no earlier than they land (execute.token_graph's
    _stage_token); a token launched ahead was staged before them and does not wait."""
    c = costs({**GCPU, "host_cpu_submit_s": 0.0}, "lru")  # (the graph's puts then never wait for the host)
    fill = (Move(2, 0, 2, (2, 1)),)
    up = c.upload_s[2]
    assert up > 5 * GCPU["graph_token_s"]
    plain = times_cpu(c, cpu_items(0) + cpu_items(1))
    filled = times_cpu(c, with_fill(cpu_items(0), fill) + cpu_items(1))
    # token 0's graph has ended when its fill starts (it evicts: the copy waits for the kernels);
    # token 1's launch costs graph_token_s on the host, then waits for the copy
    assert sum(filled) - sum(plain) == pytest.approx(up - GCPU["graph_token_s"], rel=1e-6)
    # a resident-only graph launched ahead of the fill does not wait for it
    g = {"graph_block_s": 40 * US, "graph_step_s": 3 * US, "graph_token_s": 20 * US}
    ahead = [it for it in graph_tokens(iter(with_fill(token_items(0), fill) + token_items(1)), L)
             if type(it) is _GraphToken]
    assert [m.ahead for m in ahead] == [False, True]
    assert times(costs(g), with_fill(token_items(0), fill) + token_items(1)) == pytest.approx(
        times(costs(g), token_items(0) + token_items(1)), rel=1e-9)


def test_a_cpu_graphs_block_grows_by_its_pair_time_for_each_cpu_pair():
    """graph_cpu_pair_s: a block with n CPU pairs takes n x that longer on the GPU (a block long
    enough that the pool's call ends inside it); a token without CPU pairs is unchanged."""
    c = costs(GCPU, "lru")
    items = cpu_items(0) + cpu_items(1, {1: 1, 2: 0}) + cpu_items(2)
    run = lambda pair: list(Simulator(c, token_graph=True, graph_cpu=True, graph_cpu_block_s=2000 * US,
                                      graph_cpu_pair_s=pair).run(iter(items)).token_s)
    base, paired = run(0.0), run(30 * US)
    assert c.cpu_call_s(1, 1) + 7 * US < 2000 * US - c.dense_s[1]
    assert paired[0] == pytest.approx(base[0], rel=1e-9) and paired[2] == pytest.approx(base[2], rel=1e-9)
    assert paired[1] - base[1] == pytest.approx(2 * 30 * US, rel=1e-6)
    with pytest.raises(ValueError, match="graph_cpu_pair_s"):
        Simulator(c, graph_cpu=True, graph_cpu_pair_s=-1e-6)
