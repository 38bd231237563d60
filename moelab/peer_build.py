"""The peer benchmark's llama.cpp and model: ``pack`` (a slim llama.cpp source tarball from the
llama-cpp-python sdist, reproducible byte for byte) and ``prepare`` (build llama-bench and write
the synthetic GGUF in parallel, each skipped when its stamped output is already there); also the
subprocess helpers the benchmark's runs share (the moelab command, the child environment).

Run by ``experiments/peer_llamacpp.py``; ``Fail`` is a user error (one line, exit status 2).
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

__all__ = ["Fail", "ROOT", "keep", "pack", "prepare", "build_script", "synth_command", "synth_done",
           "run_parallel", "last_progress", "tail", "sha256", "moelab_cmd", "child_env"]

ROOT = Path(__file__).resolve().parents[1]  # the checkout moelab runs from
SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
VENDOR = "vendor/llama.cpp/"
# Paths of llama.cpp's tree not needed to configure and build llama-bench with CUDA + CPU.
DROP = ("docs/", "models/", "media/", "benches/", "tests/", "gguf-py/", "pocs/", "conversion/", "ci/",
        "skills/", "requirements/", "app/", ".git", ".github/", ".devops/", ".gemini/", ".pi/",
        "tools/ui/", "tools/server/", "tools/cli/")
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda")
TARGETS = ("llama-bench", "llama-completion")


class Fail(Exception):
    """A user error: one line printed, exit status 2."""


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
