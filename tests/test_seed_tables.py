"""experiments/reproduce_seed_tables.py and simulate.seeds: the data file holds every counted row
with what it fits; a small run has the committed report's structure and rows; fits reproduce their
rows; the committed report is what its own command writes (slow); bad data files are refused."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from scheduler.hardware import load_hardware
from simulate import seeds

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "reproduce_seed_tables.py"
DATA = ROOT / "experiments" / "seed_tables.json"
DOC = ROOT / "docs" / "SEED_TABLES.md"
LAST = re.compile(r"^predicted rows within 15%: (\d+) of (\d+); fitted: (\d+)$")


def _script():
    spec = importlib.util.spec_from_file_location("reproduce_seed_tables", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(text: str) -> list[tuple[str, str, str]]:
    """(row label, published t/s, fits) of every table row under a machine/model heading."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[1] and cells[1][0].isdigit():
            out.append((cells[0], cells[1], cells[5]))
    return out


def test_data_file_holds_the_coder_next_l4_rows_and_says_what_each_fits():
    data = seeds.load_data(DATA)
    cn = {(t["tokens"], r["row"]): r["tps"] for t in data["tables"] if t["model"] == "qwen3-coder-next"
          and t["machine"] == "l4-colab" for r in t["rows"]}
    assert cn == {(256, "lru"): 38.5, (256, "hybrid-slow-fill"): 21.1, (256, "hybrid"): 29.1,
                  (1024, "lru"): 46.6, (1024, "hybrid-slow-fill"): 32.7, (1024, "hybrid"): 42.6}
    fits = [(t["machine"], r["fits"]) for t in data["tables"] for r in t["rows"] if r["fits"]]
    assert len(fits) == len(set(fits))  # each parameter fitted once per machine
    for m in data["machines"]:  # both machines keep predicted rows
        assert any(not r["fits"] for t in data["tables"] if t["machine"] == m for r in t["rows"])
    assert all(x["why"] for x in data["left_out"])


def test_a_fitted_parameter_reproduces_its_row():
    data = seeds.load_data(DATA)
    t = next(t for t in data["tables"] if t["machine"] == "l4-colab" and any(r["row"] == "cpu" for r in t["rows"]))
    small = {**t, "tokens": 16}
    model = seeds.model_of(data, t["model"], t["quant"])
    hw = load_hardware("l4-colab")
    target = seeds.simulate_row(dataclasses.replace(hw, cpu_thread_gbps=3.0), model, small, "cpu", 1, 1.0)["tps"]
    one = {**data, "shared": [], "stated": [], "machines": {"l4-colab": data["machines"]["l4-colab"]},
           "tables": [{**small, "rows": [{"row": "cpu", "tps": target, "fits": "cpu_thread_gbps"}]}]}
    hosts = seeds.derive_hosts(one, 1, 1.0)
    assert hosts["l4-colab"].cpu_thread_gbps == pytest.approx(3.0, rel=0.01)


def test_coupled_fits_are_solved_jointly_where_a_row_does_not_depend_on_its_own_parameter():
    # the hybrid row has no graph split, yet fits the split: through the cpu row's per-thread rate
    data = seeds.load_data(DATA)
    t = {**data["tables"][0], "tokens": 12}
    model = seeds.model_of(data, t["model"], t["quant"])
    true = dataclasses.replace(load_hardware("rtx4060-laptop"), split_sync_s=3e-4, cpu_thread_gbps=7.0)
    rows = [{"row": r, "tps": seeds.simulate_row(true, model, t, r, 1, 1.0, seeds.routing_of(data))["tps"], "fits": f}
            for r, f in (("cpu", "cpu_thread_gbps"), ("hybrid-slow-fill", "split_sync_s"))]
    assert seeds.simulate_row(dataclasses.replace(true, split_sync_s=1e-5), model, t, "hybrid-slow-fill", 1, 1.0,
                              seeds.routing_of(data)) == seeds.simulate_row(true, model, t, "hybrid-slow-fill", 1, 1.0,
                                                                            seeds.routing_of(data))
    one = {**data, "shared": [], "stated": [], "machines": {"rtx4060-laptop": data["machines"]["rtx4060-laptop"]},
           "tables": [{**t, "rows": rows}]}
    h = seeds.derive_hosts(one, 1, 1.0)["rtx4060-laptop"]
    assert h.split_sync_s == pytest.approx(3e-4, rel=0.02) and h.cpu_thread_gbps == pytest.approx(7.0, rel=0.02)


def test_a_mixed_type_file_charges_each_expert_its_share_of_the_file():
    data = seeds.load_data(DATA)
    nominal = seeds.model_of(data, "qwen3-coder-next", "IQ4_XS").expert_bytes(3)
    assert seeds.model_of(data, "qwen3-coder-next", "IQ4_XS", 36).expert_bytes(3) < 0.95 * nominal
    single = seeds.model_of(data, "qwen3.5-35b-a3b", "Q6_K")  # a single-type file: the estimate lands near its type
    assert seeds.model_of(data, "qwen3.5-35b-a3b", "Q6_K", 27).expert_bytes(3) == pytest.approx(single.expert_bytes(3), rel=0.05)
    with pytest.raises(ValueError, match="file_gib"):
        seeds.model_of(data, "qwen3.5-35b-a3b", "Q6_K", 0.5)
    t = {"machine": "l4-colab", "tokens": 8, "cache_mib": 1024}
    hw = load_hardware("l4-colab")  # on the CPU alone the mixed file costs its nominal type's time per weight
    ud, nom = seeds.model_of(data, "qwen3-coder-next", "IQ4_XS", 36), seeds.model_of(data, "qwen3-coder-next", "IQ4_XS")
    slow = dataclasses.replace(hw, cpu_thread_gbps=0.5)  # CPU-bound: the GPU's share is negligible
    a, b = (seeds.simulate_row(slow, m, t, "cpu", 1, 1.0)["tps"] for m in (ud, nom))
    assert a == pytest.approx(b, rel=0.01)


def test_a_stated_load_time_sets_the_pageable_rate_from_the_prompt_bytes():
    data = seeds.load_data(DATA)
    t = {"machine": "l4-colab", "model": "qwen3.5-35b-a3b", "quant": "IQ4_XS", "cache_mib": 1024, "tokens": 8,
         "note": "", "rows": [{"row": "lru", "tps": 30.0, "fits": None}]}
    st = {"machine": "l4-colab", "param": "pageable_gbps", "prompt_load_s": [1.0, 3.0], "cache_mib": 1024, "source": "x"}
    one = {**data, "shared": [], "stated": [st], "tables": [t]}
    loaded, experts = seeds.prompt_load(one, "l4-colab", 1024, 1, 1.0)
    model = seeds.model_of(data, t["model"], t["quant"])  # the prompt's batch streams each expert it routes to once
    ids = seeds._routes(model, 8, 0, seeds.routing_of(data))[: seeds.PROMPT_TOKENS]
    moe = list(model.geometry().moe_layers)
    assert experts == sum(len(np.unique(ids[:, l])) for l in moe) > seeds.PROMPT_TOKENS * model.top_k / 2
    assert loaded == pytest.approx(experts * model.expert_bytes(moe[0]))
    fixed = experts * 3 * load_hardware("l4-colab").copy_latency_s  # three tensor copies per expert
    assert 0 < fixed < 0.5
    assert seeds.derive_hosts(one, 1, 1.0)["l4-colab"].pageable_gbps == pytest.approx(loaded / (2.0 - fixed) / 1e9, rel=1e-2)
    with pytest.raises(ValueError, match="leave no time"):  # seconds the copies' fixed costs alone exceed
        seeds.derive_hosts({**one, "stated": [{**st, "prompt_load_s": [fixed / 2, fixed / 2]}]}, 1, 1.0)


def test_prompt_and_generation_are_two_topics_and_a_shorter_run_is_a_prefix():
    data = seeds.load_data(DATA)
    model = seeds.model_of(data, "qwen3.5-35b-a3b", "Q6_K")
    p = seeds.routing_of(data)
    short, long = seeds._routes(model, 80, 0, p), seeds._routes(model, 160, 0, p)
    assert short.shape == (seeds.PROMPT_TOKENS + 80, model.num_layers, model.top_k)
    assert (short == long[: len(short)]).all()  # the 80-token row's trace is the start of the 160-token row's
    from traces import synth  # the prompt is one sequence, the generation the next, over one popularity
    t = synth.generate(model.num_layers, model.num_experts, model.top_k, 320, p, np.random.default_rng(0), num_seqs=2)
    assert (long[seeds.PROMPT_TOKENS:] == t.expert_ids[160:]).all() and (long[:seeds.PROMPT_TOKENS] == t.expert_ids[:63]).all()


def test_routing_fit_ranks_the_grid_by_its_error_on_the_routing_statistics():
    data = seeds.load_data(DATA)
    stat = {**data["routing_stats"][0], "tokens": 90}
    one = {**data, "routing_stats": [stat]}
    grid = seeds.fit_routing(one, 1, {"zipf_s": (0.4, 2.0)})
    assert [g["params"]["zipf_s"] for g in grid] == [0.4, 2.0]  # a steep popularity touches far fewer pairs
    for g in grid:
        assert g["rms"] == pytest.approx(abs(g["simulated"][0] - stat["published"]))
    again = seeds.routing_checks(one, 1, dataclasses.replace(seeds.routing_of(one), zipf_s=2.0))
    assert again[0]["simulated"] == grid[1]["simulated"][0]
    with pytest.raises(ValueError, match="routing_stats"):
        seeds.fit_routing({**data, "routing_stats": []}, 1)


def test_an_upload_is_three_tensor_copies_each_with_its_fixed_cost():
    data = seeds.load_data(DATA)
    t = {**data["tables"][3], "tokens": 12}
    model = seeds.model_of(data, t["model"], t["quant"])
    hw = load_hardware("l4-colab")
    # fixed costs that dominate every step: one more millisecond per copy adds three per expert upload
    base, more = (seeds.simulate_row(dataclasses.replace(hw, copy_latency_s=x), model, t, "lru", 1, 1.0,
                                     seeds.routing_of(data))["tps"] for x in (1e-3, 2e-3))
    items, _ = seeds._items(model, "lru", float(t["cache_mib"]), 12, 0, seeds.routing_of(data))
    ups = sum(len(it.decision.uploads) for it in items if getattr(it, "decision", None) is not None
              and it.token.phase == "decode")
    added = 12 / more - 12 / base  # seconds over the 12 generated tokens
    assert ups and added == pytest.approx(ups * 3e-3 + 12e-3, rel=0.01)  # and each token's sampled id read back


def test_fit_routing_flag_prints_the_grid_and_refuses_an_out_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(seeds, "fit_routing", lambda data, n: [
        {"params": {"zipf_s": 0.5}, "simulated": [0.9] * len(data["routing_stats"]), "rms": 0.01}])
    assert _script().main(["--fit-routing"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("rms | ") and out[1].startswith("published | ") and out[2] == (
        "0.0100 | " + " | ".join(["0.900"] * len(seeds.load_data(DATA)["routing_stats"])) + ' | {"zipf_s": 0.5}')
    assert _script().main(["--fit-routing", "--out", str(tmp_path / "x.md")]) == 2
    assert "--fit-routing writes no report" in capsys.readouterr().err and not (tmp_path / "x.md").exists()


def test_a_split_round_trip_slows_cpu_rows_and_not_the_mailbox():
    data = seeds.load_data(DATA)
    t = {**data["tables"][0], "tokens": 12}
    model = seeds.model_of(data, t["model"], t["quant"])
    hw = load_hardware("rtx4060-laptop")
    slow = dataclasses.replace(hw, split_sync_s=1e-3)
    assert seeds.simulate_row(slow, model, t, "cpu", 1, 1.0)["tps"] < seeds.simulate_row(hw, model, t, "cpu", 1, 1.0)["tps"]
    assert seeds.simulate_row(slow, model, t, "hybrid", 1, 1.0) == seeds.simulate_row(hw, model, t, "hybrid", 1, 1.0)


def test_bounds_free_uploads_lift_the_hybrid_and_cpu_moe_is_the_tables_own_row():
    data = seeds.load_data(DATA)
    t = {**data["tables"][1], "tokens": 12}  # the laptop's Qwen3-Coder-Next table: no row fitted
    one = {**data, "tables": [t]}
    hosts = {m: load_hardware(m) for m in data["machines"]}
    res = seeds.predict_tables(one, hosts, 1, 1.0)
    (b,) = seeds.bounds(one, hosts, 1, 1.0, res)
    pred = {r["row"]: r["predicted"] for r in res[0]["rows"]}
    assert set(b["free"]) == {"hybrid-slow-fill"} and b["free"]["hybrid-slow-fill"] > pred["hybrid-slow-fill"]
    assert b["cpu"] == pred["cpu"]
    no_cpu = {**t, "rows": [r for r in t["rows"] if r["row"] != "cpu"]}  # computed where the table lacks the row
    res2 = seeds.predict_tables({**data, "tables": [no_cpu]}, hosts, 1, 1.0)
    assert seeds.bounds({**data, "tables": [no_cpu]}, hosts, 1, 1.0, res2)[0]["cpu"] == pytest.approx(pred["cpu"])
    line = seeds._bound_line(b, {"hybrid-slow-fill": 1e3, "cpu": 1.0, "lru": 1.0})
    assert line.startswith("Bounds: ") and "above this bound" in line and "below it" not in line
    for free, n in ((1e3, 0), (1e-3, 1)):  # the Errors section counts the predicted rows outside their bounds
        text = seeds.report(one, hosts, res, 1, "cmd", (), [{"free": {"hybrid-slow-fill": free}, "cpu": 0.0}])
        assert f"- Outside their table's bounds (no modelled cost gives them): {n} of the predicted rows" in text


def test_small_run_has_the_committed_structure_and_rows(tmp_path):
    out = tmp_path / "seed.md"
    assert _script().main(["--seeds", "1", "--tokens-scale", "0.05", "--out", str(out)]) == 0
    small, committed = out.read_text(), DOC.read_text()
    heads = lambda t: [l for l in t.splitlines() if l.startswith("#")]
    assert heads(small) == heads(committed)
    for h in ("## Method", "## Errors", "## Known limits"):
        assert h in heads(committed)
    assert [(a, b, c) for a, b, c in _rows(small)] == _rows(committed)
    data = json.loads(DATA.read_text())
    assert [(f"{r['tps']:.1f}", r["fits"] or "") for t in data["tables"] for r in t["rows"]] == \
        [(b, c) for _, b, c in _rows(committed)]
    for text in (small, committed):
        m = LAST.match(text.rstrip("\n").splitlines()[-1])
        assert m, text.splitlines()[-1]
        n, total, fitted = (int(g) for g in m.groups())
        assert fitted == sum(1 for *_, c in _rows(text) if c) and 0 <= n <= total == len(_rows(text)) - fitted


@pytest.mark.slow
def test_committed_report_is_what_its_command_writes(tmp_path):
    committed = DOC.read_text()
    cmd = re.search(r"Command: `python experiments/reproduce_seed_tables.py(.*?) --out docs/SEED_TABLES.md`", committed)
    assert cmd, "the report names its command"
    out = tmp_path / "seed.md"
    assert _script().main(shlex.split(cmd.group(1)) + ["--out", str(out)]) == 0
    assert out.read_text() == committed


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("tables"), "'tables'"),
    (lambda d: d["tables"][0].pop("cache_mib"), "tables[0] has no field 'cache_mib'"),
    (lambda d: d["tables"][0]["rows"][0].update(tps=-1), "tables[0].rows[0].tps"),
    (lambda d: d["tables"][1]["rows"][0].update(row="belady"), "tables[1].rows[0].row"),
    (lambda d: d["tables"][0].update(machine="h100"), "tables[0].machine 'h100'"),
    (lambda d: d["tables"][1]["rows"][0].update(fits="cpu_thread_gbps"), "already fitted"),
    (lambda d: d["tables"][1]["rows"][0].update(fits="gpu_tflops"), "tables[1].rows[0].fits"),
    (lambda d: d["tables"][5].update(file_gib=-1), "tables[5].file_gib"),
    (lambda d: d["stated"][0].update(param="cpu_thread_gbps"), "stated[0].param"),
    (lambda d: d["stated"][0].update(prompt_load_s=[1.5]), "stated[0]"),
    (lambda d: d["tables"][3]["rows"][0].update(fits="pageable_gbps"), "already fitted"),
    (lambda d: d["routing_stats"][0].update(published=98.6), "routing_stats[0]"),
    (lambda d: d["routing_stats"][1].update(model="qwen9"), "routing_stats[1].model"),
    (lambda d: d["stated"][0].update(cache_mib=4096), "stated[0].cache_mib"),
    (lambda d: d["routing"].update(zipf=0.5), "routing: unknown field(s) ['zipf']"),
    (lambda d: d["routing"].update(zipf_s=-1.0), "routing: SynthParams.zipf_s"),
    (lambda d: d["routing"].pop("source"), "routing: expected"),
])
def test_bad_data_file_is_refused_before_any_work(tmp_path, capsys, edit, field):
    data = json.loads(DATA.read_text())
    edit(data)
    bad, out = tmp_path / "bad.json", tmp_path / "out.md"
    bad.write_text(json.dumps(data))
    assert _script().main(["--data", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr()
    assert field in err.err and str(bad) in err.err and len(err.err.strip().splitlines()) == 1
    assert err.out == "" and not out.exists()


def test_warmups_split_a_row_given_at_two_lengths_into_its_early_and_later_rates():
    t = {"machine": "l4-colab", "model": "m", "quant": "Q6_K", "cache_mib": 16384}
    row = lambda pub, pred: {"row": "lru", "label": "cache", "published": pub, "predicted": pred}
    res = [{"table": {**t, "tokens": 256}, "rows": [row(40.0, 32.0)]},
           {"table": {**t, "tokens": 1024}, "rows": [row(50.0, 40.0)]},
           {"table": {**t, "cache_mib": 4096, "tokens": 1024}, "rows": [row(10.0, 10.0)]}]  # another cache: no pair
    (w,) = seeds.warmups(res)
    assert (w["split"], w["tokens"], w["label"]) == (256, 1024, "cache")
    assert w["published"] == pytest.approx((40.0, 768 / (1024 / 50 - 256 / 40)))
    assert w["predicted"] == pytest.approx((32.0, 768 / (1024 / 40 - 256 / 32)))
    assert 256 / 40 + 768 / w["published"][1] == pytest.approx(1024 / 50)  # the two parts add up to the long run


def test_a_speedup_whose_two_rows_are_both_fitted_is_shown_and_not_counted():
    data = seeds.load_data(DATA)
    t = {**data["tables"][0], "tokens": 12}  # the laptop's lru and hybrid rows both fit a parameter
    assert all(r["fits"] for r in t["rows"])
    hosts = {m: load_hardware(m) for m in data["machines"]}
    res = seeds.predict_tables({**data, "tables": [t]}, hosts, 1, 1.0)
    assert res[0]["speedup"]["fitted"]
    text = seeds.report({**data, "tables": [t]}, hosts, res, 1, "cmd")
    assert "(both rows fitted: not counted)." in text and "sign right in 0 of 0;" in text
    one = {**t, "rows": [{**r, "fits": None if r["row"] == "lru" else r["fits"]} for r in t["rows"]]}
    res = seeds.predict_tables({**data, "tables": [one]}, hosts, 1, 1.0)
    assert not res[0]["speedup"]["fitted"] and "sign right in 1 of 1;" in seeds.report({**data, "tables": [one]}, hosts,
                                                                                       res, 1, "cmd")


def test_the_faster_fill_uploads_the_prompt_s_experts_before_the_first_token():
    from scheduler import AwaitBackground, StartBackground

    data = seeds.load_data(DATA)
    model = seeds.model_of(data, "qwen3.5-35b-a3b", "IQ4_XS")
    routing = seeds.routing_of(data)
    ids = seeds._routes(model, 8, 0, routing)
    moe = list(model.geometry().moe_layers)
    prompt = {(l, int(e)) for l in moe for e in np.unique(ids[: seeds.PROMPT_TOKENS, l])}
    for mib, full in ((50_000.0, False), (500.0, True)):  # room for every prompt expert; a cache they overflow
        items, _ = seeds._items(model, "hybrid", mib, 8, 0, routing)
        assert type(items[0]) is StartBackground and type(items[1]) is AwaitBackground
        moved = [(m.layer, m.expert) for m in items[0].moves]
        assert len(set(moved)) == len(moved) and set(moved) <= prompt
        assert (len(moved) < len(prompt)) == full
        if full:  # the most routed first
            count = lambda p: int((ids[: seeds.PROMPT_TOKENS, p[0]] == p[1]).sum())
            assert min(map(count, moved)) >= max(count(p) for p in prompt - set(moved))
    slow, _ = seeds._items(model, "hybrid-slow-fill", 50_000.0, 8, 0, routing)
    assert type(slow[0]) is not StartBackground  # before the faster fill the hybrid starts empty
    hw = load_hardware("l4-colab")
    t = {"cache_mib": 50_000.0, "tokens": 8}
    fast = seeds.simulate_row(hw, model, t, "hybrid", 1, 1.0, routing)
    assert fast["tps"] < seeds.simulate_row(hw, model, t, "hybrid-slow-fill", 1, 1.0, routing)["tps"]


def test_quant_types_of_one_geometry_share_their_trace_and_tokens():
    data = seeds.load_data(DATA)
    routing = seeds.routing_of(data)
    q6, iq4 = (seeds.model_of(data, "qwen3.5-35b-a3b", q) for q in ("Q6_K", "IQ4_XS"))
    assert seeds._routes(q6, 8, 0, routing) is seeds._routes(iq4, 8, 0, routing)
    assert not seeds._routes(q6, 8, 0, routing).flags.writeable
    toks = seeds._shape_tokens(seeds._shape(q6), 8, 0, routing)
    ids = seeds._routes(q6, 8, 0, routing)
    assert len(toks) == 8 and toks[0].pos == seeds.PROMPT_TOKENS
    assert all(s.experts == tuple(int(e) for e in ids[seeds.PROMPT_TOKENS, s.layer]) for s in toks[0].steps)


def test_the_joint_solve_computes_one_jacobian_while_steps_converge():
    a = np.array([[1.0, 0.3], [0.2, 0.8]])
    calls = []

    def rate(x, i):  # a mildly nonlinear map whose solution is x = (0.5, -0.2)
        calls.append(i)
        y = a @ x + 0.05 * x ** 2
        return math.exp(y[i])

    want = np.array([0.5, -0.2])
    targets = [math.exp(v) for v in a @ want + 0.05 * want ** 2]
    x = seeds._solve_joint(rate, targets, np.zeros(2), np.full(2, -5.0), np.full(2, 5.0), np.ones((2, 2), bool))
    assert x == pytest.approx(want, abs=1e-3)
    assert len(calls) <= 2 * 2 + 2 * 6  # one Jacobian (2 x 2 evaluations) and a few residuals


def test_the_hybrid_s_background_moves_land_a_token_later():
    from scheduler import AwaitBackground, EndToken, StartBackground

    data = seeds.load_data(DATA)
    model = seeds.model_of(data, "qwen3.5-35b-a3b", "IQ4_XS")
    items, _ = seeds._items(model, "hybrid-slow-fill", 5000.0, 8, 0, seeds.routing_of(data))
    ends = [i for i, it in enumerate(items) if type(it) is EndToken]
    starts = [i for i, it in enumerate(items) if type(it) is StartBackground]
    waits = [i for i, it in enumerate(items) if type(it) is AwaitBackground]
    assert starts and len(waits) == len(starts)
    inner = [(s, w) for s, w in zip(starts, waits) if w < ends[-1]]  # the rest: awaited after the last token
    assert inner
    for s, w in inner:  # started with token n, awaited once token n + lag has ended
        assert sum(1 for e in ends if s < e < w) == seeds.SWAP_LAG_TOKENS + 1


def test_a_fixed_parameter_is_given_on_every_machine_and_its_row_is_predicted(capsys):
    data = seeds.load_data(DATA)
    fixed = seeds.fix_params(data, {"mailbox_s": 2e-6})
    was = [(i, j) for i, t in enumerate(data["tables"]) for j, r in enumerate(t["rows"]) if r.get("fits") == "mailbox_s"]
    assert was and all(fixed["tables"][i]["rows"][j]["fits"] is None for i, j in was)
    assert data["tables"][was[0][0]]["rows"][was[0][1]]["fits"] == "mailbox_s"  # the loaded data is not changed
    assert sum(1 for t in fixed["tables"] for r in t["rows"] if r.get("fits")) == len(seeds._fit_rows(data)) - len(was)
    hosts = {m: load_hardware(m) for m in data["machines"]}
    quiet = {**fixed, "tables": [], "stated": []}  # no fits, no stated rate: only the given value
    assert all(h.mailbox_s == 2e-6 for h in seeds.derive_hosts(quiet, 1, 1.0, hosts).values())
    with pytest.raises(ValueError, match="--fixed gpu_tflops"):
        seeds.fix_params(data, {"gpu_tflops": 1.0})
    with pytest.raises(ValueError, match=r"--fixed mailbox_s=1\.0"):
        seeds.fix_params(data, {"mailbox_s": 1.0})
    assert _script().main(["--fixed", "mailbox_s=fast"]) == 2
    assert _script().main(["--fixed", "split_sync_s=9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --fixed mailbox_s=fast: expected PARAM=VALUE with a number",
                   "error: --fixed split_sync_s=9.0: expected a value in [1e-07, 0.005]"]
