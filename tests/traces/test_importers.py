"""Importers: each on a real file, malformed files, and a hypothesis fuzz per format."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import traces
from scheduler import Audit, Capacity, make_policy, replay
from moelab.trace_cli import main
from traces.format import TraceError
from traces.importers import import_trace, write_strata

from .conftest import small_trace, strata_records, write_vllm

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _same_routing(a, b):
    np.testing.assert_array_equal(a.expert_ids, b.expert_ids)
    np.testing.assert_array_equal(a.seq, b.seq)
    np.testing.assert_array_equal(a.pos, b.pos)
    np.testing.assert_array_equal(a.phase, b.phase)


def _expect_error(fmt, src, match, tmp_path, **opts):
    """The importer names the file and the problem; the CLI exits non-zero and writes nothing."""
    with pytest.raises(TraceError, match=match) as e:
        import_trace(fmt, src, **opts)
    assert str(src) in str(e.value)
    flags = {"num_layers": "--layers", "num_experts": "--experts", "metadata": "--metadata"}
    extra = [x for key, v in opts.items() for x in (flags[key], str(v))]
    assert main(["import", fmt, str(src), str(tmp_path / "out"), *extra]) != 0
    assert not (tmp_path / "out").exists()


# real files -----------------------------------------------------------------------------------------
def test_granite_json_is_the_bundled_trace(granite, tmp_path):
    src = traces.default_trace_path() / "moe_expert_trace.json"
    assert main(["import", "granite", str(src), str(tmp_path / "g")]) == 0
    _same_routing(traces.load(tmp_path / "g"), granite)
    assert granite.pos[:3].tolist() == [0, 1, 2] and granite.pos[39] == 39 and granite.phase[39] == 1


def test_switch_base_8(switch_dir):
    t = import_trace("switch", switch_dir / "router-trace.v2.json")
    assert (len(t), t.num_layers, t.num_experts[0], t.top_k) == (215, 6, 8, 1)
    assert t.sequences() == list(range(10)) and (t.phase == 0).all()
    assert t.pos[21] == 0 and t.seq[21] == 1 and t.model == "google/switch-base-8"
    raw = json.loads((switch_dir / "router-trace.v2.json").read_text())["selections"]
    assert t.expert_ids[:, :, 0].tolist() == [[row[0] for row in tok] for tok in raw]


def test_vllm_out_of_order_and_missing(tmp_path):
    rng = np.random.default_rng(3)
    t = small_trace(rng, T=30, seqs=3)
    path = tmp_path / "p.jsonl"
    n = write_vllm(path, t, order=rng, drop=0.1, rng=rng)
    got = import_trace("vllm", path, num_layers=t.num_layers, num_experts=16)
    assert got.meta["masked_entries"] == len(t) * t.num_layers - n
    routed = got.expert_ids[:, :, 0] >= 0
    np.testing.assert_array_equal(got.expert_ids[routed], t.expert_ids[routed])
    np.testing.assert_allclose(got.weights[routed], t.weights[routed])
    assert np.isnan(got.weights[~routed]).all() and (got.expert_ids[~routed] == -1).all()
    np.testing.assert_array_equal(got.seq, t.seq)


def test_strata_binary(tmp_path):
    t = small_trace(np.random.default_rng(4), T=25, seqs=1)
    path = tmp_path / "routing.bin"
    write_strata(path, strata_records(t))
    assert main(["import", "strata", str(path), str(tmp_path / "s"), "--layers", "4", "--experts", "16"]) == 0
    got = traces.load(tmp_path / "s", check=True)
    np.testing.assert_array_equal(got.expert_ids, t.expert_ids)
    np.testing.assert_array_equal(got.weights, t.weights)
    assert (got.phase == 1).all() and got.pos.tolist() == list(range(25))


def test_strata_token_rule_with_missing_layers(tmp_path):
    path = tmp_path / "r.bin"
    recs = [(0, [1, 2], [0.6, 0.4]), (2, [3, 0], [0.5, 0.5]), (1, [2, 3], [0.7, 0.3]), (0, [0, 1], [0.9, 0.1])]
    write_strata(path, recs)
    got = import_trace("strata", path, num_layers=3, num_experts=4)
    assert len(got) == 3  # 0,2 | 1 | 0
    assert got.expert_ids[0, 1].tolist() == [-1, -1] and got.expert_ids[1, 1].tolist() == [2, 3]
    assert [len(list(tok.steps)) for tok in got.tokens()] == [2, 1, 1]


def test_audit_jsonl_from_the_scheduler(granite, tmp_path):
    g = granite.geometry(4096)
    audit = Audit(g, record_routes=True)
    replay(make_policy("lru", g, Capacity.per_layer(g, 8)), granite.tokens("decode"), audit=audit)
    audit.write_jsonl(tmp_path / "a.jsonl", run={"model": "granite"})
    got = import_trace("audit", tmp_path / "a.jsonl")
    _same_routing(got, granite.select("decode"))
    assert got.model == "granite" and got.weights is None


# malformed files -------------------------------------------------------------------------------------
def test_granite_malformed(tmp_path):
    d = json.loads((traces.default_trace_path() / "moe_expert_trace.json").read_text())
    src = tmp_path / "g.json"
    d["prompts"]["code"]["decode"][5][3][2] = 32
    src.write_text(json.dumps(d))
    _expect_error("granite", src, "prompt 'code' decode row 5 layer 3: expert id 32 out of range", tmp_path)
    d["prompts"]["code"]["decode"][5][3] = [1, 2, 3]
    src.write_text(json.dumps(d))
    _expect_error("granite", src, "3 experts, expected top_k=8", tmp_path)
    src.write_text(json.dumps(d)[:5000])
    _expect_error("granite", src, "not valid JSON", tmp_path)


def test_switch_malformed(tmp_path, switch_dir):
    d = json.loads((switch_dir / "router-trace.v2.json").read_text())
    d["selections"] = d["selections"][:100]
    (tmp_path / "r.json").write_text(json.dumps(d))
    _expect_error("switch", tmp_path / "r.json", "100 tokens, header says tokens=215", tmp_path)
    d["tokens"] = 100
    d["selections"][7][2] = ["3"]
    (tmp_path / "r.json").write_text(json.dumps(d))
    _expect_error("switch", tmp_path / "r.json", "token 7 layer 2: expert id '3' is str", tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(experts=r["experts"][:3], gating_probs=r["gating_probs"][:3]), "k may not change"),
    (lambda r: r.update(layer="2"), "field 'layer' is str"),
    (lambda r: r["experts"].__setitem__(0, 99), "expert id 99 out of range"),
    (lambda r: r["gating_probs"].__setitem__(1, float("nan")), "not finite"),
    (lambda r: r.pop("token_idx"), "field 'token_idx' missing"),
])
def test_vllm_malformed(tmp_path, edit, match):
    t = small_trace(np.random.default_rng(5), T=10)
    path = tmp_path / "p.jsonl"
    write_vllm(path, t)
    lines = path.read_text().splitlines()
    r = json.loads(lines[6])
    edit(r)
    lines[6] = json.dumps(r)
    path.write_text("\n".join(lines) + "\n")
    _expect_error("vllm", path, "line 7: .*" + match, tmp_path, num_experts=16)


def test_vllm_truncated(tmp_path):
    t = small_trace(np.random.default_rng(5), T=10)
    path = tmp_path / "p.jsonl"
    write_vllm(path, t)
    path.write_bytes(path.read_bytes()[:-40])
    _expect_error("vllm", path, r"line \d+: not valid JSON", tmp_path)


def test_strata_malformed(tmp_path):
    path = tmp_path / "r.bin"
    write_strata(path, [(0, [1, 2], [0.5, 0.5]), (1, [3, 0], [0.5, 0.5])])
    raw = path.read_bytes()
    path.write_bytes(raw[:-3])
    _expect_error("strata", path, r"record 1 \(byte 24\): truncated", tmp_path)
    write_strata(path, [(0, [1, 2], [0.5, 0.5]), (1, [3, 0, 1], [0.5, 0.4, 0.1])])
    _expect_error("strata", path, "record 1 .*k=3, expected 2", tmp_path)
    write_strata(path, [(0, [1, 2], [0.5, float("nan")])])
    _expect_error("strata", path, "record 0 .*non-finite weight", tmp_path)
    write_strata(path, [(0, [1, 9], [0.5, 0.5])])
    _expect_error("strata", path, "record 0 .*out of range", tmp_path, num_experts=4)


def test_audit_malformed(granite, tmp_path):
    g = granite.geometry(1)
    audit = Audit(g, record_routes=True)
    replay(make_policy("lru", g, Capacity.per_layer(g, 8)), granite.tokens("decode", limit=5), audit=audit)
    audit.write_jsonl(tmp_path / "a.jsonl")
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    _expect_error("audit", tmp_path / "b.jsonl", "no summary line", tmp_path)
    r = json.loads(lines[2])
    r["routes"][4][1][0] = 40
    (tmp_path / "b.jsonl").write_text("\n".join(lines[:2] + [json.dumps(r)] + lines[3:]) + "\n")
    _expect_error("audit", tmp_path / "b.jsonl", "line 3 layer 4: expert id 40 out of range", tmp_path)


# fuzz --------------------------------------------------------------------------------------------------
def _fuzz(fmt, raw: bytes, data, tmp_path, **opts):
    """Truncate or overwrite bytes; the importer must either succeed with a valid trace or raise TraceError."""
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        raw = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(raw)
    src = tmp_path / f"fuzz.{fmt}"
    src.write_bytes(raw)
    try:
        t = import_trace(fmt, src, **opts)
    except TraceError as e:
        assert str(src) in str(e)
        return
    t.validate()
    assert len(t) > 0


@FUZZ
@given(data=st.data())
def test_fuzz_granite(data, tmp_path):
    raw = (traces.default_trace_path() / "moe_expert_trace.json").read_bytes()
    _fuzz("granite", raw, data, tmp_path)


@FUZZ
@given(data=st.data())
def test_fuzz_switch(data, tmp_path, switch_dir):
    raw = (switch_dir / "router-trace.v2.json").read_bytes()
    _fuzz("switch", raw, data, tmp_path, metadata=switch_dir / "capture-metadata.json")


@FUZZ
@given(data=st.data())
def test_fuzz_vllm(data, tmp_path):
    path = tmp_path / "v.jsonl"
    write_vllm(path, small_trace(np.random.default_rng(1), T=6))
    _fuzz("vllm", path.read_bytes(), data, tmp_path, num_experts=16)


@FUZZ
@given(data=st.data())
def test_fuzz_strata(data, tmp_path):
    path = tmp_path / "s.bin"
    write_strata(path, strata_records(small_trace(np.random.default_rng(1), T=6, seqs=1)))
    _fuzz("strata", path.read_bytes(), data, tmp_path, num_experts=16)


@FUZZ
@given(data=st.data())
def test_fuzz_audit(data, tmp_path, granite):
    g = granite.geometry(1)
    audit = Audit(g, record_routes=True)
    replay(make_policy("lru", g, Capacity.per_layer(g, 8)), granite.tokens("decode", limit=3), audit=audit)
    audit.write_jsonl(tmp_path / "a.jsonl")
    _fuzz("audit", (tmp_path / "a.jsonl").read_bytes(), data, tmp_path)
