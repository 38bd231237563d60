"""moelab's executor against llama.cpp: the same GGUF, the same GPU, measured side by side in one run.

llama.cpp's ``llama-bench -o json -ngl 99 -fa on -p 256 -n 64 -r 2 -t 16`` runs with ``-ncmoe N``
(the routed experts of the first N blocks kept on the CPU) at N = 0 (every expert in VRAM), at the
smallest N whose remaining expert bytes fit ``--budget-mib`` (from the GGUF's per-block expert
bytes), and at N = all blocks (every expert on the CPU, as ``--cpu-moe``). ``moelab run MODEL -p
PROMPT -n 64 --raw --threads 15 --json`` runs with ``--policy gpu``, ``lru``, ``hybrid`` and
``hybrid-cost`` (``--cache-mib`` = the budget; hybrid-cost with docs/fidelity/h200-calibrated.json)
and ``cpu``. The prompt is fixed text cut to at most ``--prompt-tokens`` tokens by moelab's
tokenizer on the GGUF's vocabulary (``--raw``: no chat template); llama-bench's pp256 feeds 256
random token ids. result.json records moelab's count (256 on the 32000-token synthetic vocabulary).

Each round runs every configuration once, llama.cpp's then moelab's, the order reversed on odd
rounds; one unrecorded ``-n 4`` moelab run precedes the first moelab run of each invocation
(llama-bench warms up by itself). Figures are medians over rounds of llama-bench's mean tokens/s
(over its ``-r`` repetitions) and of moelab's prompt and decode tokens/s. The comparisons, as
moelab / llama.cpp: ``gpu`` vs ``-ncmoe 0``; each budget policy, and the best of them, vs
llama.cpp's best configuration with no more expert bytes in VRAM (the max over the measured
``-ncmoe N`` with N >= the budget's N); ``cpu`` vs ``-ncmoe`` all blocks.

Stages, each within one 10-minute command on a GPU machine without network:

    python experiments/peer_llamacpp.py pack --out .peer/lcpp.tgz    # with network, once
    python experiments/peer_llamacpp.py prepare --src .peer/lcpp.tgz --work .peer
    python experiments/peer_llamacpp.py bench --work .peer --budget-mib 4096 --rounds 2 \
        --out .peer/result --deadline-s 450                          # again until it exits 0 or 1

``pack`` keeps of llama.cpp's source (vendored in the llama-cpp-python sdist) what a CUDA + CPU
build of llama-bench and llama-completion needs, LICENSE included; the sdist's name and version
are in the sidecar ``lcpp.tgz.json`` and in the tarball (``llama.cpp/PEER_SOURCE.json``).
``prepare`` builds llama.cpp and writes the synthetic Qwen3-30B-A3B-shaped Q8_0 GGUF (``moelab
model synth --preset qwen3-30b-a3b --vocab 32000 --quant Q8_0 --seed 0``) in parallel, printing
each one's progress; each is skipped when its output is there and matches (a build stamp with the
tarball's sha256; a sidecar with the synth command), so an interrupted prepare is run again as is.
``bench`` appends every run to ``OUT/raw.jsonl`` as it ends; with ``--deadline-s`` it starts no
run expected to end later (each configuration's last time), and the same command continues (a
failed run stays recorded; delete its line to run it again).
Exit status: 0 complete, 1 a configuration failed (recorded, the others still run), 2 bad input,
3 runs missing. ``all`` = prepare, then bench, for machines without a time limit.

Writes OUT/config.json, raw.jsonl, logs/, result.json (config, raw rows, medians, comparisons),
result.png and a generated README.md (config, tables, command).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout without an installed moelab
    sys.path.insert(0, str(ROOT))
SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
VENDOR = "vendor/llama.cpp/"
# Paths of llama.cpp's tree not needed to configure and build llama-bench with CUDA + CPU.
DROP = ("docs/", "models/", "media/", "benches/", "tests/", "gguf-py/", "pocs/", "conversion/", "ci/",
        "skills/", "requirements/", "app/", ".git", ".github/", ".devops/", ".gemini/", ".pi/",
        "tools/ui/", "tools/server/", "tools/cli/")
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
TARGETS = ("llama-bench", "llama-completion")
HARDWARE = ROOT / "docs" / "fidelity" / "h200-calibrated.json"
POLICIES = ("gpu", "lru", "hybrid", "hybrid-cost", "cpu")
BUDGET_POLICIES = ("lru", "hybrid", "hybrid-cost")
PROMPT_WORDS = (
    "A mixture of experts layer sends every token to a few of its many feed forward networks, "
    "chosen by a small router. Most of the weights sit in those experts, so a model that does not "
    "fit in the memory of one graphics card can still run when the experts live in host memory and "
    "only the ones a token needs are copied over the bus, or computed on the processor where they "
    "already are. Which experts to keep on the card, which to copy and which to leave on the host "
    "is a scheduling question with a budget of bytes and a clock that never stops: copies share "
    "one link, the processor has a fixed number of cores, and the card waits for whichever arrives "
    "last. A cache that keeps the most recently used experts works well when the same experts come "
    "back from one token to the next, and poorly when the router spreads its choices evenly. "
    "Splitting the work, so that some misses are copied while others run on the host at the same "
    "time, keeps both sides busy. The numbers that matter are the tokens per second of the prompt "
    "and of the answer, measured on the same machine with the same file.").split()


class Fail(Exception):
    """A user error: one line printed, exit status 2."""


# pack ---------------------------------------------------------------------------------------------

def keep(rel: str) -> bool:
    """True when llama.cpp's path ``rel`` (relative to its root) goes into the slim tarball."""
    if not rel or any(rel == d.rstrip("/") or rel.startswith(d) for d in DROP):
        return False
    parts = rel.split("/")
    if parts[0] == "examples":  # the folder is not configured (LLAMA_BUILD_EXAMPLES=OFF)
        return len(parts) == 2 and not rel.endswith("/")
    if parts[:2] == ["ggml", "src"] and len(parts) > 3 and parts[2].startswith("ggml-"):
        return parts[2] in KEEP_BACKENDS
    return True


def sdist_version(tar: tarfile.TarFile) -> tuple[str, str]:
    """(name, version) from the sdist's top-level PKG-INFO."""
    for m in tar:
        if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"):
            fields = dict(line.split(": ", 1) for line in tar.extractfile(m).read().decode().splitlines()
                          if ": " in line and not line.startswith(" "))
            return fields.get("Name", "?"), fields.get("Version", "?")
    raise Fail(f"{tar.name}: no PKG-INFO; expected a Python source distribution")


def pack(args) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise Fail(f"pack: --out {out}: directory {out.parent} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(args.sdist) if args.sdist else download_sdist(Path(tmp))
        if not sdist.is_file():
            raise Fail(f"pack: --sdist {sdist}: no such file")
        try:
            with tarfile.open(sdist, "r:gz") as src:
                name, version = sdist_version(src)
            with tarfile.open(sdist, "r:gz") as src:
                num_files, num_bytes = write_slim(src, out, {"sdist": sdist.name, "name": name, "version": version})
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise Fail(f"pack: {sdist}: {exc}") from None
    meta = {"sdist": sdist.name, "name": name, "version": version, "files": num_files,
            "source_bytes": num_bytes, "sha256": sha256(out), "tarball_bytes": out.stat().st_size}
    Path(f"{out}.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}: llama.cpp from {sdist.name} ({name} {version}), {num_files} files, "
          f"{num_bytes / 2**20:.1f} MiB unpacked, {meta['tarball_bytes'] / 2**20:.1f} MiB packed")
    return 0


def download_sdist(where: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"{SDIST}=={SDIST_VERSION}", "-d", str(where)]
    print("pack: " + shlex.join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise Fail(f"pack: pip download of {SDIST}=={SDIST_VERSION} failed; give the file with --sdist")
    found = sorted(where.glob("*.tar.gz"))
    if not found:
        raise Fail(f"pack: pip download left no .tar.gz in {where}")
    return found[0]


def write_slim(src: tarfile.TarFile, out: Path, source: dict) -> tuple[int, int]:
    """Copy the kept files of ``src``'s vendor/llama.cpp into ``out`` (under ``llama.cpp/``), plus
    ``llama.cpp/PEER_SOURCE.json``; written to a temporary name, then renamed."""
    tmp = out.with_name(out.name + ".part")
    try:
        num_files, num_bytes = _write_slim(src, tmp, source)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out)
    return num_files, num_bytes


def _write_slim(src: tarfile.TarFile, tmp: Path, source: dict) -> tuple[int, int]:
    num_files = num_bytes = 0
    has_license = False
    with open(tmp, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as dst:  # no name or time in the header: same sdist, same bytes
        for m in src:
            top, _, rest = m.name.partition("/")
            if not rest.startswith(VENDOR) or not (m.isfile() or m.isdir()):
                continue
            rel = rest[len(VENDOR):] + ("/" if m.isdir() else "")
            if not keep(rel):
                continue
            info = tarfile.TarInfo("llama.cpp/" + rel.rstrip("/"))  # fresh: no pax path of the sdist
            info.type, info.mode, info.mtime, info.size = m.type, m.mode, m.mtime, m.size
            dst.addfile(info, src.extractfile(m) if m.isfile() else None)
            if m.isfile():
                num_files, num_bytes = num_files + 1, num_bytes + m.size
                has_license |= rel == "LICENSE"
        if not num_files:
            raise Fail(f"pack: {src.name}: no {VENDOR} inside; expected the llama-cpp-python sdist")
        if not has_license:
            raise Fail(f"pack: {src.name}: {VENDOR}LICENSE missing")
        data = (json.dumps(source, indent=1) + "\n").encode()
        info = tarfile.TarInfo("llama.cpp/PEER_SOURCE.json")
        info.size = len(data)
        dst.addfile(info, io.BytesIO(data))
    return num_files, num_bytes


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# prepare -------------------------------------------------------------------------------------------

def cmake_configure(src: Path, build: Path, cuda: bool, cuda_arch: str) -> list[str]:
    cmd = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
           "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", f"-DGGML_CUDA={'ON' if cuda else 'OFF'}"]
    if cuda:
        cmd.append(f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}")
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    return cmd


def build_script(args, work: Path) -> tuple[str, dict] | None:
    """The shell command that unpacks and builds llama.cpp, and the stamp it must leave; None when
    ``work/build`` already holds llama-bench built from the same tarball and options."""
    stamp = {"src_sha256": sha256(Path(args.src)), "cuda": not args.cpu_only, "cuda_arch": args.cuda_arch,
             "targets": list(TARGETS)}
    build = work / "build"
    try:
        if (build / "bin" / "llama-bench").is_file() and json.loads((build / "peer_build.json").read_text()) == stamp:
            return None
    except (OSError, ValueError):
        pass
    src = work / "llama.cpp"
    steps = [f"rm -rf {shlex.quote(str(src))} {shlex.quote(str(build / 'peer_build.json'))}",
             f"tar -xzf {shlex.quote(str(args.src))} -C {shlex.quote(str(work))}",
             # llama.cpp names its build after the git checkout around its source: stop git at
             # the work folder, or a tarball unpacked inside moelab's checkout takes moelab's commit
             f"GIT_CEILING_DIRECTORIES={shlex.quote(str(work.resolve()))} "
             + shlex.join(cmake_configure(src, build, not args.cpu_only, args.cuda_arch)),
             shlex.join(["cmake", "--build", str(build), "-j", str(args.jobs), "--target", *TARGETS])]
    return " && ".join(steps), stamp


def synth_command(args, model: Path) -> list[str]:
    """``moelab model synth`` of the benchmark's model (``--preset tiny``: a smoke test's)."""
    vocab = ["--vocab", "32000"] if args.preset == "qwen3-30b-a3b" else []
    return [*moelab_cmd(args), "model", "synth", str(model), "--preset", args.preset, *vocab, "--quant", "Q8_0",
            "--seed", "0"]


def synth_done(model: Path, cmd: list[str]) -> bool:
    """True when ``model`` was written by ``cmd`` (sidecar) and its header and tensor table read."""
    from execute.gguf_io import GGUFError, read_model_info

    try:
        if json.loads(Path(f"{model}.json").read_text()).get("synth") != cmd[cmd.index("synth"):]:
            return False
        read_model_info(model)
    except (OSError, ValueError, GGUFError):
        return False
    return True


def prepare(args) -> int:
    work = Path(args.work)
    from execute.synth import PRESETS

    if not Path(args.src).is_file():
        raise Fail(f"prepare: --src {args.src}: no such file (make it with: pack --out {args.src})")
    if args.preset not in PRESETS:
        raise Fail(f"prepare: --preset {args.preset}: expected one of {', '.join(PRESETS)}")
    if args.jobs < 1:
        raise Fail(f"prepare: --jobs {args.jobs}, expected >= 1")
    work.mkdir(parents=True, exist_ok=True)
    model = work / args.model_name
    jobs = {}  # name: (shell command, log, stamp file written when it succeeds, its content)
    build = build_script(args, work)
    if build is None:
        print(f"prepare: {work / 'build' / 'bin' / 'llama-bench'} is built from {args.src}: skipped")
    else:
        jobs["build"] = (build[0], work / "build.log", work / "build" / "peer_build.json", build[1])
    synth = synth_command(args, model)
    if synth_done(model, synth):
        print(f"prepare: {model} is complete: skipped")
    else:
        model.unlink(missing_ok=True)
        jobs["synth"] = (shlex.join(synth), work / "synth.log", Path(f"{model}.json"),
                         {"synth": synth[synth.index("synth"):]})
    failed = run_parallel(jobs, args.progress_s)
    if failed:
        for name in failed:
            print(f"prepare: {name} failed (exit {failed[name]}); last lines of {jobs[name][1]}:", file=sys.stderr)
            print(tail(jobs[name][1], 15), file=sys.stderr)
        return 1
    print(f"prepare: ready: {work / 'build' / 'bin' / 'llama-bench'}, {model}")
    return 0


def run_parallel(jobs: dict, progress_s: float) -> dict:
    """Run each job's shell command with its output in its log, and write its stamp when it
    succeeds; print each log's last progress line every ``progress_s``; -> {name: exit status} of
    those that failed. Interrupted (SIGTERM, Ctrl-C), it stops the jobs still running, with their
    children."""
    procs = {}
    try:
        for name, (cmd, log, _, _) in jobs.items():
            print(f"prepare: {name}: {cmd}  (log: {log})", flush=True)
            with open(log, "w") as f:
                procs[name] = subprocess.Popen(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                               start_new_session=True)
        return _wait(jobs, procs, progress_s)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)


def _wait(jobs: dict, procs: dict, progress_s: float) -> dict:
    t0, failed, running = time.monotonic(), {}, dict(procs)
    next_print = t0 + progress_s
    while running:
        time.sleep(min(progress_s, 0.5))
        for name, p in list(running.items()):
            if p.poll() is not None:
                del running[name]
                if p.returncode:
                    failed[name] = p.returncode
                else:
                    _, _, stamp, content = jobs[name]
                    stamp.write_text(json.dumps(content, indent=1) + "\n")
                print(f"prepare: {name} {'failed' if p.returncode else 'done'} after "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
        if running and time.monotonic() >= next_print:
            next_print += progress_s
            for name in running:
                print(f"prepare: {time.monotonic() - t0:4.0f} s {name}: {last_progress(jobs[name][1])}", flush=True)
    return failed


def last_progress(log: Path) -> str:
    """The last ``[n/m]`` (ninja) or ``[ nn%]`` (make) line of a build log, else its last line
    (synth's progress)."""
    lines = [l.strip() for l in tail(log, 1000).replace("\r", "\n").splitlines() if l.strip()]
    marked = [l for l in lines if re.match(r"\[\s*\d+(/\d+|%)\]", l)]
    return (marked or lines or ["(no output yet)"])[-1][:120]


def tail(path: Path, num_lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, 2) - 16384, 0))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


# bench ---------------------------------------------------------------------------------------------

def moelab_cmd(args) -> list[str]:
    """``--moelab``, else the moelab script beside this Python, else ``python -m moelab``."""
    if args.moelab:
        return shlex.split(args.moelab)
    exe = Path(sys.executable).with_name("moelab")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "moelab"]


def child_env() -> dict:
    """This environment with the checkout on PYTHONPATH, so that ``python -m moelab`` runs."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def block_expert_bytes(model: Path) -> list[int]:
    """Routed-expert bytes of every block of the GGUF (0 for dense blocks)."""
    from execute.gguf_io import read_model_info

    info = read_model_info(model)
    return [n * b for n, b in zip(info.num_experts, info.expert_bytes)]


def budget_blocks(blocks: list[int], budget_bytes: int) -> int:
    """The smallest N such that the expert bytes of blocks N.. (left in VRAM by ``-ncmoe N``) fit."""
    for n in range(len(blocks) + 1):
        if sum(blocks[n:]) <= budget_bytes:
            return n
    return len(blocks)


def fit_prompt(tokenizer, max_tokens: int) -> tuple[str, int]:
    """The longest prefix of PROMPT_WORDS (repeated as needed) that encodes to at most
    ``max_tokens`` tokens, and its token count."""
    best = ("", 0)
    lo, hi = 1, len(PROMPT_WORDS) * (max_tokens // 8 + 2)
    while lo <= hi:  # token counts grow with the number of words
        mid = (lo + hi) // 2
        text = " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(mid))
        n = len(tokenizer.encode(text))
        if n <= max_tokens:
            best, lo = (text, n), mid + 1
        else:
            hi = mid - 1
    if not best[1]:
        raise Fail(f"bench: no prefix of the prompt fits {max_tokens} tokens")
    return best


def cells(args, blocks: list[int], n_budget: int) -> list[dict]:
    """Every configuration of one round: llama-bench's -ncmoe values, then moelab's policies."""
    out = []
    for n in sorted({0, n_budget, len(blocks)}):
        out.append({"cell": f"llama.cpp -ncmoe {n}", "tool": "llama.cpp", "ncmoe": n,
                    "expert_bytes_vram": sum(blocks[n:])})
    for policy in args.policies:
        extra = ["--policy", policy]
        if policy in BUDGET_POLICIES:
            extra += ["--cache-mib", str(args.budget_mib)]
        if policy == "hybrid-cost":
            extra += ["--hardware", str(args.hardware)]
        vram = sum(blocks) if policy == "gpu" else 0 if policy == "cpu" else args.budget_mib * 2**20
        out.append({"cell": f"moelab {policy}", "tool": "moelab", "policy": policy, "extra": extra,
                    "expert_bytes_vram": vram})
    return out


def llama_command(args, cell: dict) -> list[str]:
    return [str(args.llama_bench), "-m", str(args.model), "-o", "json", "-ngl", "99", "-fa", "on",
            "-p", str(args.prompt_tokens), "-n", str(args.tokens), "-r", str(args.repetitions),
            "-t", str(args.llama_threads), "-ncmoe", str(cell["ncmoe"])]


def moelab_command(args, cell: dict, prompt: str) -> list[str]:
    return [*moelab_cmd(args), "run", str(args.model), "-p", prompt, "-n", str(args.tokens), "--raw",
            "--threads", str(args.threads), *cell["extra"], "--json"]


def parse_llama(stdout: str, ncmoe: int) -> dict:
    """pp and tg tokens/s of one llama-bench ``-o json`` run at ``-ncmoe ncmoe`` (its array starts
    with a line holding ``[``; anything printed before it is skipped)."""
    lines = stdout.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == "["), 0)
    rows = json.loads("".join(lines[start:]))
    got = {}
    for r in rows:
        if r.get("n_cpu_moe") != ncmoe:
            raise ValueError(f"llama-bench reported n_cpu_moe {r.get('n_cpu_moe')}, expected {ncmoe}")
        kind = "pp" if r["n_prompt"] and not r["n_gen"] else "tg" if r["n_gen"] and not r["n_prompt"] else None
        if kind:
            got[kind] = {"tokens": r[f"n_{'prompt' if kind == 'pp' else 'gen'}"], "avg_ts": r["avg_ts"],
                         "stddev_ts": r["stddev_ts"], "samples_ts": r.get("samples_ts", [])}
    if set(got) != {"pp", "tg"}:
        raise ValueError(f"llama-bench output has {sorted(got)} tests, expected pp and tg")
    return {"prompt_tokens_per_s": got["pp"]["avg_ts"], "decode_tokens_per_s": got["tg"]["avg_ts"], "llama": got,
            "build_commit": rows[0].get("build_commit")}


def parse_moelab(stdout: str) -> dict:
    """The JSON object ``moelab run --json`` prints after the generated text."""
    lines = stdout.splitlines(keepends=True)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].rstrip("\n") == "{":
            try:
                return json.loads("".join(lines[i:]))
            except ValueError:
                continue
    raise ValueError("no JSON object at the end of moelab run's output")


MOELAB_FIELDS = ("prompt_tokens", "prompt_tokens_per_s", "decode_tokens", "decode_tokens_per_s", "generated",
                 "stopped_at_eos", "cache_mib", "hit_rate", "uploads", "upload_mib", "first_token_s")


def measure(args, cell: dict, prompt: str, log: Path) -> dict:
    """One run of ``cell``: a row with its figures, or with ``error``."""
    cmd = llama_command(args, cell) if cell["tool"] == "llama.cpp" else moelab_command(args, cell, prompt)
    row = {"cell": cell["cell"], "command": cmd}
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=child_env())
    except subprocess.TimeoutExpired as exc:  # its output arrives as bytes, text=True or not
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (exc.stdout, exc.stderr))
        log.write_text(f"$ {shlex.join(cmd)}\n{out}\n--- stderr\n{err}")
        return {**row, "wall_s": time.monotonic() - t0, "error": f"timed out after {args.timeout_s} s"}
    except OSError as exc:
        return {**row, "wall_s": time.monotonic() - t0, "error": str(exc)}
    row["wall_s"] = time.monotonic() - t0
    log.write_text(f"$ {shlex.join(cmd)}\n{p.stdout}\n--- stderr\n{p.stderr}")
    if p.returncode:
        last = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {**row, "error": f"exit {p.returncode}: {last[:200]}"}
    try:
        if cell["tool"] == "llama.cpp":
            return {**row, **parse_llama(p.stdout, cell["ncmoe"])}
        out = parse_moelab(p.stdout)
        return {**row, **{k: out[k] for k in MOELAB_FIELDS if k in out}}
    except (ValueError, KeyError, TypeError) as exc:
        return {**row, "error": f"unreadable output: {exc}"}


def round_order(round_cells: list[dict], r: int) -> list[dict]:
    """Round r's order: llama.cpp then moelab on even rounds, reversed on odd ones."""
    return round_cells if r % 2 == 0 else round_cells[::-1]


def run_rounds(args, round_cells: list[dict], prompt: str, out: Path, done: list[dict]) -> bool:
    """Measure every (round, cell) not in ``done``, appending rows to raw.jsonl; -> True when
    every cell was measured (False: stopped by the deadline)."""
    t0 = time.monotonic()
    have = {(d["round"], d["cell"]) for d in done}
    walls = {d["cell"]: d["wall_s"] for d in done}
    (out / "logs").mkdir(exist_ok=True)
    raw = out / "raw.jsonl"
    if raw.is_file() and not raw.read_bytes().endswith(b"\n") and raw.stat().st_size:
        with open(raw, "a") as f:  # after a line cut short by a kill
            f.write("\n")
    total = args.rounds * len(round_cells)
    warm = not args.warmup
    for r in range(args.rounds):
        for cell in round_order(round_cells, r):
            if (r, cell["cell"]) in have:
                continue
            expected = walls.get(cell["cell"], statistics.median(walls.values()) if walls else 0.0)
            if cell["tool"] == "moelab" and not warm:
                expected *= 2  # the warm-up takes about as long
            if args.deadline_s and time.monotonic() - t0 + expected > args.deadline_s:
                print(f"bench: deadline: {cell['cell']} (round {r}) would end after {args.deadline_s:.0f} s; "
                      "stopping here; run the same command again to continue", flush=True)
                return False
            if cell["tool"] == "moelab" and not warm:
                warmup(args, round_cells, prompt, out / "logs" / "warmup.log")
                warm = True
            slug = cell["cell"].replace(" ", "_").replace("-", "")
            row = {"round": r, **measure(args, cell, prompt, out / "logs" / f"{slug}_r{r}.log")}
            with open(raw, "a") as f:
                f.write(json.dumps(row) + "\n")
            done.append(row)
            walls[cell["cell"]] = row["wall_s"]
            what = row.get("error") or (f"{row['prompt_tokens_per_s']:.1f} / {row['decode_tokens_per_s']:.1f} tokens/s")
            print(f"bench: [{len(done)}/{total}] round {r} {cell['cell']}: {what} ({row['wall_s']:.0f} s)", flush=True)
    return True


def warmup(args, round_cells: list[dict], prompt: str, log: Path) -> None:
    """One unrecorded moelab run (``-n 4``, hybrid's options when hybrid is measured) before this
    invocation's first moelab run: kernel compilation and caches are not charged to round 0."""
    names = [c for c in round_cells if c["tool"] == "moelab"]
    cell = next((c for c in names if c["policy"] == "hybrid"), names[0])
    row = measure(argparse.Namespace(**{**vars(args), "tokens": 4}), cell, prompt, log)
    print(f"bench: warm-up {cell['cell']} -n 4: {row.get('error', 'done')} ({row['wall_s']:.0f} s, not recorded)",
          flush=True)


def medians(round_cells: list[dict], rows: list[dict]) -> dict:
    """Per cell: median prompt and decode tokens/s over its successful rounds, errors, extras."""
    out = {}
    for cell in round_cells:
        mine = [r for r in rows if r["cell"] == cell["cell"]]
        ok = [r for r in mine if "error" not in r]
        m = {"expert_bytes_vram": cell["expert_bytes_vram"], "runs": len(ok),
             "errors": [r["error"] for r in mine if "error" in r]}
        for k in ("prompt_tokens_per_s", "decode_tokens_per_s", "first_token_s", "prompt_tokens", "decode_tokens",
                  "cache_mib"):
            vals = [r[k] for r in ok if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
            if vals:
                m[k] = statistics.median(vals)
                if k.endswith("_per_s") and len(vals) > 1:
                    m[k.replace("tokens_per_s", "spread")] = (max(vals) - min(vals)) / m[k] if m[k] else 0.0
        if cell["tool"] == "moelab" and "cache_mib" in m and cell.get("policy") in BUDGET_POLICIES:
            m["expert_bytes_vram"] = int(m["cache_mib"] * 2**20)
        out[cell["cell"]] = m
    return out


SPEEDS = ("prompt_tokens_per_s", "decode_tokens_per_s")


def best_of(med: dict, names: list[str], key: str) -> tuple[float | None, str | None]:
    """The highest median ``key`` among the cells ``names``, and that cell."""
    vals = [(med[n][key], n) for n in names if key in med.get(n, {})]
    return max(vals) if vals else (None, None)


def comparisons(policies: list[str], med: dict, num_blocks: int, n_budget: int) -> list[dict]:
    """Each moelab policy (and the best budget policy) against its llama.cpp peer: gpu vs -ncmoe 0,
    cpu vs -ncmoe all blocks, a budget policy vs the best -ncmoe N >= the budget's N (no more
    expert bytes in VRAM), prompt and decode each on its own; ratios moelab / llama.cpp."""
    def llama(n):
        return f"llama.cpp -ncmoe {n}"

    peers = {"gpu": [llama(0)], "cpu": [llama(num_blocks)]}
    lower = [llama(n) for n in sorted({n_budget, num_blocks})]
    at_budget = [f"moelab {p}" for p in policies if p in BUDGET_POLICIES]
    subjects = [(f"moelab {p}", [f"moelab {p}"]) for p in policies]
    subjects += [("moelab best at budget", at_budget)] if at_budget else []
    rows = []
    for label, mine in subjects:
        theirs = peers.get(label.removeprefix("moelab "), lower)
        row = {"moelab": label, "peer": theirs[0].removeprefix("llama.cpp ") if len(theirs) == 1 else
               "best of " + ", ".join(n.removeprefix("llama.cpp ") for n in theirs),
               "expert_bytes_vram": max(med.get(c, {}).get("expert_bytes_vram", 0) for c in mine),
               "peer_expert_bytes_vram": max(med.get(c, {}).get("expert_bytes_vram", 0) for c in theirs),
               "first_token_s": med.get(mine[0], {}).get("first_token_s") if len(mine) == 1 else None,
               "moelab_cells": {}, "peer_cells": {}}
        for key in SPEEDS:
            (me, my_cell), (peer, peer_cell) = best_of(med, mine, key), best_of(med, theirs, key)
            row[key], row[f"peer_{key}"] = me, peer
            row["moelab_cells"][key], row["peer_cells"][key] = my_cell, peer_cell
            row[f"ratio_{key.split('_')[0]}"] = me / peer if me and peer else None
        rows.append(row)
    return rows


def label(row: dict) -> str:
    """The table's name of a comparison row (the best-at-budget row says which policy won)."""
    name = row["moelab"].removeprefix("moelab ")
    if name != "best at budget":
        return name
    won = [(c or "-").removeprefix("moelab ") for c in row["moelab_cells"].values()]
    return f"{name} ({won[0]} / {won[1]})"


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def tables(med: dict, comp: list[dict], round_cells: list[dict]) -> str:
    """The llama.cpp table (one row per -ncmoe) and the moelab table (each policy vs its peer)."""
    lines = ["| llama.cpp | expert MiB in VRAM | pp tokens/s | tg tokens/s | runs | errors |",
             "|---|---:|---:|---:|---:|---|"]
    for c in (c for c in round_cells if c["tool"] == "llama.cpp"):
        m = med[c["cell"]]
        lines.append(f"| -ncmoe {c['ncmoe']} | {m['expert_bytes_vram'] / 2**20:,.0f} | "
                     f"{fmt(m.get('prompt_tokens_per_s'))} | {fmt(m.get('decode_tokens_per_s'))} | {m['runs']} | "
                     f"{'; '.join(m['errors'])} |")
    lines += ["", "| moelab | expert MiB in VRAM | prompt tokens/s | decode tokens/s | first token s | "
              "llama.cpp peer | peer pp / tg | moelab / llama.cpp prompt | decode |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in comp:
        lines.append(f"| {label(r)} | {r['expert_bytes_vram'] / 2**20:,.0f} | {fmt(r['prompt_tokens_per_s'])} | "
                     f"{fmt(r['decode_tokens_per_s'])} | {fmt(r['first_token_s'], '.3f')} | {r['peer']} | "
                     f"{fmt(r['peer_prompt_tokens_per_s'])} / {fmt(r['peer_decode_tokens_per_s'])} | "
                     f"{fmt(r['ratio_prompt'], '.3f')} | {fmt(r['ratio_decode'], '.3f')} |")
    errs = [f"- {name}: {'; '.join(m['errors'])}" for name, m in med.items()
            if m["errors"] and name.startswith("moelab")]
    return "\n".join(lines + (["", "moelab errors:", *errs] if errs else [])) + "\n"


def plot(comp: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [r["moelab"].removeprefix("moelab ") for r in comp]
    x = range(len(comp))
    for ax, key, title in ((axes[0], "prompt_tokens_per_s", "prompt (pp) tokens/s"),
                           (axes[1], "decode_tokens_per_s", "decode (tg) tokens/s")):
        theirs, mine = [r[f"peer_{key}"] or 0 for r in comp], [r[key] or 0 for r in comp]
        for dx, vals, name in ((-0.2, theirs, "llama.cpp (peer)"), (0.2, mine, "moelab")):
            bars = ax.bar([i + dx for i in x], vals, 0.4, label=name)
            ax.bar_label(bars, [f"{v:.3g}" if v else "-" for v in vals], fontsize=7)
        ax.set_xticks(list(x), labels, rotation=20)
        ax.set_yscale("log")
        ax.set_ylim(bottom=min([v for v in theirs + mine if v] or [1]) / 3)  # every bar starts below the smallest
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_config(args, blocks: list[int], n_budget: int, prompt_tokens: int) -> dict:
    return {"model": str(args.model), "model_bytes": Path(args.model).stat().st_size, "num_blocks": len(blocks),
            "block_expert_bytes": blocks, "budget_mib": args.budget_mib, "ncmoe_budget": n_budget,
            "rounds": args.rounds, "repetitions": args.repetitions, "prompt_tokens_llama": args.prompt_tokens,
            "prompt_tokens_moelab": prompt_tokens, "tokens": args.tokens, "llama_threads": args.llama_threads,
            "threads": args.threads, "policies": list(args.policies), "hardware": str(args.hardware),
            "warmup": args.warmup,
            "llama_bench": str(args.llama_bench), "timeout_s": args.timeout_s,
            "llama_source": llama_source(Path(args.llama_bench)), "moelab_commit": moelab_commit()}


def moelab_commit() -> str | None:
    """The checkout's commit, when it is a git checkout, with ``+changes`` when the tracked files
    differ from it (a copied working tree whose .git is older than its files says so)."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if p.returncode != 0 or not p.stdout.strip():
            return None
        d = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--"], capture_output=True)
    except OSError:
        return None
    return p.stdout.strip() + ("+changes" if d.returncode == 1 else "")


def llama_source(llama_bench: Path) -> dict | None:
    """The sdist the llama-bench was built from (PEER_SOURCE.json beside its build folder)."""
    try:
        return json.loads((llama_bench.parents[2] / "llama.cpp" / "PEER_SOURCE.json").read_text())
    except (OSError, ValueError, IndexError):
        return None


def check_bench_args(args) -> None:
    args.work = Path(args.work)
    args.model = Path(args.model or args.work / "q8.gguf")
    args.llama_bench = Path(args.llama_bench or args.work / "build" / "bin" / "llama-bench")
    args.policies = [p for p in args.policies.split(",") if p]
    for name in ("budget_mib", "rounds", "repetitions", "tokens", "prompt_tokens", "threads", "llama_threads"):
        if getattr(args, name) < 1:
            raise Fail(f"bench: --{name.replace('_', '-')} {getattr(args, name)}, expected >= 1")
    if args.timeout_s <= 0:
        raise Fail(f"bench: --timeout-s {args.timeout_s}, expected > 0")
    bad = [p for p in args.policies if p not in POLICIES]
    if bad or not args.policies:
        raise Fail(f"bench: --policies {','.join(bad) or '(empty)'}: expected some of {','.join(POLICIES)}")
    if not args.model.is_file():
        raise Fail(f"bench: model {args.model}: no such file (run prepare first)")
    if not (args.llama_bench.is_file() and os.access(args.llama_bench, os.X_OK)):
        raise Fail(f"bench: {args.llama_bench}: no llama-bench executable there (run prepare first)")
    exe = moelab_cmd(args)[0]
    if not shutil.which(exe):
        raise Fail(f"bench: --moelab {exe}: not an executable")
    if "hybrid-cost" in args.policies and not Path(args.hardware).is_file():
        raise Fail(f"bench: --hardware {args.hardware}: no such file (needed by --policy hybrid-cost)")


def read_rows(path: Path) -> list[dict]:
    """The rows of raw.jsonl; a line cut short by a kill is dropped (that run is made again)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def bench(args) -> int:
    from execute.gguf_io import GGUFError
    from execute.tokenizer import Tokenizer, TokenizerError

    check_bench_args(args)
    try:
        blocks = block_expert_bytes(args.model)
        prompt, prompt_tokens = fit_prompt(Tokenizer.from_gguf(args.model), args.prompt_tokens)
    except (GGUFError, TokenizerError) as exc:
        raise Fail(f"bench: {exc}") from None
    if not any(blocks):
        raise Fail(f"bench: {args.model}: no routed experts")
    n_budget = budget_blocks(blocks, args.budget_mib * 2**20)
    config = bench_config(args, blocks, n_budget, prompt_tokens)
    out = Path(args.out)
    done = []
    if (out / "config.json").is_file():
        if {**json.loads((out / "config.json").read_text()), "rounds": args.rounds} != config:
            raise Fail(f"bench: {out / 'config.json'} holds another configuration; give a new --out or remove {out}")
        done = read_rows(out / "raw.jsonl")
        print(f"bench: continuing {out}: {len(done)} runs already recorded")
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")  # --rounds may grow
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    round_cells = cells(args, blocks, n_budget)
    print(f"bench: {args.model}: {len(blocks)} blocks, {sum(blocks) / 2**30:.2f} GiB of experts; budget "
          f"{args.budget_mib} MiB -> -ncmoe {n_budget} ({sum(blocks[n_budget:]) / 2**20:,.0f} MiB in VRAM); "
          f"prompt {prompt_tokens} tokens (llama-bench pp{args.prompt_tokens}); "
          f"{args.rounds} rounds x {len(round_cells)} configurations", flush=True)
    complete = run_rounds(args, round_cells, prompt, out, done)
    med = medians(round_cells, done)
    comp = comparisons(args.policies, med, len(blocks), n_budget)
    table = tables(med, comp, round_cells)
    result = {"config": config, "prompt": prompt, "complete": complete, "rows": done, "medians": med,
              "comparisons": comp}
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(comp, out / "result.png")
    (out / "README.md").write_text(readme(args, config, done, table, complete))
    print(table)
    failed = [name for name, m in med.items() if m["errors"]]
    if not complete:
        print(f"bench: incomplete ({len(done)} of {args.rounds * len(round_cells)} runs); run the same command again")
        return 3
    if failed:
        print(f"bench: failed configurations: {', '.join(failed)} (logs in {out / 'logs'})", file=sys.stderr)
        return 1
    return 0


def readme(args, config: dict, rows: list[dict], table: str, complete: bool) -> str:
    cmd = "python experiments/peer_llamacpp.py " + shlex.join(args.argv)
    src = config["llama_source"] or {}
    builds = sorted({r["build_commit"] for r in rows if r.get("build_commit")})
    return (f"# moelab vs llama.cpp (generated by experiments/peer_llamacpp.py)\n\n"
            f"{'' if complete else '**Incomplete: some runs are missing; run the command again.**' + chr(10) + chr(10)}"
            f"Model `{config['model']}` ({config['model_bytes'] / 2**30:.2f} GiB, {config['num_blocks']} blocks, "
            f"{sum(config['block_expert_bytes']) / 2**30:.2f} GiB of experts); llama.cpp from "
            f"{src.get('sdist', 'an unknown source')} (build {', '.join(builds) or '?'}), moelab at "
            f"{config['moelab_commit'] or '?'}; budget {config['budget_mib']} MiB = `-ncmoe "
            f"{config['ncmoe_budget']}`; prompt {config['prompt_tokens_moelab']} tokens for moelab "
            f"(pp{config['prompt_tokens_llama']} for llama-bench), {config['tokens']} generated; "
            f"llama-bench `-t {config['llama_threads']} -r {config['repetitions']}`, moelab `--threads "
            f"{config['threads']}`; medians of {config['rounds']} interleaved rounds. Ratios: moelab / llama.cpp.\n\n"
            f"{table}\n![result](result.png)\n\n```\n{cmd}\n```\n")


# command line --------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    pk = sub.add_parser("pack", help="slim llama.cpp source tarball from the llama-cpp-python sdist")
    pk.add_argument("--out", default=".peer/lcpp.tgz")
    pk.add_argument("--sdist", help=f"the {SDIST} sdist (.tar.gz); default: pip download {SDIST}=={SDIST_VERSION}")
    for name in ("prepare", "bench", "all"):
        s = sub.add_parser(name)
        s.add_argument("--work", default=".peer")
        s.add_argument("--moelab", help="moelab command (default: moelab beside this Python)")
        if name in ("prepare", "all"):
            s.add_argument("--src", default=".peer/lcpp.tgz")
            s.add_argument("--jobs", type=int, default=max(len(os.sched_getaffinity(0)) - 1, 1),
                           help="build jobs (default: the cores this process may use, less one for synth)")
            s.add_argument("--cpu-only", action="store_true", help="build llama.cpp without CUDA")
            s.add_argument("--cuda-arch", default="90")
            s.add_argument("--preset", default="qwen3-30b-a3b", help="moelab model synth preset (tiny: a smoke test)")
            s.add_argument("--model-name", default="q8.gguf")
            s.add_argument("--progress-s", type=float, default=20.0)
        if name in ("bench", "all"):
            s.add_argument("--model", help="GGUF (default: WORK/q8.gguf)")
            s.add_argument("--llama-bench", help="default: WORK/build/bin/llama-bench")
            s.add_argument("--budget-mib", type=int, default=4096)
            s.add_argument("--rounds", type=int, default=2)
            s.add_argument("--repetitions", type=int, default=2, help="llama-bench -r")
            s.add_argument("--prompt-tokens", type=int, default=256)
            s.add_argument("--tokens", type=int, default=64)
            s.add_argument("--threads", type=int, default=15, help="moelab run --threads")
            s.add_argument("--llama-threads", type=int, default=16, help="llama-bench -t")
            s.add_argument("--policies", default=",".join(POLICIES))
            s.add_argument("--hardware", default=str(HARDWARE))
            s.add_argument("--timeout-s", type=float, default=300.0, help="per llama-bench / moelab run")
            s.add_argument("--deadline-s", type=float, default=0.0,
                           help="start no run that would end later than this after the start (0: none)")
            s.add_argument("--no-warmup", dest="warmup", action="store_false",
                           help="no unrecorded moelab run before the first measured one")
            s.add_argument("--out", default=".peer/result")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        if args.stage == "pack":
            return pack(args)
        if args.stage == "prepare":
            return prepare(args)
        if args.stage == "bench":
            return bench(args)
        if args.stage == "all" and args.model is None:
            args.model = str(Path(args.work) / args.model_name)
        return prepare(args) or bench(args)
    except Fail as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a time limit: clean up, then exit
    sys.exit(main())
