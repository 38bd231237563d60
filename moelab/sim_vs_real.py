"""Does the simulator predict the executor? Joins the executor's recording (``execute.fidelity``)
with the simulator's predictions (``simulate.fidelity``), and the peer benchmark's moelab rows
with theirs (``simulate.peer``). ``experiments/sim_vs_real.py`` is the command line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["checked_inputs", "runs_of", "run", "predict_peer_rows", "predict_moves", "print_moves", "per_round"]


def checked_inputs(a: dict):
    """The checked trace and the simulator's model of a recording's arguments ``a``."""
    from execute.calibrate import synth_tokens
    from simulate.fidelity import sim_model

    tokens, _ = synth_tokens(a["layers"], a["experts"], a["top_k"], a["tokens"], a["seed"] + 1)
    return tokens, sim_model(a["layers"], a["vocab"])


def runs_of(a: dict) -> list[dict]:
    """The configurations named by a recording's (or the command line's) arguments ``a``."""
    from scheduler.models import quant_bytes
    from simulate.fidelity import configs, select

    budgets = a.get("budgets")
    eb = quant_bytes("Q8_0", 3 * a["hidden"] * a["ffn"])  # the executor's random experts are Q8_0
    return select(configs(a["experts"], budgets, a["layers"], eb), a.get("configs"))


def predict_peer_rows(result_paths, hw_path: str, seeds: int = 3) -> int:
    """Print predicted vs measured per moelab row of each peer ``result.json`` (a path or a list),
    then, for several, the count within 15% over all of them; 2 on bad input (before any output)."""
    from scheduler.hardware import HardwareError, load_hardware
    from simulate.peer import format_peer, load_result, predict_peer

    paths = [result_paths] if isinstance(result_paths, (str, Path)) else list(result_paths)
    try:
        hw = load_hardware(hw_path)
        results = [(p, load_result(Path(p))) for p in paths]
        tables = []
        for p, result in results:
            trace = Path(p).parent / "trace"
            tables.append((result, trace, predict_peer(result, hw, seeds, trace if trace.is_dir() else None)))
    except (HardwareError, ValueError) as e:
        print(f"sim_vs_real: {e}", file=sys.stderr)
        return 2
    for result, trace, rows in tables:
        print(format_peer(rows, float(result["config"]["budget_mib"])))
        print(f"routing: {'the run recorded, ' + str(trace) if trace.is_dir() else f'{seeds} synthetic traces (no trace recorded)'}")
    if len(tables) > 1:
        got = [r for _, _, rows in tables for r in rows if r["error"] is not None]
        print(f"all budgets: rows within 15%: {sum(abs(r['error']) <= 0.15 for r in got)} of {len(got)} measured")
    return 0


def predict_moves(runs: list[dict], hw, model) -> dict:
    """The simulator on the probe's workloads (``execute.calibrate_moves``), the same items as the
    executor ran: per workload predicted seconds per token (its timed tokens) and, per moved
    expert, the difference from ``hits``; beside ``moves_summary``'s measured figures."""
    from execute.calibrate_moves import BASE, EVENTS, ScriptedPolicy, moves_summary, moves_tokens
    from scheduler.costs import Costs, ExecConfig
    from scheduler.drive import drive
    from simulate.engine import Simulator

    meas = moves_summary(runs)
    geo = model.geometry()
    costs = Costs(model, hw, ExecConfig(policy="gpu"))  # the scripted policy plans as little as gpu's
    r0 = runs[0]
    warm, n, k = int(r0["warm"]), len(r0["token_s"]), int(r0["top_k"])
    pred = {}
    for kind in meas:
        toks = moves_tokens(kind, geo.num_layers, warm + n, k)
        res = Simulator(costs).run(drive(ScriptedPolicy(geo, kind), toks))
        pred[kind] = float(np.mean(res.token_s[warm:]))
    out = {}
    for kind, m in meas.items():
        row = {"measured_token_s": m["token_s"], "predicted_token_s": pred[kind], "spread": m["spread"],
               "host_token_s": m["host_token_s"]}
        base = BASE.get(kind, "hits")
        if kind != "hits" and base in pred:
            row["measured_delta_s"] = m["delta_s"]
            row["predicted_delta_s"] = (pred[kind] - pred[base]) / (geo.num_layers * EVENTS[kind])
        out[kind] = row
    return out


def print_moves(rows: dict) -> None:
    """The probe's table: per workload measured and predicted ms per token, and per moved expert
    the measured and predicted cost over ``hits`` and what the model leaves out."""
    print("\nmoves probe (execute.calibrate_moves): moved experts per layer and token (stream2: two, the others one); "
          "us/event over hits (cpuswap: over cpu)")
    print(f"{'workload':<9}{'ms/tok m':>10}{'pred':>8}{'spread':>8}{'us/event m':>12}{'pred':>8}{'left out':>10}"
          f"{'host us/tok':>12}")
    for kind, r in rows.items():
        host = sum(r["host_token_s"].values()) * 1e6
        ev = ("", "", "") if "measured_delta_s" not in r else (
            f"{r['measured_delta_s'] * 1e6:12.1f}", f"{r['predicted_delta_s'] * 1e6:8.1f}",
            f"{(r['measured_delta_s'] - r['predicted_delta_s']) * 1e6:10.1f}")
        print(f"{kind:<9}{r['measured_token_s'] * 1e3:10.3f}{r['predicted_token_s'] * 1e3:8.3f}{r['spread']:8.1%}"
              f"{ev[0]:>12}{ev[1]:>8}{ev[2]:>10}{host:12.1f}")


def per_round(args, raw: dict, out: Path) -> int:
    """Each round's runs predicted from that round's own session calibration (its calibration
    replays, unlogged runs and moves probe; the lane fit on them): the host as it was in that round.
    Prints per config the tokens/s error of each round and their median; 2 where a round has no
    calibration."""
    from execute.calibrate import synth_tokens
    from execute.fidelity import calibrated_on_round, log, session_hardware
    from scheduler.hardware import load_hardware
    from simulate import fidelity as fd

    tokens, model = checked_inputs(raw["args"])
    a = raw["args"]
    cal_tokens = synth_tokens(a["layers"], a["experts"], a["top_k"], 64, a["seed"] + 31)[0]
    per: dict[str, list] = {}
    for r in range(int(a.get("repeats", 1))):
        try:
            raw_r = calibrated_on_round(raw, r, same=True)
        except ValueError as e:
            print(f"sim_vs_real: --per-round: {e}", file=sys.stderr)
            return 2
        hw = load_hardware(session_hardware(args.hardware, raw_r, out / f"round{r}"))
        if not getattr(args, "no_lane_fit", False):
            hw, _ = fd.fit_lane(raw_r, hw, model, cal_tokens)
        for row in fd.compare(raw_r, hw, tokens, model):
            per.setdefault(row["label"], []).append(row["predicted_tokens_per_s"] / row["measured_tokens_per_s"] - 1)
        log(f"round {r}: predicted from its own calibration")
    print(f"\n{'config':<18}" + "".join(f"{f'round {r}':>9}" for r in range(len(next(iter(per.values())))))
          + f"{'median':>9}")
    for label, e in per.items():
        print(f"{label:<18}" + "".join(f"{100 * x:+8.1f}%" for x in e) + f"{100 * float(np.median(e)):+8.1f}%")
    every = [abs(x) for e in per.values() for x in e]
    meds = {k: abs(float(np.median(e))) for k, e in per.items()}
    worst = max(meds, key=meds.get)
    print(f"tokens/s error, each run against its round's calibration: median {100 * np.median(every):.1f}%, max "
          f"{100 * max(every):.1f}%; per config (median over rounds): median {100 * np.median(list(meds.values())):.1f}%, "
          f"max {100 * meds[worst]:.1f}% ({worst})")
    return 0


def _write_lane(hw_path, lane: dict) -> Path:
    """The session hardware file at ``hw_path`` with ``fit_lane``'s fields written in (and said in
    its sources); its path."""
    from execute.calibrate import write_json

    hw = json.loads(Path(hw_path).read_text())
    hw["executor"].update({k: v for k, (_, v) in lane.items()})
    hw.setdefault("sources", {})["executor.lane"] = (
        f"solved: {', '.join(lane)} so the simulator reproduces the session's unlogged calibration runs "
        "(simulate.fidelity.fit_lane: runs without CPU experts, then with them)")
    write_json(Path(hw_path), hw)
    return Path(hw_path)


def run(args) -> int:
    """The whole comparison for the parsed command line ``args`` (see the script)."""
    from execute.fidelity import log, run_device, session_hardware
    from scheduler.hardware import HardwareError, load_hardware
    from simulate import fidelity as fd

    try:
        hw = load_hardware(args.hardware)
    except HardwareError as e:
        print(f"sim_vs_real: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"sim_vs_real: --out {out}: cannot create the folder ({e.strerror})", file=sys.stderr)
        return 2
    if args.from_dir:
        src = Path(args.from_dir) / "raw.json"
        try:
            raw = json.loads(src.read_text())
            raw["args"]["layers"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"sim_vs_real: {src}: not a sim_vs_real result ({e})", file=sys.stderr)
            return 2
    else:
        raw = run_device(args, runs_of(vars(args)), fd.make_policy_of)
    if getattr(args, "calibration_round", None) is not None:
        from execute.fidelity import calibrated_on_round

        try:
            raw = calibrated_on_round(raw, args.calibration_round, getattr(args, "same_round", False))
        except ValueError as e:
            print(f"sim_vs_real: --calibration-round: {e}", file=sys.stderr)
            return 2
        log(f"calibrated on round {args.calibration_round}, checked on "
            + ("its own runs" if getattr(args, "same_round", False) else "the other rounds' runs"))
    if not raw.get("runs"):
        print("sim_vs_real: no recorded runs to compare", file=sys.stderr)
        return 1
    if getattr(args, "per_round", False):
        return per_round(args, raw, out)
    for h in raw.get("host_state") or ():  # recorded by run_device around each round
        b, e = h["before"], h["after"]
        busy = lambda x: "?" if x["busy_cores"] is None else f"{x['busy_cores']:.1f}"
        log(f"round {h['round']}: host {busy(b)} / {busy(e)} cores busy elsewhere before / after, memory read "
            f"{b['mem_gbps']:.0f} / {e['mem_gbps']:.0f} GB/s" + (f" -- BUSY: {h['problem']}" if h.get("problem") else ""))
    hw_path = args.hardware
    session = args.host_calibration == "session" and bool(raw.get("calibration_records"))
    if session:
        hw_path = session_hardware(args.hardware, raw, out)
        hw = load_hardware(hw_path)
        log(f"host lane and CPU pool from this session's calibration replays: {hw_path}")
    tokens, model = checked_inputs(raw["args"])
    from execute.calibrate import synth_tokens, write_json

    a = raw["args"]  # the calibration trace: calibrate_replay.replay_setup's
    cal_tokens = synth_tokens(a["layers"], a["experts"], a["top_k"], 64, a["seed"] + 31)[0]
    if session and not getattr(args, "no_lane_fit", False):
        hw, lane = fd.fit_lane(raw, hw, model, cal_tokens)
        if lane:
            hw_path = _write_lane(hw_path, lane)
            log("host lane solved on the calibration's unlogged runs: " + ", ".join(
                f"{k} {a_ * 1e6:.1f} -> {b * 1e6:.1f} us" for k, (a_, b) in lane.items()))
    rows = fd.compare(raw, hw, tokens, model)
    moves = predict_moves(raw["moves"], hw, model) if raw.get("moves") else None
    an, nz = fd.analyse(rows), fd.spread_summary(rows)
    fd.print_table(rows, an, nz)
    own = fd.calibration_check(raw, hw, model, cal_tokens)
    for c in own:
        frac = "" if c["miss_frac_256"] is None else f" f={c['miss_frac_256']}"
        print(f"calibration run {c['policy']} {c['slots']} slots{frac} (its own trace, in sample): measured "
              f"{c['measured_tokens_per_s']:.1f} tok/s, predicted {c['predicted_tokens_per_s']:.1f} ({c['error']:+.1%})")
    if moves:
        print_moves(moves)
    write_json(out / "sim_vs_real.json", {"hardware": str(hw_path), "analysis": an, "noise": nz, "rows": rows,
                                          "calibration_check": own, "moves": moves, "raw": raw})
    fd.write_csv(out / "sim_vs_real.csv", rows)
    fd.plot(rows, out / "sim_vs_real.png")
    if args.decompose:
        dec = fd.decompose(raw, hw, tokens, model)
        fd.print_decompose(dec)
        fd.write_csv(out / "decompose.csv", dec)
        ratios = fd.calibration_ratios(raw, model, tokens)
        btw = [{**r, **ratios.get(r["label"], {})} for r in fd.between_split(raw, hw)]
        if btw:
            fd.print_between(btw)
            fd.write_csv(out / "between.csv", btw)
    log(f"wrote {out}/sim_vs_real.csv, .json, .png")
    return 0
