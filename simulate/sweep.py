"""Sweeps: many SimConfigs, in parallel, appended to a CSV one row per config, resumable.

A row holds the config's fields, a ``key`` naming the config, and the result summary. On start
the CSV is read, any torn last line dropped (the file is rewritten atomically), and configs whose
key is present are skipped. Each finished row is appended with one write and a flush, so an
interrupted sweep keeps every row it finished.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterable, Sequence

from scheduler.files import atomic_open, file_mode

from .run import SimConfig, SimError, run

__all__ = ["expand", "config_key", "run_row", "Sweep", "RESULT_FIELDS", "plot_results", "locked", "SweepBusy",
           "LOCK_NAME"]

LOCK_NAME = ".sweep.lock"  # held by the sweep writing into its output directory

RESULT_FIELDS = ("tokens_simulated", "tokens_per_s", "bound_tokens_per_s", "hit_rate", "upload_bytes", "hits", "uploads",
                 "streams", "cpu_experts", "fills", "swaps", "p50_token_s", "p99_token_s", "gpu_busy", "pcie_busy",
                 "cpu_busy", "simulated_s", "slots_per_layer", "cache_mib_used", "error")
CONFIG_FIELDS = tuple(f.name for f in fields(SimConfig))
COLUMNS = ("key",) + CONFIG_FIELDS + RESULT_FIELDS
assert len(set(COLUMNS)) == len(COLUMNS), "a result field shadows a config field"


def expand(models: Sequence[str], hardware: Sequence[str], policies: Sequence[str],
           caches: Sequence[float], miss_fractions: Sequence[float | None], cache_unit: str = "mib",
           **common) -> list[SimConfig]:
    """Cartesian product of the axes; miss fractions apply to ``hybrid`` only (others get one row)."""
    out = []
    for m in models:
        for h in hardware:
            for p in policies:
                for c in caches:
                    size = {"cache_slots": int(c), "cache_mib": None} if cache_unit == "slots" else {"cache_mib": float(c)}
                    for f in (miss_fractions if p == "hybrid" else [None]):
                        out.append(SimConfig(model=m, hardware=h, policy=p, miss_fraction=f, **size, **common))
    return list(dict.fromkeys(out))


def config_key(cfg: SimConfig) -> str:
    """A stable name for a config (hash of its fields)."""
    blob = json.dumps(asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_row(cfg: SimConfig) -> dict:
    """Simulate one config and return its CSV row; a config that cannot run gets ``error`` set."""
    row = {"key": config_key(cfg), **cfg.as_row()}
    try:
        result, info = run(cfg)
    except (SimError, ValueError) as e:
        row.update({f: "" for f in RESULT_FIELDS})
        row["error"] = str(e).replace("\n", " ")
        return row
    s = result.summary()
    s["tokens_simulated"] = s["tokens"]
    row.update({f: s.get(f, "") for f in RESULT_FIELDS})
    row.update(slots_per_layer=info["slots_per_layer"], cache_mib_used=round(info["cache_mib"], 3), error="")
    return row


def _format(row: dict) -> str:
    buf = io.StringIO()
    csv.DictWriter(buf, COLUMNS, lineterminator="\n").writerow(row)
    return buf.getvalue()


class Sweep:
    """A CSV of finished configs; ``run(configs)`` runs the missing ones and appends them."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.rows: list[dict] = self._load()

    def _load(self) -> list[dict]:
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.splitlines(keepends=True)
        complete = [ln for ln in lines if ln.endswith("\n")]
        if not complete:
            return []
        header = next(csv.reader([complete[0]]))
        if tuple(header) != COLUMNS:
            raise ValueError(f"{self.path}: header {header[:4]}... is not a moelab sweep CSV of this version "
                             f"(expected columns {list(COLUMNS[:4])}...); use another --out")
        rows = [r for r in csv.DictReader(complete) if r.get("key") and r.get(COLUMNS[-1]) is not None]
        if len(complete) != len(lines) or len(rows) != len(complete) - 1:
            self._rewrite(rows)  # drop a torn last line
        return rows

    def _rewrite(self, rows: list[dict]) -> None:
        with atomic_open(self.path, "w") as f:
            f.write(",".join(COLUMNS) + "\n")
            for r in rows:
                f.write(_format(r))

    def done(self) -> set[str]:
        return {r["key"] for r in self.rows}

    def run(self, configs: Iterable[SimConfig], jobs: int = 1, dask_address: str | None = None,
            progress: bool = True) -> int:
        """Run the configs not yet in the CSV; returns how many ran."""
        todo = [c for c in configs if config_key(c) not in self.done()]
        if not todo:
            return 0
        rows = _execute(todo, jobs, dask_address)  # connects to Dask (or fails) before the CSV is made
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._rewrite([])
        from tqdm import tqdm

        try:
            with open(self.path, "a") as f, tqdm(total=len(todo), unit="config", desc="sweep",
                                                 disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
                for row in rows:
                    f.write(_format(row))
                    f.flush()
                    self.rows.append({k: str(v) for k, v in row.items()})
                    bar.update()
        except OSError as e:  # a full disk: name the CSV (the rows written before it are kept)
            if e.filename is None:
                raise OSError(e.errno, e.strerror or str(e), str(self.path)) from None
            raise
        return len(todo)


def _execute(todo: list[SimConfig], jobs: int, dask_address: str | None):
    """An iterator of the rows of ``todo``; a Dask scheduler is connected to now (SimError if not)."""
    if dask_address:
        return _execute_dask(todo, _connect_dask(dask_address))
    if jobs <= 1:
        return (run_row(cfg) for cfg in todo)
    return _execute_pool(todo, jobs)


def _execute_pool(todo: list[SimConfig], jobs: int):
    pool = _start_pool(jobs)
    try:
        yield from pool.imap_unordered(run_row, todo)
        pool.close()  # workers leave on their own: nothing of theirs is left for the resource tracker
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def _start_pool(jobs: int):
    """A pool of ``jobs`` spawned workers that ignore SIGINT from their first instruction: they are
    started while the parent ignores it (a spawned interpreter keeps an ignored SIGINT ignored; the
    signal mask is not inherited), so a Ctrl-C that reaches a worker still importing does not print
    its traceback. A Ctrl-C in the parent's start of the pool (well under a second) goes unseen."""
    import multiprocessing as mp
    import signal

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return mp.get_context("spawn").Pool(jobs, initializer=_ignore_sigint)
    finally:
        signal.signal(signal.SIGINT, old)


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent, which stops the pool and keeps the finished rows (a pool
    started outside ``_start_pool`` ignores it from here)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


DASK_CONNECT_S = 5  # how long ``--dask`` waits for its scheduler before giving up


def _connect_dask(address: str):
    try:
        from dask.distributed import Client
    except ImportError:
        raise SimError("--dask needs dask[distributed]: pip install 'moelab[dask]'") from None
    try:
        return Client(address, timeout=f"{DASK_CONNECT_S}s")
    except (OSError, TimeoutError, ValueError, TypeError) as e:
        raise SimError(f"--dask {address}: cannot reach a Dask scheduler ({e})") from None


def _execute_dask(todo: list[SimConfig], client):
    from dask.distributed import as_completed

    with client:
        futures = [client.submit(run_row, cfg, pure=False) for cfg in todo]
        for fut in as_completed(futures):
            yield fut.result()


class SweepBusy(ValueError):
    """Another sweep holds the output directory's lock."""


@contextmanager
def locked(out_dir: str | os.PathLike):
    """Hold ``out_dir/LOCK_NAME`` (an exclusive ``flock``) for the block: two sweeps into one
    directory would both run every config and write each row twice. Raises SweepBusy, naming the
    holder's pid, when another process holds it; the lock ends with the process that held it."""
    import fcntl

    path = Path(out_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, file_mode())
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise SweepBusy(f"{out_dir}: another moelab sweep (pid {holder}) is writing here "
                            f"(lock {path}); wait for it to end or give another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def plot_results(rows: list[dict], out_dir: str | os.PathLike, cache_unit: str = "mib") -> list[Path]:
    """One PNG per (model, hardware): tokens/s and hit rate against cache size, a line per policy
    (hybrid: per miss fraction). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xname = "slots_per_layer" if cache_unit == "slots" else "cache_mib_used"
    groups: dict[tuple, dict[str, list]] = {}
    for r in rows:
        if r.get("error") or not r.get("tokens_per_s"):
            continue
        label = r["policy"] + (f" f={float(r['miss_fraction']):.2f}" if r.get("miss_fraction") not in ("", None) else "")
        g = groups.setdefault((r["model"], r["hardware"]), {})
        g.setdefault(label, []).append((float(r[xname]), float(r["tokens_per_s"]), float(r["hit_rate"]),
                                        float(r["bound_tokens_per_s"])))
    written = []
    for (model, hw), lines in sorted(groups.items()):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for label, pts in sorted(lines.items()):
            pts.sort()
            xs = [p[0] for p in pts]
            a1.plot(xs, [p[1] for p in pts], marker="o", label=label)
            a2.plot(xs, [100 * p[2] for p in pts], marker="o", label=label)
        xlabel = "cache slots per layer" if cache_unit == "slots" else "cache (MiB)"
        a1.set(xlabel=xlabel, ylabel="decode tokens/s (simulated)", title=f"{model} on {hw}")
        a2.set(xlabel=xlabel, ylabel="hit rate (%)", title="hit rate")
        for a in (a1, a2):
            a.grid(alpha=0.3)
        a1.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / f"sweep_{model}_{hw}.png".replace("/", "_")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
