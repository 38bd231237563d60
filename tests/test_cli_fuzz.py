"""Fuzzing the file readers through their commands: the STRP reader (``moelab profile show``), the
native trace loader (``moelab trace info``, which validates every entry) and the GGUF header reader
(``moelab model info``).

A valid file is damaged (bytes overwritten, truncated, extended; header fields replaced; arrays of
another dtype, shape or content), and the command must either accept it or refuse it with its
error status and one line on stderr; never an exception.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import traces
from moelab import profile_cli
from scheduler.profile import Profile, write_strp
from moelab import trace_cli

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _call(main, argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    return rc, err.getvalue()


def _check(rc: int, err: str, error_rc: int, prefix: str) -> None:
    if rc == 0:
        return
    assert rc == error_rc, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err


damage = st.lists(st.tuples(st.integers(0, 4096), st.binary(min_size=1, max_size=8)), max_size=4)
cut = st.one_of(st.none(), st.integers(0, 4096))
tail = st.binary(max_size=64)


def _damaged(data: bytes, edits, cut_at, extra: bytes) -> bytes:
    b = bytearray(data)
    for at, chunk in edits:
        at %= max(len(b), 1)
        b[at:at + len(chunk)] = chunk
    if cut_at is not None:
        b = b[:cut_at % (len(b) + 1)]
    return bytes(b) + extra


# STRP -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def strp_bytes(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("strp")
    counts = np.random.default_rng(0).integers(0, 5, (3, 8))
    out = {}
    for trailer in ("freq", "rank", None):
        p = root / f"{trailer}.strp"
        write_strp(Profile.from_counts(counts, 6), p, trailer)
        out[trailer] = p.read_bytes()
    return out


@FUZZ
@given(kind=st.sampled_from(["freq", "rank", None]), edits=damage, cut_at=cut, extra=tail,
       header=st.one_of(st.none(), st.tuples(*[st.integers(0, 2**32 - 1)] * 5)))
def test_strp_reader_through_profile_show(strp_bytes, kind, edits, cut_at, extra, header):
    data = strp_bytes[kind]
    if header is not None:
        data = b"STRP" + struct.pack("<5I", *header) + data[24:]
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.strp"
        p.write_bytes(_damaged(data, edits, cut_at, extra))
        rc, err = _call(profile_cli.main, ["show", str(p)])
    _check(rc, err, 2, "moelab profile: error: ")


# native traces ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_trace_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trace")
    t = traces.load().select("decode", seqs=None)
    traces.Trace(t.model, t.num_experts[:3], t.top_k, np.array(t.expert_ids[:20, :3]), t.seq[:20], t.pos[:20],
                 t.phase[:20], np.array(t.weights[:20, :3]) if t.weights is not None else None, t.meta).save(root / "t")
    return root / "t"


json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                                    st.text(max_size=8)),
                          lambda v: st.lists(v, max_size=4) | st.dictionaries(st.text(max_size=6), v, max_size=3),
                          max_leaves=8)
header_field = st.sampled_from(["schema_version", "model", "num_experts", "top_k", "num_tokens", "meta", "arrays"])
array_name = st.sampled_from(["expert_ids", "weights", "seq", "pos", "phase"])
dtypes = st.sampled_from(["<i2", "<i4", "<i8", "<u1", "<f4", "<f8", "|b1"])


@FUZZ
@given(fields=st.dictionaries(header_field, json_value, max_size=2), name=array_name,
       new_array=st.one_of(st.none(), st.tuples(dtypes, st.lists(st.integers(0, 24), min_size=0, max_size=3),
                                                st.integers(-3, 40))),
       edits=damage, cut_at=cut)
def test_trace_loader_through_trace_info(small_trace_dir, fields, name, new_array, edits, cut_at):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t"
        shutil.copytree(small_trace_dir, p)
        h = json.loads((p / "trace.json").read_text())
        h.update(fields)
        (p / "trace.json").write_text(json.dumps(h))
        f = p / f"{name}.npy"
        if new_array is not None:
            dtype, shape, fill = new_array
            np.save(f, np.full(shape, fill).astype(dtype))
        elif f.exists():
            f.write_bytes(_damaged(f.read_bytes(), edits, cut_at, b""))
        rc, err = _call(trace_cli.main, ["info", str(p)])
    _check(rc, err, 2, "moelab trace info: error: ")


@FUZZ
@given(layer=st.integers(0, 2), row=st.integers(0, 19), value=st.integers(-40000, 40000))
def test_every_bad_expert_id_is_found_at_open(small_trace_dir, layer, row, value):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t"
        shutil.copytree(small_trace_dir, p)
        ids = np.load(p / "expert_ids.npy")
        ids[row, layer, 0] = np.int16(np.clip(value, -32768, 32767))
        np.save(p / "expert_ids.npy", ids)
        rc, err = _call(trace_cli.main, ["info", str(p)])
    v = int(ids[row, layer, 0])
    if v < -1 or v >= 32:  # every layer of the bundled trace has 32 experts
        assert rc == 2 and f"row {row} layer {layer}: id {v} out of range" in err, err
    else:
        _check(rc, err, 2, "moelab trace info: error: ")


# GGUF ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    from execute.synth import config_from_preset, synth_model

    root = tmp_path_factory.mktemp("gguf")
    cfg = config_from_preset("tiny", arch="qwen3moe", quant="Q8_0", dense_quant=None, seed=0, num_layers=1,
                             num_experts=4, top_k=2, hidden=32, ffn=32, num_heads=2, num_kv_heads=1, head_dim=16,
                             vocab=260, context_length=64)
    return synth_model(root / "m.gguf", cfg).read_bytes()


@FUZZ
@given(edits=damage, cut_at=cut, extra=tail)
def test_gguf_header_reader_through_model_info(gguf_bytes, edits, cut_at, extra):
    from execute.cli_model import model_main

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.gguf"
        p.write_bytes(_damaged(gguf_bytes, edits, cut_at, extra))
        rc, err = _call(model_main, ["info", str(p), "--json"])
    if rc == 0:
        return
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("moelab: warning:")]
    assert len(lines) == 1 and lines[0].startswith("moelab: "), err


# byte flips through the command line ---------------------------------------------------------------
# Four inputs (a small GGUF, an STRP profile, a trace folder, a hardware file), each damaged by a few
# random byte flips and fed to the commands that read it. Every case must end within FLIP_LIMIT_S in
# exit 0, or exit 2 with one line on stderr that names the damaged input. Each case runs
# ``moelab.cli.main`` in a forked child of this (already importing) process, so a case costs its
# work, not an interpreter's start; a child past the limit is killed and reported as a hang.
FLIP_LIMIT_S = 10.0
FLIPS_PER_INPUT = 30  # the default suite; test_ten_thousand_flips runs 2,500 per input


@pytest.fixture(scope="module")
def flip_inputs(tmp_path_factory) -> dict:
    from execute.synth import config_from_preset, synth_model
    from scheduler.hardware import HARDWARE_DIR

    root = tmp_path_factory.mktemp("flips")
    gguf = synth_model(root / "m.gguf", config_from_preset("tiny", arch="qwen3moe", quant="Q8_0", dense_quant=None,
                                                           seed=0))
    t = traces.load()
    rows = t.rows("decode")[:12]
    traces.Trace(t.model, t.num_experts, t.top_k, np.array(t.expert_ids[rows]), t.seq[rows], t.pos[rows],
                 t.phase[rows], None if t.weights is None else np.array(t.weights[rows]), t.meta).save(root / "t")
    write_strp(Profile.from_counts(t.routing_counts("decode"), 64), root / "p.strp", "freq")
    shutil.copy(HARDWARE_DIR / "rtx4060-laptop.json", root / "hw.json")
    return {"gguf": gguf, "strp": root / "p.strp", "trace": root / "t", "hardware": root / "hw.json"}


def _commands(kind: str, path: str) -> list[list[str]]:
    """The commands that read an input of ``kind`` at ``path``."""
    if kind == "gguf":
        return [["model", "info", path, "--json"],
                ["run", path, "-p", "hi", "-n", "2", "--backend", "numpy", "--threads", "1", "--quiet"]]
    if kind == "strp":
        return [["profile", "show", path]]
    if kind == "trace":
        return [["trace", "info", path], ["simulate", "--trace", path, "--tokens", "4", "--quiet"]]
    return [["simulate", "--hardware", path, "--tokens", "3", "--quiet"]]


def _flip(src: Path, dst: Path, rng: np.random.Generator) -> None:
    """``src`` copied to ``dst`` with 1-4 bytes XORed by random non-zero values, half of the time
    within the first 4 KiB (headers, metadata, .npy headers), else anywhere."""
    data = bytearray(src.read_bytes())
    span = min(len(data), 4096) if rng.random() < 0.5 else len(data)
    for _ in range(int(rng.integers(1, 5))):
        data[int(rng.integers(span))] ^= int(rng.integers(1, 256))
    dst.write_bytes(bytes(data))


def _damaged_copy(kind: str, src: Path, d: Path, rng: np.random.Generator) -> Path:
    if kind != "trace":
        dst = d / src.name
        _flip(src, dst, rng)
        return dst
    dst = d / "t"
    shutil.copytree(src, dst)
    f = sorted(dst.iterdir())[int(rng.integers(len(list(dst.iterdir()))))]  # one file of the folder
    _flip(f, f, rng)
    return dst


def _fork_main(argv: list[str], err_path: Path, limit_s: float) -> tuple[int | None, float]:
    """``moelab.cli.main(argv)`` in a forked child, stderr to ``err_path``; (status or None on a
    hang, seconds taken)."""
    import os
    import signal
    import sys
    import time

    from moelab.cli import main

    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        rc = 70
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(null, 1)
            os.dup2(err, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
            rc = int(main(argv) or 0)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback

            traceback.print_exc()
            rc = 71
        finally:
            try:
                sys.stderr.flush()
            finally:
                os._exit(rc)
    while time.perf_counter() - t0 < limit_s:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.perf_counter() - t0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None, time.perf_counter() - t0


def flip_run(inputs: dict, per_input: int, seed: int, limit_s: float = FLIP_LIMIT_S) -> dict:
    """``per_input`` damaged copies of each input through its commands; the failures, and counts."""
    from moelab.cli import main

    for kind, src in inputs.items():  # once on the intact inputs here: every module is imported before the forks
        for argv in _commands(kind, str(src)):
            assert _call(main, argv)[0] == 0, argv
    rng = np.random.default_rng(seed)
    out = {"cases": 0, "exit_0": 0, "exit_2": 0, "slowest_s": 0.0, "failures": []}
    for kind, src in inputs.items():
        for _ in range(per_input):
            with tempfile.TemporaryDirectory() as d:
                d = Path(d)
                bad = _damaged_copy(kind, Path(src), d, rng)
                for argv in _commands(kind, str(bad)):
                    rc, took = _fork_main(argv, d / "stderr", limit_s)
                    err = (d / "stderr").read_text(errors="replace")
                    out["cases"] += 1
                    out["slowest_s"] = max(out["slowest_s"], took)
                    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
                    ok = rc == 0 or (rc == 2 and len(lines) == 1 and lines[0].startswith("moelab")
                                     and str(bad) in lines[0])
                    if rc in (0, 2):
                        out[f"exit_{rc}"] += 1
                    if not ok:
                        out["failures"].append({"argv": argv[:2], "kind": kind, "status": rc, "stderr": err[-600:]})
    return out


def test_random_byte_flips_end_in_exit_0_or_one_line_naming_the_input(flip_inputs):
    res = flip_run(flip_inputs, FLIPS_PER_INPUT, seed=0)
    assert res["cases"] == 6 * FLIPS_PER_INPUT  # GGUF: 2 commands, STRP 1, trace 2, hardware 1
    assert not res["failures"], res["failures"][:3]


@pytest.mark.slow
def test_ten_thousand_flips(flip_inputs):
    """10,000 damaged inputs (2,500 of each kind); the run prints its counts."""
    res = flip_run(flip_inputs, 2500, seed=1)
    print(json.dumps({k: v for k, v in res.items() if k != "failures"} | {"failures": len(res["failures"])}))
    assert not res["failures"], res["failures"][:5]
