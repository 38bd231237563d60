"""execute.pdl_launch without a GPU: a stand-in for cuLaunchKernelEx reads the launch
configuration the driver would read; one configuration is built per launch shape and stream and
carries the programmatic attribute; a refused attribute is retried without it and kept off for
that launch only."""
from __future__ import annotations

import ctypes

import pytest

from execute import pdl_launch as P


class _Driver:
    """Records, per call, the configuration's fields and attribute as the driver reads them."""

    def __init__(self, errors=()):
        self.errors, self.calls = list(errors), []

    def __call__(self, cfg_ptr, func, params, extra):
        cfg = P.LaunchConfig.from_address(cfg_ptr)
        attrs = [P.LaunchAttribute.from_address(cfg.attrs + 72 * i) for i in range(cfg.num_attrs)]
        self.calls.append(dict(grid=(cfg.grid_x, cfg.grid_y, cfg.grid_z), block=(cfg.block_x, cfg.block_y, cfg.block_z),
                               shared=cfg.shared_bytes, stream=cfg.stream or 0, attrs=[(a.id, a.value) for a in attrs],
                               cfg=cfg_ptr, func=func, params=params, extra=extra))
        return self.errors.pop(0) if self.errors else 0


@pytest.fixture
def driver(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(P, "_launch", d)
    monkeypatch.setattr(P, "_CONFIGS", {})
    monkeypatch.setattr(P, "refused", None)
    return d


def test_a_launch_carries_its_shape_stream_and_the_attribute(driver):
    assert ctypes.sizeof(P.LaunchAttribute) == 72  # id, padding, a 64-byte value
    P.launch_programmatic(11, (6, 2), 128, 256, 0x7000, 0x9000)
    P.launch_programmatic(11, (6, 2), 128, 256, 0x7000, 0x9100)
    P.launch_programmatic(12, (3, 1), 64, 0, 0, 0x9200)
    a, b, c = driver.calls
    assert a["grid"] == (6, 2, 1) and a["block"] == (128, 1, 1) and a["shared"] == 256 and a["stream"] == 0x7000
    assert a["attrs"] == [(P.PROGRAMMATIC_STREAM_SERIALIZATION, 1)] == c["attrs"]
    assert (a["func"], a["params"], b["params"], a["extra"]) == (11, 0x9000, 0x9100, None)
    assert a["cfg"] == b["cfg"] != c["cfg"]  # built once per shape and stream
    assert c["grid"] == (3, 1, 1) and c["stream"] == 0 and P.refused is None


def test_a_refused_attribute_is_retried_without_it(driver):
    driver.errors = [801]
    P.launch_programmatic(11, (1, 1), 32, 0, 5, 0x9000)
    P.launch_programmatic(11, (1, 1), 32, 0, 5, 0x9000)
    assert [len(c["attrs"]) for c in driver.calls] == [1, 0, 1]  # retried plain; the next asks again
    assert P.refused == 801


def test_a_launch_that_fails_without_the_attribute_too_raises(driver):
    driver.errors = [801, 700]
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx: CUDA error 700"):
        P.launch_programmatic(11, (1, 1), 32, 0, 5, 0x9000)
    assert P.LaunchConfig.from_address(driver.calls[0]["cfg"]).num_attrs == 1
