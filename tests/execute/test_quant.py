"""Block layouts, the numpy dequantizer and the reference quantizer against gguf-py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from execute import quant as Q

ALL = sorted(Q.QTYPES)


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_layout_matches_gguf(qtype):
    import gguf

    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)] == (
        Q.QTYPES[qtype].block_weights, Q.QTYPES[qtype].block_bytes)
    assert gguf.GGMLQuantizationType(qtype).name == Q.QTYPES[qtype].name


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_dequantize_matches_gguf(qtype, rng, gguf_dequant):
    x = rng.standard_normal((5, 512)).astype(np.float32) * rng.uniform(0.01, 3, (5, 1)).astype(np.float32)
    blocks = Q.quantize(x, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, Q.row_bytes(qtype, 512))
    mine = Q.dequantize(blocks, qtype, 512)
    np.testing.assert_array_equal(mine, gguf_dequant(blocks, qtype, 512).astype(np.float32))


# round-to-nearest error of the reference quantizer on normal data (bounded, not optimal)
QUANT_ERR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q6_K: 4e-2, Q.Q4_0: 0.12, Q.Q4_K: 0.12}


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(ALL), rows=st.integers(1, 4), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_quantize_roundtrip(qtype, rows, blocks, seed):
    cols = blocks * 256
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    y = Q.dequantize(Q.quantize(x, qtype), qtype, cols)
    assert np.linalg.norm(y - x) <= QUANT_ERR[qtype] * np.linalg.norm(x)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantize_close_to_gguf(qtype, rng):
    import gguf
    from gguf import quants

    x = rng.standard_normal((4, 256)).astype(np.float32)
    theirs = quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    mine = Q.quantize(x, qtype)
    assert (theirs == mine).mean() > 0.95  # same scheme; ties and f16 rounding may differ


def test_row_bytes_and_errors():
    assert Q.row_bytes(Q.Q8_0, 2048) == 64 * 34
    assert Q.row_bytes(Q.Q6_K, 768) == 3 * 210
    with pytest.raises(ValueError, match="blk.0.ffn_down_exps: 100 columns"):
        Q.row_bytes(Q.Q4_K, 100, "blk.0.ffn_down_exps")
    with pytest.raises(ValueError, match=r"t\.weight: quant type 3 is not supported.*Q8_0"):
        Q.quant_type(3, "t.weight")
    with pytest.raises(ValueError, match="rows, cols"):
        Q.quantize(np.zeros(32, np.float32), Q.Q8_0)
