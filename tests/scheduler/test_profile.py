"""STRP v1 profiles: both trailer kinds, every malformed file refused, profile hits counted right."""
import struct

import numpy as np
import pytest

from scheduler import (Audit, Capacity, Geometry, Profile, ProfileError, Step, Token, make_policy, read_strp,
                       replay, write_strp)
from moelab.cli import main


def sample_profile():
    counts = np.array([[5, 0, 2, 1], [0, 7, 3, 0]], dtype=float)
    return Profile.from_counts(counts)


def test_from_counts_ranks_hottest_first_ties_by_id():
    p = Profile.from_counts(np.array([[1, 3], [3, 0]], dtype=float))
    assert p.ranked == ((0, 1), (1, 0), (0, 0))
    assert p.slots == 3


@pytest.mark.parametrize("trailer", ["freq", "rank", None])
def test_round_trip(tmp_path, trailer):
    p = sample_profile()
    write_strp(p, tmp_path / "p.strp", trailer)
    q = read_strp(tmp_path / "p.strp")
    assert q.ranked == p.ranked and q.slots == p.slots and (q.num_layers, q.num_experts) == (2, 4)
    if trailer == "freq":
        np.testing.assert_allclose(q.frequency, p.frequency)
    else:
        assert q.frequency is None


def raw(n_l=2, n_e=4, slots=2, pairs=((0, 1), (1, 2)), magic=b"STRP", version=1, tail=b""):
    body = struct.pack("<4s5I", magic, version, n_l, n_e, slots, len(pairs))
    return body + b"".join(struct.pack("<HH", l, e) for l, e in pairs) + tail


@pytest.mark.parametrize("data, message", [
    (raw(magic=b"STRQ"), "magic"),
    (raw(version=2), "version"),
    (raw()[:-2], "truncated or oversized"),
    (raw() + b"\0" * 5, "truncated or oversized"),
    (raw(pairs=((0, 1), (0, 1))), "listed twice"),
    (raw(slots=3), "slots 3 > ranked pairs 2"),
    (raw(pairs=((2, 0), (0, 0))), "out of range"),
    (b"STRP", "size"),
    (raw(tail=struct.pack("<8f", *([2.0] * 8))), "neither a rank table"),
    (raw(tail=struct.pack("<8i", 1, 0, 0, 0, 0, 0, 0, -1)), "rank trailer"),
])
def test_malformed_files_are_refused(tmp_path, data, message):
    path = tmp_path / "bad.strp"
    path.write_bytes(data)
    with pytest.raises(ProfileError, match=message) as info:
        read_strp(path)
    assert str(path) in str(info.value)


def test_geometry_mismatch_loads_nothing():
    g = Geometry.uniform(3, 4, 1, 10)
    with pytest.raises(ProfileError, match="2 layers x 4 experts"):
        make_policy("static", g, Capacity.per_layer(g, 2), profile=sample_profile())


def test_prepopulate_fills_each_pool_in_rank_order():
    g = Geometry.uniform(2, 4, 1, 10)
    policy = make_policy("lru", g, Capacity.per_layer(g, 2), profile=sample_profile())
    assert policy.residents() == [(0, 0), (0, 2), (1, 1), (1, 2)]


def test_swapped_in_expert_is_not_a_profile_hit():
    # layer 0 has 1 slot, pre-populated with expert 0; expert 1 then replaces it via lru;
    # later hits on expert 1 are hits, not profile hits, and expert 0 never counts again.
    g = Geometry.uniform(1, 2, 1, 10)
    profile = Profile.from_counts(np.array([[2.0, 1.0]]))
    policy = make_policy("lru", g, Capacity.per_layer(g, 1), profile=profile)
    seq = [0, 1, 1, 0, 0]
    tokens = [Token(i, 0, i, "decode", (Step(0, (e,)),)) for i, e in enumerate(seq)]
    audit = Audit(g, profile_residents=policy.residents())
    s = replay(policy, tokens, audit=audit).summary()
    assert (s["hits"], s["profile_hits"]) == (3, 1)


def test_cli_build_and_show(tmp_path, capsys):
    out = tmp_path / "g.strp"
    assert main(["profile", "build", str(out), "--phase", "decode", "--trailer", "rank"]) == 0
    p = read_strp(out)
    assert (p.num_layers, p.num_experts) == (24, 32)
    assert main(["profile", "show", str(out), "--json"]) == 0
    assert '"num_layers": 24' in capsys.readouterr().out
    bad = tmp_path / "bad.strp"
    bad.write_bytes(b"nope")
    assert main(["profile", "show", str(bad)]) == 2
    assert "bad.strp" in capsys.readouterr().err
