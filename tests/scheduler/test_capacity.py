"""Geometry and capacity: slots from MiB budgets, pools, and who may use a small cache."""
import pytest

from scheduler import Capacity, CapacityError, Geometry, make_policy, pad_slot_bytes


def test_slot_padding():
    assert pad_slot_bytes(1) == 256
    assert pad_slot_bytes(256) == 256
    assert pad_slot_bytes(257) == 512


def test_mib_budget_is_largest_n_that_fits():
    g = Geometry((8, 0, 8), 2, (1000, 0, 3000))  # padded: 1024 + 3072 = 4096 bytes per slot row
    cap = Capacity.from_mib(g, 4096 * 5 / 2**20)
    assert cap.pools == (((0,), 5), ((2,), 5))
    assert Capacity.from_mib(g, (4096 * 5 - 1) / 2**20).pools[0][1] == 4
    assert Capacity.from_mib(g, 1e6).pools[0][1] == 8  # never more slots than experts


def test_shared_pool_needs_equal_sizes():
    g = Geometry((8, 8), 2, (1000, 2000))
    with pytest.raises(ValueError, match="different expert sizes"):
        Capacity.shared(g, [[0, 1]], [4])


def test_upload_every_miss_policies_refuse_fewer_slots_than_top_k():
    g = Geometry.uniform(2, 8, 4)
    for name in ("lru", "freq-lru"):
        with pytest.raises(CapacityError, match="top_k=4"):
            make_policy(name, g, Capacity.per_layer(g, 3))
        make_policy(name, g, Capacity.per_layer(g, 4))
    for name in ("cpu", "hybrid"):
        make_policy(name, g, Capacity.per_layer(g, 0))


def test_geometry_validation_names_the_field():
    with pytest.raises(ValueError, match="expert_bytes"):
        Geometry((8, 8), 2, (1,))
    with pytest.raises(ValueError, match="top_k"):
        Geometry((8,), 9, (1,))
    with pytest.raises(ValueError, match="already in another pool"):
        Capacity((((0,), 2), ((0,), 2)))
