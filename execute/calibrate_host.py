"""The host's state around a calibration: is anything else running while we measure?

A calibration measured on a busy host predicts a quiet run badly (one such file read memory at 45
GB/s against 112 on the same machine another day, and charged the all-CPU rows twice their time).
``host_state`` samples what the other processes keep busy (``/proc/stat`` over a short sleep, this
process idle) and the memory read rate; ``host_problem`` says in one line what is wrong with a
state (and with a later state against an earlier one), or None when the host looks quiet;
``quiet_host`` waits a bounded time for a quiet host. No GPU.
"""
from __future__ import annotations

import os
import time

from .calibrate_fit import POOL_MIN_CALLS

__all__ = ["busy_cores", "host_state", "host_problem", "quiet_host", "summary", "measurement_problems",
           "found_busy", "HOST_MEM_BYTES", "MEM_DROP", "BUSY_FLOOR", "POOL_SLOWER", "MEM_UNDER_POOL"]

HOST_MEM_BYTES = 1 << 28  # the memory read of a host check: 256 MiB, a few ms a read
MEM_DROP = 0.6  # a later memory read below this fraction of an earlier one: the host got busier (quiet hosts
# measured a 256 MiB read 37-63 GB/s within one process: the read alone is a weak signal)
BUSY_FLOOR = 1.5  # cores others may keep busy in any case (a shell, a monitor, one compile)


def busy_cores(interval_s: float = 0.5, stat_path: str = "/proc/stat") -> float | None:
    """Cores kept busy by the whole machine over ``interval_s`` (this process sleeps meanwhile, so
    it is everyone else): the non-idle share of ``/proc/stat``'s cpu line x the cores; None where
    the file cannot be read (not Linux)."""
    def sample():
        with open(stat_path) as f:
            v = [float(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])  # guest time is inside user time: the first 8 columns
    try:
        b0, t0 = sample()
        time.sleep(interval_s)
        b1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    return cores * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


def host_state(threads: int, mem_bytes: int = HOST_MEM_BYTES, interval_s: float = 0.5) -> dict:
    """{"busy_cores": others' busy cores (``busy_cores``), "cores", "mem_gbps": the memory read's
    ``stats`` with ``threads`` threads (``calibrate_measure.measure_cpu_mem_gbps``), "time"}."""
    from .calibrate_measure import measure_cpu_mem_gbps

    busy = busy_cores(interval_s)
    return {"busy_cores": busy, "cores": os.cpu_count() or 1,
            "mem_gbps": measure_cpu_mem_gbps(threads, mem_bytes, reps=9), "time": time.time()}


def host_problem(state: dict, threads: int, before: dict | None = None) -> str | None:
    """One line naming what makes ``state`` (``host_state``) a busy host for a calibration of
    ``threads`` pool threads, or None: other processes keep more than max(``BUSY_FLOOR``, cores -
    threads - 1) cores busy (the pool's threads and the caller's own would be descheduled), or,
    against an earlier state ``before``, the memory read fell below ``MEM_DROP`` of it."""
    busy, cores = state.get("busy_cores"), int(state.get("cores") or 1)
    spare = max(BUSY_FLOOR, cores - threads - 1.0)
    if busy is not None and busy > spare:
        return (f"other processes kept {busy:.1f} of {cores} cores busy (more than {spare:.1f} beside "
                f"{threads} pool threads and the caller)")
    if before is not None:
        now, then = state["mem_gbps"]["median"], before["mem_gbps"]["median"]
        if now < MEM_DROP * then:
            return f"the memory read fell from {then:.0f} to {now:.0f} GB/s while measuring"
    return None


def quiet_host(threads: int, wait_s: float, say, mem_bytes: int = HOST_MEM_BYTES,
               probe=host_state, sleep=time.sleep) -> tuple[dict, str | None]:
    """``host_state`` until ``host_problem`` finds nothing or ``wait_s`` has passed (a probe every
    few seconds); ``say(line)`` once when the first probe finds the host busy. Returns (the last
    state, its problem or None)."""
    t_end = time.monotonic() + wait_s
    state = probe(threads, mem_bytes)
    problem = host_problem(state, threads)
    if problem:
        say(f"host busy: {problem}; waiting up to {wait_s:.0f} s for it to quiet down")
    while problem and time.monotonic() < t_end:
        sleep(min(5.0, max(t_end - time.monotonic(), 0.0)))
        state = probe(threads, mem_bytes)
        problem = host_problem(state, threads)
    return state, problem


def summary(before: dict, after: dict) -> dict:
    """Two states as a calibration keeps them (``_calibration.host_state``): busy cores and the memory
    read's median of each, both reads' statistics, the minutes between them."""
    short = lambda s: {"busy_cores": s["busy_cores"], "cores": s["cores"], "mem_gbps": s["mem_gbps"]["median"]}
    return {"before": short(before), "after": short(after), "mem_stats": [before["mem_gbps"], after["mem_gbps"]],
            "minutes": (after["time"] - before["time"]) / 60}


POOL_SLOWER = 1.3  # the replay's median call over the pool alone's at the same count: the replay ran on a busy host
MEM_UNDER_POOL = 0.7  # the memory read below this fraction of the pool's own stream: a busy read (the pool can
# out-read the plain read: a quiet H200 host read 82 GB/s beside the pool's 96, a busy one 45 beside 79)


def measurement_problems(m: dict) -> list[str]:
    """What a calibration's measurements (``measure_all``'s dict, or a file's ``_calibration``) say
    against each other about the host, one line each: the memory read under ``MEM_UNDER_POOL`` x the
    rate the pool's own largest call streams its experts (``cpu_pool``: the read ran on a busy host), and the
    calibration replay's pool calls more than ``POOL_SLOWER`` x the pool alone's median at the
    largest expert count both measured (with at least ``POOL_MIN_CALLS`` replayed calls; the replay ran on
    a busy host: quiet calibrations measured 0.93-1.2x)."""
    out = []
    table = (m.get("cpu_pool") or {}).get("compute_s") or {}
    mem = (m.get("cpu_mem") or {}).get("median")
    if table and mem and m.get("expert_bytes"):
        n = max(table, key=float)
        rate = float(n) * m["expert_bytes"] / table[n]["median"] / 1e9
        if mem < MEM_UNDER_POOL * rate:
            out.append(f"the memory read ({mem:.0f} GB/s) was under {MEM_UNDER_POOL:g} x the rate the pool's own "
                       f"{n}-expert calls stream experts ({rate:.0f} GB/s)")
    by = ((m.get("engine_replay") or {}).get("pool") or {}).get("by_count") or {}
    alone = {int(n): st["median"] for n, st in table.items()}
    common = [int(n) for n, st in by.items() if int(n) in alone and st.get("n", 0) >= POOL_MIN_CALLS]
    if common:
        n = max(common)
        ratio = {int(k): v for k, v in by.items()}[n]["median"] / alone[n]
        if ratio > POOL_SLOWER:
            out.append(f"the calibration replay's {n}-expert pool calls took {ratio:.2f}x the pool alone's")
    return out


def found_busy(m: dict) -> bool:
    """Whether a calibration's measurements (``measure_all``'s dict, or a file's ``_calibration``)
    were taken on a busy host, by this version's rules: others' busy cores at the check before or
    after, or the memory read's fall between them (``host_problem`` on the recorded states; a
    recorded problem where no states were kept), or ``measurement_problems``. A problem that an
    older rule recorded is read again, not trusted."""
    st = m.get("host_state") or {}
    threads = int(m.get("threads") or 1)
    b, a = st.get("before"), st.get("after")
    if not (isinstance(b, dict) and isinstance(a, dict) and "cores" in b and "cores" in a):
        return bool(st.get("problem") or st.get("warning") or measurement_problems(m))
    full = lambda x: {**x, "mem_gbps": {"median": float(x.get("mem_gbps") or 0.0)}}  # summary keeps the medians
    return bool(host_problem(full(b), threads) or host_problem(full(a), threads, full(b)) or measurement_problems(m))
