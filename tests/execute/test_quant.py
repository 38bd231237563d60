"""Block layouts, the numpy dequantizer and the reference quantizer against gguf-py."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from execute import quant as Q

ALL = sorted(Q.QTYPES)
LAYOUTS = sorted(Q.LAYOUTS)


@pytest.mark.parametrize("qtype", LAYOUTS, ids=[Q.LAYOUTS[t].name for t in LAYOUTS])
def test_layout_matches_gguf(qtype):
    import gguf

    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)] == (
        Q.LAYOUTS[qtype].block_weights, Q.LAYOUTS[qtype].block_bytes)
    assert gguf.GGMLQuantizationType(qtype).name == Q.LAYOUTS[qtype].name


@pytest.mark.parametrize("qtype", LAYOUTS, ids=[Q.LAYOUTS[t].name for t in LAYOUTS])
def test_dequantize_random_blocks_matches_gguf(qtype, rng, gguf_dequant):
    """Random bytes (every bit pattern of indices, signs and sub-scales) with valid f16 scales:
    the reference dequantizer agrees with gguf-py's to 1e-5 relative (in practice bit for bit)."""
    cols = 512
    raw = Q.random_blocks(rng, qtype, 7, cols, scale=0.05)
    assert raw.shape == (7, Q.row_bytes(qtype, cols, types=Q.LAYOUTS))
    mine = Q.dequantize(raw, qtype, cols)
    theirs = gguf_dequant(raw, qtype, cols)
    assert mine.dtype == np.float32 and np.isfinite(mine).all() and np.abs(theirs).max() > 0
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=0)


def test_iq_tables_match_gguf():
    """The project's own copy of the i-quant tables decodes to gguf-py's, and is what
    gguf_io.iq_grid_bitmaps() derives from them."""
    from gguf import quants

    from execute import iq_grids as G
    from execute.gguf_io import iq_grid_bitmaps

    assert iq_grid_bitmaps() == G.BITMAPS
    for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"):
        cls = getattr(quants, name)
        cls.init_grid()
        np.testing.assert_array_equal(G.grid(name), np.asarray(cls.grid).reshape(cls.grid_shape))
    assert bytes(G.KSIGNS) == quants.IQ2_XXS.ksigns
    assert tuple(G.IQ4_NL_VALUES.tolist()) == tuple(quants.IQ4_NL.kvalues)
    assert G.grid("IQ1_M") is G.grid("IQ1_M") and not G.grid("IQ2_S").flags.writeable


@pytest.mark.parametrize("qtype", ALL, ids=[Q.QTYPES[t].name for t in ALL])
def test_dequantize_matches_gguf(qtype, rng, gguf_dequant):
    x = rng.standard_normal((5, 512)).astype(np.float32) * rng.uniform(0.01, 3, (5, 1)).astype(np.float32)
    blocks = Q.quantize(x, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (5, Q.row_bytes(qtype, 512))
    mine = Q.dequantize(blocks, qtype, 512)
    np.testing.assert_array_equal(mine, gguf_dequant(blocks, qtype, 512).astype(np.float32))


# round-to-nearest error of the reference quantizer on normal data (bounded, not optimal)
QUANT_ERR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 1e-2, Q.Q6_K: 4e-2, Q.Q4_0: 0.12, Q.Q4_K: 0.12,
             Q.MXFP4: 0.15}


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


def test_mxfp4_quantize_is_gguf_bit_for_bit(rng):
    """Same exponent and nearest code as gguf-py's quantizer, zero blocks and wide scales included."""
    import gguf
    from gguf import quants

    x = rng.standard_normal((6, 512)).astype(np.float32) * np.logspace(-30, 30, 6, dtype=np.float32)[:, None]
    x[0, :32] = 0.0
    x[1, 32:64] = np.float32(3.0)  # exactly between codes 2 and 4 after scaling: ties
    theirs = quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(Q.quantize(x, Q.MXFP4), theirs)


def test_mxfp4_dequantize_every_exponent_and_code(gguf_dequant):
    """All 256 exponents (denormal scales for e < 2, 2^127 for e = 254) and all 16 codes in both
    nibbles, at odd block offsets, bit for bit with gguf-py."""
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = (np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4))[None, :]
    with np.errstate(over="ignore"):
        mine = Q.dequantize(blocks.reshape(8, 32 * 17), Q.MXFP4, 1024).reshape(256, 32)
        theirs = gguf_dequant(blocks, Q.MXFP4, 32).astype(np.float32)
    np.testing.assert_array_equal(mine.view(np.uint32), theirs.view(np.uint32))
    assert mine[128, :16].tolist() == Q.MXFP4_VALUES.tolist()  # e = 128: scale 1
    assert mine[0, 1] == np.float32(2.0**-128) and mine[1, 1] == np.float32(2.0**-127)


def test_row_bytes_and_errors():
    assert Q.row_bytes(Q.Q8_0, 2048) == 64 * 34
    assert Q.row_bytes(Q.Q6_K, 768) == 3 * 210
    with pytest.raises(ValueError, match="blk.0.ffn_down_exps: 100 columns"):
        Q.row_bytes(Q.Q4_K, 100, "blk.0.ffn_down_exps")
    with pytest.raises(ValueError, match=r"t\.weight: quant type 3 \(Q4_1\) is not supported.*Q8_0"):
        Q.quant_type(3, "t.weight")
    assert Q.row_bytes(Q.Q4_1, 64, types=Q.LAYOUTS) == 40
    with pytest.raises(ValueError, match="quant type 99 \\(type 99\\)"):
        Q.dequantize(np.zeros(4, np.uint8), 99, 1)
    with pytest.raises(ValueError, match="rows, cols"):
        Q.quantize(np.zeros(32, np.float32), Q.Q8_0)
