"""Prefill chunks with the experts started on the device (``execute.prefill_device``): the grouping
kernel against its numpy reference (``batch_route.group_pairs``), and whole runs with the path on
and off: the same bits, decisions and route log; chunks whose experts are not all resident, and a
chunk with a non-finite router logit, run block by block."""
from __future__ import annotations

import numpy as np
import pytest

from execute.batch_route import group_pairs, max_tiles, stable_order
from scheduler import Capacity, make_policy

from .conftest import cupy_or_skip


def _skewed_ids(rng, t: int, k: int, experts: int) -> np.ndarray:
    """``(t, k)`` distinct ids per row, a few experts taking more than a tile of rows."""
    p = 1.0 / np.arange(1, experts + 1) ** 1.2
    p /= p.sum()
    return np.stack([rng.choice(experts, k, replace=False, p=p) for _ in range(t)])


# the reference (no GPU) ------------------------------------------------------------------------------
@pytest.mark.parametrize("t,k,experts", ((1, 1, 1), (37, 4, 16), (300, 8, 128)))
def test_group_pairs_rows_tiles_and_pairs(t, k, experts):
    ids = _skewed_ids(np.random.default_rng(t), t, k, experts)
    tok, pair_of, tiles = group_pairs(ids, experts)
    flat = ids.reshape(-1)
    rows = np.empty(t * k, np.int64)
    rows[pair_of] = np.arange(t * k)  # the pair at each row
    assert np.array_equal(rows, stable_order(flat)) and np.array_equal(tok, rows // k)
    used = tiles[:, tiles[1] > 0]
    assert tiles.shape[1] == max_tiles(t * k, experts) >= used.shape[1]
    assert (tiles[:, used.shape[1]:] == 0).all() and (used[1] <= 32).all()
    assert np.array_equal(np.concatenate([np.arange(r, r + n) for r, n, _ in used.T]), np.arange(t * k))
    assert all((flat[rows[r:r + n]] == g).all() for r, n, g in used.T) and (np.diff(used[2]) >= 0).all()


# the protocol on the host (no GPU) --------------------------------------------------------------------
class _HostChunk:
    """DeviceChunk's protocol carried out on the host (a test double): every block first (the model's
    dense path and routing, the numpy experts), then the head, then the MoE blocks' steps yielded
    settled; ``fail``: report a non-finite logit (nothing yielded)."""

    def __init__(self, model, experts, fail: bool):
        self.model, self.experts, self.fail, self.chunks = model, experts, fail, 0

    def takes(self, t: int, routes) -> bool:
        return routes is None

    def steps(self, x, all_logits: bool, rows):
        from execute.batch_route import merge_rows, settle

        m = self.model
        if self.fail:
            return False
        rs, kept = np.float32(m.info.residual_scale), []
        for l, w in enumerate(m.layers):
            x = x + m._attention(l, m._rms(x, w["attn_norm"])) * rs
            hn = m._rms(x, w["ffn_norm"])
            ids, wts = m._route(l, hn, None)
            x = x + self.experts.compute(merge_rows(l, ids, wts), hn, ids, wts.astype(np.float32)) * rs
            kept.append((l, ids, wts))
        m._head(x, all_logits)
        self.chunks += 1
        yield from settle(m, kept, rows)
        return True


@pytest.mark.parametrize("fail", (False, True))
def test_chunks_settled_after_the_blocks_give_the_block_by_block_run(tiny_weights, fail):
    """The model's hook and the run loop (no GPU): a chunk whose blocks all ran before its steps are
    planned gives the block-by-block run's logits, decisions and route log; its steps are settled,
    not run; a chunk the double declines after the fact runs block by block."""
    from execute import model as M
    from scheduler.audit import Audit

    w = tiny_weights("Q8_0")
    g = w.info.geometry()
    toks = np.random.default_rng(4).integers(w.info.vocab, size=40).tolist()
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(toks[:20]), all_logits=True),
              M.ChunkInput(1, 0, 20, "prefill", tuple(toks[20:37]), all_logits=True)]
    inputs += [M.TokenInput(2 + i, 0, 37 + i, "decode", t) for i, t in enumerate(toks[37:])]
    settled, made = [], []

    class Settling(M.NumpyExperts):
        def settle_layer(self, item):
            settled.append(item.step.layer)

        def device_chunk(self, model):
            made.append(_HostChunk(model, self, fail))
            return made[-1]

    out = []
    for backend in (Settling(w), M.NumpyExperts(w)):
        model = M.MoeModel(w, use_gpu=False, max_tokens=8)
        model.route_log = []
        audit = Audit(g, keep_log=True, record_routes=True)
        res = M.run(model, backend, make_policy("cpu", g, Capacity.per_layer(g, 0)), inputs, audit=audit,
                    keep_logits=True)
        out.append((np.stack(res.logits), audit.digest(), model.route_log, model.pos))
    (a, da, la, pa), (b, db, lb, pb) = out
    assert np.array_equal(a, b) and da == db and la == lb and pa == pb == 40
    assert made[0].chunks == (0 if fail else 2) and settled == ([] if fail else [0, 1, 0, 1])


# the kernel ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t,k,experts", ((16, 1, 1), (37, 4, 16), (300, 8, 128), (700, 6, 2048)))
def test_pf_group_is_group_pairs(t, k, experts):
    cp = cupy_or_skip()
    from execute.gpu_host import Launch
    from execute.prefill import _kernel

    rng = np.random.default_rng(experts)
    ids = _skewed_ids(rng, t, k, experts).astype(np.int32)
    w = rng.random((t, k))
    n = max_tiles(t * k, experts)
    d_ids, d_w = cp.asarray(ids), cp.asarray(w)
    tok, pair = cp.full(t * k, -1, cp.int32), cp.full(t * k, -1, cp.int32)
    w32, tiles = cp.zeros(t * k, cp.float32), cp.full((3, n), 7, cp.int32)
    ptr = [int(a.data.ptr) for a in (d_ids, d_w, tok, pair, w32, tiles[0], tiles[1], tiles[2])]
    Launch(_kernel("pf_group"), 12)((1, 1), 1024, cp.cuda.get_current_stream().ptr, ptr[0], ptr[1], t * k, k,
                                    experts, n, *ptr[2:])
    r_tok, r_pair, r_tiles = group_pairs(ids, experts)
    assert np.array_equal(tok.get(), r_tok) and np.array_equal(pair.get(), r_pair)
    assert np.array_equal(tiles.get(), r_tiles)
    assert np.array_equal(w32.get(), w.reshape(-1).astype(np.float32))


# whole runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch, quant)`` -> ModelWeights of a tiny model (made once per module)."""
    from execute.gguf_model import load_model
    from execute.synth import config_from_preset, synth_model

    root, made = tmp_path_factory.mktemp("prefill_device"), {}

    def get(arch: str, quant: str):
        if (arch, quant) not in made:
            made[(arch, quant)] = load_model(synth_model(root / f"{arch}_{quant}.gguf",
                                                         config_from_preset("tiny", arch=arch, quant=quant, seed=7)))
        return made[(arch, quant)]

    return get


def _run(w, policy: str, slots: int, device: str, monkeypatch, poison: bool = False):
    """Two chunks (20 and 17 tokens; the KV cache grows inside them) and 6 decode tokens through
    ``execute.driver.run`` with ``MOELAB_PREFILL_DEVICE`` = ``device``: (logits of every row, audit,
    route log, the DeviceChunk or False). ``poison``: every chunk's first block reports a
    non-finite router logit."""
    from execute import model as M
    from scheduler.audit import Audit

    monkeypatch.setenv("MOELAB_PREFILL_DEVICE", device)
    g = w.info.geometry()
    cap = Capacity.per_layer(g, slots)
    toks = np.random.default_rng(3).integers(w.info.vocab, size=43).tolist()
    inputs = [M.ChunkInput(0, 0, 0, "prefill", tuple(toks[:20]), all_logits=True),
              M.ChunkInput(1, 0, 20, "prefill", tuple(toks[20:37]), all_logits=True)]
    inputs += [M.TokenInput(2 + i, 0, 37 + i, "decode", t) for i, t in enumerate(toks[37:])]
    backend = M.EngineExperts(w, cap, threads=2, use_gpu=True, timeout_s=120)
    model = M.MoeModel(w, use_gpu=True, max_tokens=8)
    model.route_log = []
    if poison:
        import cupy as cp

        route_to = model.pd.route_to

        def bad_first(logits, bias, info, ids, wts, bad):
            ok = route_to(logits, bias, info, ids, wts, bad)
            if model.device_chunk and bad == model.device_chunk._bufs["back"].data.ptr + 12 * logits.shape[0] * info.top_k * len(model.device_chunk.moe):
                cp.cuda.runtime.memsetAsync(bad, 1, 1, cp.cuda.get_current_stream().ptr)
            return ok

        model.pd.route_to = bad_first
    audit = Audit(g, keep_log=True, record_routes=True)
    try:
        res = M.run(model, backend, make_policy(policy, g, cap), inputs, audit=audit, keep_logits=True)
    finally:
        backend.close()
    return np.stack(res.logits), audit, model.route_log, model.device_chunk


@pytest.mark.gpu
@pytest.mark.parametrize("arch,quant", (("qwen3moe", "Q8_0"), ("qwen2moe", "Q4_0"), ("granitemoe", "F16")))
def test_chunks_on_the_device_give_the_block_by_block_bits(tiny, arch, quant, monkeypatch):
    """Every expert resident (``gpu``): both chunks run on the device, with the same logits bit for
    bit, the same decisions and the same route log as block by block."""
    cupy_or_skip()
    w = tiny(arch, quant)
    slots = max(w.info.num_experts)
    on, a_on, log_on, dev = _run(w, "gpu", slots, "1", monkeypatch)
    off, a_off, log_off, dev_off = _run(w, "gpu", slots, "0", monkeypatch)
    assert dev and dev.chunks == 2 and dev.reruns == 0 and dev_off is False
    assert np.isfinite(on).all() and np.array_equal(on, off)
    assert a_on.digest() == a_off.digest() and log_on == log_off


@pytest.mark.gpu
def test_chunks_with_experts_off_the_gpu_stay_block_by_block(tiny, monkeypatch):
    cupy_or_skip()
    w = tiny("qwen3moe", "Q8_0")
    on, a_on, _, dev = _run(w, "lru", 2, "1", monkeypatch)
    off, a_off, _, _ = _run(w, "lru", 2, "0", monkeypatch)
    assert dev and dev.chunks == 0 and np.array_equal(on, off) and a_on.digest() == a_off.digest()


@pytest.mark.gpu
def test_a_non_finite_router_logit_runs_the_chunk_again_block_by_block(tiny, monkeypatch):
    cupy_or_skip()
    w = tiny("qwen3moe", "Q8_0")
    slots = max(w.info.num_experts)
    on, a_on, log_on, dev = _run(w, "gpu", slots, "1", monkeypatch, poison=True)
    off, a_off, log_off, _ = _run(w, "gpu", slots, "0", monkeypatch)
    assert dev.reruns == 2 and dev.chunks == 0
    assert np.array_equal(on, off) and a_on.digest() == a_off.digest() and log_on == log_off
