"""experiments/peer_llamacpp.py and moelab.peer* without a GPU: the slim tarball, the -ncmoe budget, and bench end to
end against fake ``llama-bench`` and ``moelab`` executables that print the real output formats."""
from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from moelab import peer as bench_stage
from moelab import peer_build as build
from moelab import peer_runs as runs

# the script: its command line (main, parser) around the modules above
_spec = importlib.util.spec_from_file_location("peer_llamacpp", Path(__file__).parents[1] / "experiments" / "peer_llamacpp.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

# llama-bench -o json: its fields (tools/llama-bench), one object per test; tokens/s by -ncmoe.
FAKE_LLAMA = r'''#!{python}
import json, os, sys
a = sys.argv[1:]
opt = dict(zip(a[::2], a[1::2]))
n = int(opt["-ncmoe"])
with open(os.environ["PEER_CALLS"], "a") as f:
    f.write(f"llama {{n}}\n")
if str(n) == os.environ.get("PEER_FAIL_NCMOE"):
    print("llama_model_load: error loading model", file=sys.stderr)
    sys.exit(1)
print("load_backend: loaded CPU backend", file=sys.stderr)
speed = {{"pp": 1000.0 / (1 + n), "tg": 100.0 / (1 + n)}}
rows = []
for kind, p, g in (("pp", int(opt["-p"]), 0), ("tg", 0, int(opt["-n"]))):
    rows.append({{"build_commit": "abc1234", "build_number": 1, "cpu_info": "cpu", "gpu_info": "", "backends": "CPU",
                 "model_filename": opt["-m"], "model_type": "qwen3moe 30B.A3B Q8_0", "model_size": 1000,
                 "model_n_params": 10, "n_batch": 2048, "n_ubatch": 512, "n_threads": int(opt["-t"]),
                 "cpu_mask": "0x0", "cpu_strict": False, "poll": 50, "type_k": "f16", "type_v": "f16",
                 "n_gpu_layers": int(opt["-ngl"]), "n_cpu_moe": n, "split_mode": "layer", "main_gpu": 0,
                 "no_kv_offload": False, "flash_attn": 1, "devices": "auto", "tensor_split": "0.00",
                 "tensor_buft_overrides": "none", "load_mode": "mmap", "lazy_mode": "off", "embeddings": False,
                 "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0, "fit_min_ctx": 0,
                 "n_prompt": p, "n_gen": g, "n_depth": 0, "test_time": "2000-01-01T00:00:00Z",
                 "avg_ns": 1000, "stddev_ns": 10, "avg_ts": speed[kind], "stddev_ts": 1.0,
                 "samples_ns": [1000, 1000], "samples_ts": [speed[kind], speed[kind]]}})
print("[\n" + ",\n".join(json.dumps(r, indent=4) for r in rows) + "\n]")
'''

# moelab run --json: the generated text (here with a line holding "{"), then the figures.
FAKE_MOELAB = r'''#!{python}
import json, os, sys
a = sys.argv[1:]
assert a[0] == "run" and "--raw" in a and "--json" in a
policy = a[a.index("--policy") + 1]
graph_cpu = "--graph-cpu" in a
with open(os.environ["PEER_CALLS"], "a") as f:
    f.write(f"moelab {{policy}}{{'+cpugraph' if graph_cpu else ''}}\n")
if policy == os.environ.get("PEER_FAIL_POLICY"):
    print(f"moelab: {{policy}} broke", file=sys.stderr)
    sys.exit(2)
prompt = a[a.index("-p") + 1]
speed = {{"gpu": 500.0, "lru": 50.0, "hybrid": 60.0, "hybrid-cost": 70.0, "cpu": 5.0}}[policy] * (1.5 if graph_cpu else 1)
cache = float(a[a.index("--cache-mib") + 1]) - 1 if "--cache-mib" in a else 0.0
print("some text\n{{\nmore text")
print(json.dumps({{"model": a[1], "policy": policy, "prompt_tokens": len(prompt.split()), "prompt_s": 1.0,
                  "prompt_tokens_per_s": speed * 2, "generated": 8, "decode_tokens": 7, "decode_s": 1.0,
                  "decode_tokens_per_s": speed, "stopped_at_eos": False, "cache_mib": cache, "hit_rate": 0.5,
                  "uploads": 3, "upload_mib": 1.0, "digest": "00", "first_token_s": 0.5, "graph_cpu": graph_cpu}}, indent=2))
'''


def _script(path: Path, text: str) -> Path:
    path.write_text(text.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("peer") / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "moelab", "model", "synth", str(path), "--preset", "tiny", "--layers", "4",
                    "--experts", "32", "--hidden", "128", "--ffn", "128", "--quant", "Q8_0", "--quiet"],
                   check=True, capture_output=True)  # 1.6 MiB of experts per block
    return path


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    monkeypatch.setenv("PEER_CALLS", str(tmp_path / "calls.txt"))
    monkeypatch.setattr(bench_stage, "moelab_commit", lambda: "0000000")  # others may commit between two bench calls
    return {"llama": _script(tmp_path / "llama-bench", FAKE_LLAMA), "moelab": _script(tmp_path / "moelab", FAKE_MOELAB),
            "calls": tmp_path / "calls.txt"}


def _bench(tiny_gguf, fakes, out, *extra):
    return peer.main(["bench", "--work", str(out.parent), "--model", str(tiny_gguf), "--llama-bench", str(fakes["llama"]),
                      "--moelab", str(fakes["moelab"]), "--budget-mib", "2", "--out", str(out), "--timeout-s", "60",
                      *extra])


def _sdist(path: Path, files: dict) -> Path:
    with tarfile.open(path, "w:gz") as t:
        for name, text in {"PKG-INFO": "Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 9.9.9\n", **files}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_keep_drops_docs_examples_and_other_backends_but_not_what_the_build_reads():
    assert build.keep("LICENSE") and build.keep("CMakeLists.txt") and build.keep("tools/llama-bench/llama-bench.cpp")
    assert build.keep("ggml/src/ggml-cuda/template-instances/fattn-vec-instance-f16-f16.cu")
    assert build.keep("ggml/src/ggml-cpu/ggml-cpu.c") and build.keep("ggml/src/ggml.c")
    assert build.keep("examples/CMakeLists.txt") and not build.keep("examples/simple/simple.cpp")
    for rel in ("docs/build.md", "models/ggml-vocab.gguf", "ggml/src/ggml-vulkan/x.cpp", "tools/ui/index.html",
                ".github/workflows/x.yml", ".git", "tests/test-x.cpp"):
        assert not build.keep(rel), rel


def test_pack_writes_the_slim_tree_with_license_version_and_long_paths_renamed(tmp_path):
    long_name = "ggml/src/ggml-cuda/template-instances/" + "x" * 90 + ".cu"  # over tar's 100-character name field
    v = "vendor/llama.cpp/"
    sdist = _sdist(tmp_path / "s.tar.gz", {v + "LICENSE": "MIT", v + long_name: "cu", v + "docs/a.md": "doc",
                                            v + "ggml/src/ggml-metal/m.m": "metal", "llama_cpp/x.py": "py"})
    out = tmp_path / "lcpp.tgz"
    assert peer.main(["pack", "--sdist", str(sdist), "--out", str(out)]) == 0
    with tarfile.open(out) as t:
        names = set(t.getnames())
        source = json.loads(t.extractfile("llama.cpp/PEER_SOURCE.json").read())
    assert names == {"llama.cpp/LICENSE", "llama.cpp/" + long_name, "llama.cpp/PEER_SOURCE.json"}
    assert source == {"sdist": "s.tar.gz", "name": "llama_cpp_python", "version": "9.9.9"}
    side = json.loads(Path(f"{out}.json").read_text())
    assert side["version"] == "9.9.9" and side["files"] == 2 and side["sha256"] == build.sha256(out)
    assert peer.main(["pack", "--sdist", str(sdist), "--out", str(tmp_path / "again.tgz")]) == 0
    assert (tmp_path / "again.tgz").read_bytes() == out.read_bytes()


def test_pack_refuses_an_sdist_without_llama_cpp_license_and_writes_nothing(tmp_path, capsys):
    sdist = _sdist(tmp_path / "s.tar.gz", {"vendor/llama.cpp/CMakeLists.txt": "x"})
    assert peer.main(["pack", "--sdist", str(sdist), "--out", str(tmp_path / "o.tgz")]) == 2
    assert "LICENSE missing" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [sdist]


def test_budget_blocks_is_the_smallest_ncmoe_whose_vram_experts_fit():
    block = 128 * 5_013_504  # Qwen3-30B-A3B, Q8_0: 128 experts of 3 x 2048 x 768 weights
    assert runs.budget_blocks([block] * 48, 4096 * 2**20) == 42  # 6 blocks in VRAM, 7 would not fit
    assert runs.budget_blocks([block] * 48, 100 * 2**30) == 0
    assert runs.budget_blocks([block] * 48, 1) == 48
    assert runs.budget_blocks([0, 10, 10, 10], 20) == 2  # a leading dense block counts as a block


def test_fit_prompt_takes_the_longest_prefix_within_the_token_count():
    class Tok:
        def encode(self, text):
            return list(range(2 * len(text.split()) + 1))  # BOS + two tokens per word

    text, n = runs.fit_prompt(Tok(), 256)
    assert n == 255 and len(text.split()) == 127
    assert text.split()[:3] == runs.PROMPT_WORDS[:3]


def test_parse_llama_checks_the_ncmoe_and_needs_both_tests(fakes, tmp_path):
    out = subprocess.run([str(fakes["llama"]), "-m", "m", "-o", "json", "-ngl", "99", "-fa", "on", "-p", "256", "-n", "64",
                          "-r", "2", "-t", "16", "-ncmoe", "3"], capture_output=True, text=True, check=True).stdout
    got = runs.parse_llama(out, 3)
    assert got["prompt_tokens_per_s"] == 250.0 and got["decode_tokens_per_s"] == 25.0
    assert got["llama"]["pp"]["tokens"] == 256 and got["llama"]["tg"]["tokens"] == 64
    assert runs.parse_llama("warning: [not json]\n" + out, 3)["decode_tokens_per_s"] == 25.0
    with pytest.raises(ValueError, match="n_cpu_moe 3, expected 4"):
        runs.parse_llama(out, 4)
    with pytest.raises(ValueError, match="expected pp and tg"):
        runs.parse_llama(json.dumps(json.loads(out)[:1]), 3)


def test_parse_moelab_reads_the_json_after_text_with_braces():
    assert runs.parse_moelab('text\n{\nnot json\n{\n  "a": 1\n}\n') == {"a": 1}
    with pytest.raises(ValueError):
        runs.parse_moelab("only text\n")


def test_bench_runs_interleaved_rounds_and_compares_each_policy_with_its_peer(tiny_gguf, fakes, tmp_path, capsys):
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, "--rounds", "2") == 0
    blocks = runs.block_expert_bytes(tiny_gguf)
    n_budget, last = runs.budget_blocks(blocks, 2 * 2**20), len(blocks)
    assert (n_budget, last) == (3, 4)  # one block's experts fit 2 MiB
    llama = [f"llama {n}" for n in sorted({0, n_budget, last})]
    moelab = [f"moelab {p}" for p in runs.POLICIES]
    warmup = ["moelab hybrid"]  # unrecorded, before the first moelab run
    assert fakes["calls"].read_text().splitlines() == llama + warmup + moelab + moelab[::-1] + llama[::-1]
    res = json.loads((out / "result.json").read_text())
    assert res["complete"] and len(res["rows"]) == 2 * (len(llama) + len(moelab))
    assert res["config"]["ncmoe_budget"] == n_budget and res["config"]["prompt_tokens_moelab"] <= 256
    comp = {r["moelab"]: r for r in res["comparisons"]}
    assert comp["moelab gpu"]["peer"] == "-ncmoe 0" and comp["moelab gpu"]["ratio_decode"] == pytest.approx(5.0)
    assert comp["moelab cpu"]["peer"] == f"-ncmoe {last}"
    assert comp["moelab cpu"]["ratio_prompt"] == pytest.approx(10.0 / (1000 / (1 + last)))
    best_llama_tg = 100.0 / (1 + n_budget)  # -ncmoe N_budget beats N = all blocks
    assert comp["moelab lru"]["ratio_decode"] == pytest.approx(50.0 / best_llama_tg)
    best = comp["moelab best at budget"]
    assert best["decode_tokens_per_s"] == 70.0 and best["moelab_cells"]["decode_tokens_per_s"] == "moelab hybrid-cost"
    assert best["peer"] == "best of -ncmoe 3, -ncmoe 4" and best["peer_cells"]["decode_tokens_per_s"] == "llama.cpp -ncmoe 3"
    assert comp["moelab lru"]["expert_bytes_vram"] == 2**20  # the fake's cache_mib: budget - 1
    assert comp["moelab gpu"]["expert_bytes_vram"] == sum(blocks)
    recorded = [r["cell"] for r in res["rows"] if "--record-trace" in r["command"]]  # the routing, for simulate.peer
    assert recorded and set(recorded) == {"moelab gpu"}
    assert str(out / "trace") in next(r["command"] for r in res["rows"] if r["cell"] == "moelab gpu")
    readme = (out / "README.md").read_text()
    assert "| -ncmoe 0 |" in readme and "| best at budget (hybrid-cost / hybrid-cost) |" in readme
    assert "Incomplete" not in readme and "(build abc1234)" in readme
    # each policy's row: prompt and decode tokens/s, first token, its peer's pp / tg, both ratios
    assert "| lru | 1 | 100.0 | 50.0 | 0.500 | best of -ncmoe 3, -ncmoe 4 | 250.0 / 25.0 | 0.400 | 2.000 |" in readme
    assert (out / "result.png").stat().st_size > 0
    assert "moelab / llama.cpp" in capsys.readouterr().out


def test_graph_cpu_adds_policy_rows_run_with_the_flag_beside_the_default_rows(tiny_gguf, fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_GRAPH_CPU_STREAM", "1")  # a switch of the runs: recorded with them
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, "--rounds", "1", "--policies", "lru,hybrid",
                  "--graph-cpu", "hybrid,lru") == 0
    llama = [f"llama {n}" for n in (0, 3, 4)]
    moelab = ["moelab lru", "moelab hybrid", "moelab hybrid+cpugraph", "moelab lru+cpugraph"]
    warmup = ["moelab hybrid", "moelab hybrid+cpugraph"]  # the CPU graph's kernels warmed up too
    assert fakes["calls"].read_text().splitlines() == llama + warmup + moelab
    res = json.loads((out / "result.json").read_text())
    assert res["config"]["graph_cpu"] == ["hybrid", "lru"] and res["config"]["moelab_env"]["MOELAB_GRAPH_CPU_STREAM"] == "1"
    for r in res["rows"]:
        assert ("--graph-cpu" in r["command"]) == r["cell"].endswith("+cpugraph"), r["cell"]
        assert "--record-trace" not in r["command"]
    comp = {r["moelab"]: r for r in res["comparisons"]}
    assert comp["moelab hybrid+cpugraph"]["decode_tokens_per_s"] == 90.0
    assert comp["moelab hybrid+cpugraph"]["peer"] == comp["moelab hybrid"]["peer"] == "best of -ncmoe 3, -ncmoe 4"
    assert comp["moelab best at budget"]["decode_tokens_per_s"] == 60.0  # the default rows only
    best = comp["moelab best at budget+cpugraph"]
    assert best["decode_tokens_per_s"] == 90.0 and best["ratio_decode"] == pytest.approx(90.0 / 25.0)
    assert comp["moelab lru+cpugraph"]["expert_bytes_vram"] == 2**20
    readme = (out / "README.md").read_text()
    assert "| hybrid+cpugraph | 1 |" in readme and "| best at budget+cpugraph (hybrid / hybrid) |" in readme
    assert "with `MOELAB_GRAPH_CPU_STREAM=1`" in readme


def test_a_failed_configuration_is_recorded_the_others_run_and_the_exit_is_nonzero(tiny_gguf, fakes, tmp_path,
                                                                                  monkeypatch, capsys):
    monkeypatch.setenv("PEER_FAIL_POLICY", "hybrid")
    monkeypatch.setenv("PEER_FAIL_NCMOE", "0")
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, "--rounds", "1") == 1
    med = json.loads((out / "result.json").read_text())["medians"]
    assert med["moelab hybrid"]["errors"] == ["exit 2: moelab: hybrid broke"] and med["moelab hybrid"]["runs"] == 0
    assert med["llama.cpp -ncmoe 0"]["errors"][0].startswith("exit 1: llama_model_load")
    assert med["moelab lru"]["runs"] == 1 and med["moelab cpu"]["runs"] == 1
    comp = {r["moelab"]: r for r in json.loads((out / "result.json").read_text())["comparisons"]}
    assert comp["moelab gpu"]["ratio_decode"] is None  # its peer failed
    assert "failed configurations" in capsys.readouterr().err
    assert "moelab: hybrid broke" in (out / "logs" / "moelab_hybrid_r0.log").read_text()


def test_bench_stops_at_the_deadline_and_the_same_command_continues(tiny_gguf, fakes, tmp_path, capsys):
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, "--rounds", "1") == 0
    calls = fakes["calls"].read_text()
    n = len(json.loads((out / "result.json").read_text())["rows"])
    # every configuration's last run took longer than the deadline: none starts, nor the warm-up
    assert _bench(tiny_gguf, fakes, out, "--rounds", "2", "--deadline-s", "1e-6") == 3
    assert fakes["calls"].read_text() == calls
    assert "Incomplete" in (out / "README.md").read_text()
    with open(out / "raw.jsonl", "a") as f:
        f.write('{"round": 1, "cell": "moelab cpu", "wall')  # a row cut short by a kill: that run is made again
    assert _bench(tiny_gguf, fakes, out, "--rounds", "2") == 0
    rows = json.loads((out / "result.json").read_text())["rows"]
    assert [r["round"] for r in rows] == [0] * n + [1] * n
    assert runs.read_rows(out / "raw.jsonl") == rows
    assert "continuing" in capsys.readouterr().out


def test_bench_refuses_another_configuration_in_the_same_out(tiny_gguf, fakes, tmp_path, capsys):
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, "--rounds", "1", "--policies", "cpu") == 0
    assert _bench(tiny_gguf, fakes, out, "--rounds", "1", "--policies", "cpu", "--tokens", "8") == 2
    assert "holds another configuration" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--policies", "gpu,fast"], "--policies fast"),
    (["--budget-mib", "0"], "--budget-mib 0"),
    (["--hardware", "/nonexistent.json"], "--hardware /nonexistent.json"),
    (["--graph-cpu", "hybrid,cpu"], "--graph-cpu cpu"),
    (["--graph-cpu", "lru,lru"], "--graph-cpu lru,lru"),
    (["--policies", "lru", "--graph-cpu", "hybrid-cost", "--hardware", "/none.json"], "--hardware /none.json"),
])
def test_bench_bad_input_is_one_line_before_any_output(tiny_gguf, fakes, tmp_path, capsys, extra, message):
    out = tmp_path / "result"
    assert _bench(tiny_gguf, fakes, out, *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists() and not fakes["calls"].exists()


def test_bench_names_a_missing_model(fakes, tmp_path, capsys):
    assert _bench(tmp_path / "none.gguf", fakes, tmp_path / "result") == 2
    assert "none.gguf: no such file" in capsys.readouterr().err


def test_prepare_skips_a_matching_build_synthesises_once_and_reports_a_failed_step(tmp_path, capsys):
    src = tmp_path / "lcpp.tgz"
    src.write_bytes(b"not used: the build is stamped")
    work = tmp_path / "work"
    (work / "build" / "bin").mkdir(parents=True)
    (work / "build" / "bin" / "llama-bench").write_text("")
    base = ["prepare", "--src", str(src), "--work", str(work), "--preset", "tiny", "--progress-s", "0.2"]
    args = peer.parser().parse_args(base)
    stamp = build.build_script(args, work)[1]
    (work / "build" / "peer_build.json").write_text(json.dumps(stamp))
    assert build.build_script(args, work) is None
    assert build.build_script(peer.parser().parse_args(base + ["--cpu-only"]), work) is not None

    moelab = f"{sys.executable} -m moelab"
    assert peer.main(base + ["--moelab", moelab]) == 0
    assert (work / "q8.gguf").is_file() and "synth" in json.loads((work / "q8.gguf.json").read_text())
    capsys.readouterr()
    assert peer.main(base + ["--moelab", moelab]) == 0
    assert "q8.gguf is complete: skipped" in capsys.readouterr().out

    failing = _script(tmp_path / "failing", "#!{python}\nimport sys\nprint('synth: out of disk', file=sys.stderr)\nsys.exit(1)\n")
    assert peer.main(base + ["--moelab", str(failing), "--model-name", "other.gguf"]) == 1
    err = capsys.readouterr().err
    assert "synth failed (exit 1)" in err and "out of disk" in err
    assert not (work / "other.gguf.json").exists()


def test_last_progress_is_the_builds_last_step_line_among_compiler_warnings(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("-- Configuring done\n[3/143] Building C object a.o\n[4/143] Building CXX object b.o\n"
                   "b.cpp:1:2: warning: unused\n  |   ^~~\n")
    assert build.last_progress(log) == "[4/143] Building CXX object b.o"
    log.write_text("[ 45%] Built target ggml\nwarning\n")
    assert build.last_progress(log) == "[ 45%] Built target ggml"
    log.write_text("synth: tensor 3/27 (blk.0.ffn_up_exps.weight), 0.10/1.51 GiB\n")
    assert build.last_progress(log).startswith("synth: tensor 3/27")
    assert build.last_progress(tmp_path / "none.log") == "(no output yet)"


def test_a_run_past_its_timeout_is_an_error_row_with_its_output_logged(tmp_path):
    slow = _script(tmp_path / "slow", "#!{python}\nimport time\nprint('loading', flush=True)\ntime.sleep(30)\n")
    args = peer.parser().parse_args(["bench", "--timeout-s", "3", "--llama-bench", str(slow), "--model", "m.gguf"])
    args.llama_bench, args.model = slow, Path("m.gguf")
    row = runs.measure(args, {"cell": "llama.cpp -ncmoe 0", "tool": "llama.cpp", "ncmoe": 0}, "", tmp_path / "x.log")
    assert row["error"] == "timed out after 3.0 s"
    assert "loading" in (tmp_path / "x.log").read_text()


@pytest.mark.parametrize("extra, message", [(["--preset", "huge"], "--preset huge"), (["--jobs", "0"], "--jobs 0"),
                                            (["--src", "/nonexistent.tgz"], "--src /nonexistent.tgz")])
def test_prepare_bad_input_is_one_line_before_any_work(tmp_path, capsys, extra, message):
    src = tmp_path / "lcpp.tgz"
    src.write_bytes(b"")
    assert peer.main(["prepare", "--src", str(src), "--work", str(tmp_path / "work"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "work").exists()
