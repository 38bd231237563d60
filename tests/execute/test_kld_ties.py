"""Near ties of ``moelab kld`` (``execute.kld_ties``): a flip at a margin inside the rounding twin's
spread is a near tie, one outside it counts against agreement; routing differences are found block
by block with their margins."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from execute import kld_ties as K


def _runs(rng):
    ref = rng.standard_normal((6, 200))
    top = np.argsort(-ref, axis=1)
    ref[np.arange(6), top[:, 0]] = ref[np.arange(6), top[:, 1]] + 1.0  # margin 1 everywhere ...
    ref[1, top[1, 0]] = ref[1, top[1, 1]] + 1e-6  # ... but position 1: far below the twin's spread
    twin = ref + 1e-4 * rng.standard_normal(ref.shape)
    got = ref + 1e-4 * rng.standard_normal(ref.shape)
    for i in (1, 4):  # top-1 flipped: at the near tie, and at a clear margin
        got[i, top[i, 1]] = got[i, top[i, 0]] + 0.5
    return ref, twin, got, top


def test_flips_inside_the_twins_spread_are_near_ties(rng):
    ref, twin, got, top = _runs(rng)
    t = K.ties(ref, twin, got)
    assert t["logit_ties"] == t["near_ties"] == 1 and t["route_ties"] == 0 and not t["routes_analysed"]
    assert t["positions_outside_ties"] == 5 and t["top1_same_outside_ties"] == 4
    assert t["top1_agreement_outside_ties"] == pytest.approx(0.8)
    assert [f["position"] for f in t["flips"]] == [1, 4]
    f1, f4 = t["flips"]
    assert f1["logit_tie"] and f1["margin"] == pytest.approx(1e-6, abs=1e-9) and f1["margin"] < f1["bound"]
    assert not f4["logit_tie"] and f4["margin"] == pytest.approx(1.0) and f4["ref_top2"] == [top[4, 0], top[4, 1]]
    assert f4["bound"] == pytest.approx(K.Z * np.sqrt(2) * K.spread(ref[4:5], twin[4:5])[0])
    assert t["twin_top1_agreement"] == 1.0


def test_spread_ignores_a_shift_of_every_logit(rng):
    a = rng.standard_normal((3, 50))
    d = 1e-3 * rng.standard_normal((3, 50))
    np.testing.assert_allclose(K.spread(a, a + d + 5.0), K.spread(a, a + d), rtol=1e-6)
    assert (K.spread(a, a + 7.0) < 1e-12).all()


def test_routing_differences_are_found_with_their_margins(rng):
    """Position 2 routed differently at block 0 (a near tie) and block 1; position 3 at block 1
    only, at a clear margin: a routing near tie excludes position 2 alone."""
    n, e = 5, 6
    sel = {l: rng.random((n, e)) for l in (0, 1)}
    ids = {l: np.argsort(-sel[l], axis=1, kind="stable")[:, :2] for l in (0, 1)}
    third = {l: np.argsort(-sel[l], axis=1, kind="stable")[:, 2] for l in (0, 1)}
    sel[0][2, ids[0][2, 1]] = sel[0][2, third[0][2]] + 1e-9
    ref_probe = SimpleNamespace(sel=sel, ids=ids)
    twin_probe = SimpleNamespace(sel={l: sel[l] + 1e-5 * rng.standard_normal((n, e)) for l in sel}, ids=ids)
    log = []
    for i in range(n):
        rows = []
        for l in (0, 1):
            got = ids[l][i].tolist()
            if (i, l) in ((2, 0), (2, 1), (3, 1)):
                got[1] = int(third[l][i])
            rows.append((l, got, [0.5, 0.5]))
        log.append((i, rows))
    ref, twin, _, _ = _runs(rng)
    ref, twin = ref[:n], twin[:n]
    t = K.ties(ref, twin, ref.copy(), ref_probe, twin_probe, log)
    assert t["routes_analysed"] and t["positions_routed_differently"] == 2 and t["blocks_routed_differently"] == 3
    # position 3's difference at block 1 is downstream of position 2's at block 0 (through the cache):
    # one root, a near tie, reaching positions 2, 3 and 4
    assert [r[:2] for r in t["route_roots"]] == [[2, 0]] and t["route_root_ties"] == 1
    assert t["route_ties"] == 3 and t["positions_route_affected"] == 3
    assert t["twin_route_flips"] == 1  # the twin's noise (1e-5) breaks the 1e-9 tie at position 2, block 0
    assert t["first_route_difference_position"] == 2
    assert t["logit_ties"] == 1 and t["near_ties"] == 4 and t["positions_outside_ties"] == 1  # 1: logits, 2-4: routing
    assert t["flips"] == []
    assert t["spread_ratio_median_unaffected"] == pytest.approx(
        np.median(K.spread(ref[:2], ref[:2].copy()) / K.spread(ref[:2], twin[:2])))


def test_roots_reach_later_positions_through_the_cache():
    """Differences as (position -> [block, margin, bound], ...): position 1 at block 2 (a tie) is a
    root; position 2 at block 3 is downstream of it; position 4 at block 0 is a root beyond its
    bound, which spoils the later positions; position 5 only at the last block reaches no other."""
    routes = {1: [[2, 1e-9, 1e-6]], 2: [[3, 0.5, 1e-6]], 4: [[0, 0.5, 1e-6], [3, 0.1, 1e-6]]}
    found, affected, tie = K.roots(routes, 7, last_block=3)
    assert sorted(found) == [1, 4]
    assert affected.tolist() == [False, True, True, True, True, True, True]
    assert tie.tolist() == [False, True, True, True, False, False, False]
    found, affected, tie = K.roots({5: [[3, 1e-9, 1e-6]]}, 7, last_block=3)
    assert sorted(found) == [5] and affected.tolist() == [False] * 5 + [True, False] and tie[5] and not tie[6]


def test_numerics_of_a_forced_run(rng):
    ref, twin, got, top = _runs(rng)
    n = K.numerics(ref, twin, got)
    assert n["logit_ties"] == 1 and n["positions_outside_ties"] == 5 and n["top1_same_outside_ties"] == 4
    assert n["flips_outside_ties"] == [4] and n["top1_agreement"] == pytest.approx(4 / 6)
    assert 0.5 < n["spread_ratio_median"] < 2 and n["kl_max"] > 0


def test_selection_values_follow_the_gating():
    logits = np.array([[0.0, 1.0, 2.0]])
    soft = K.selection(SimpleNamespace(gating="softmax"), logits)
    np.testing.assert_allclose(soft, np.exp(logits) / np.exp(logits).sum())
    np.testing.assert_allclose(K.selection(SimpleNamespace(gating="sigmoid"), logits, np.array([0.0, 0.0, 1.0])),
                               1 / (1 + np.exp(-logits)) + [0, 0, 1])
    np.testing.assert_array_equal(K.selection(SimpleNamespace(gating="softmax_topk"), logits), logits)


def test_the_twin_perturbs_every_product_at_its_rounding(tiny_weights):
    from execute.model import MoeModel

    w = tiny_weights("Q8_0")
    plain, twin = MoeModel(w), K.TwinModel(w, np.random.default_rng(0))
    x = np.random.default_rng(1).uniform(1, 2, (5, w.info.hidden)).astype(np.float32)
    a = plain._proj(x, plain.layers[0]["wqkv"]).astype(np.float64)
    b = twin._proj(x, twin.layers[0]["wqkv"])
    big = np.abs(a) > 0.05 * np.abs(a).max()  # away from zero, where float32's own rounding is relative
    rel, r = np.abs(b / a - 1)[big], K.rounding(w.info.hidden)
    assert r / 2 < rel.max() <= 1.01 * r + 1e-6  # float32 rounding of the product on top
    ids, _ = twin._route(0, x, None)
    assert twin.routed_logits.shape == (5, w.info.num_experts[0]) and not twin._routing
    fixed = K.TwinModel(w, np.random.default_rng(0), size=1e-3)
    assert np.abs(fixed._proj(x, fixed.layers[0]["wqkv"]) / a - 1)[big].max() > 5e-4
