"""The CPU pool on two kinds of expert memory: the calibration's (anonymous buffers, as
``sim_vs_real``'s executor holds its experts) and a file's read-only memory map (as ``moelab run``
reads a GGUF file, ``gguf_file.GGUFFile``).

``mapped_layers`` writes layers' expert bytes to a file and returns the same layers viewed through
a memory map of it; ``measure_pool_memory`` times the pool's calls on the buffers, on the map after
its pages were faulted in and on the map's first touch, interleaved, and reads the kernel's
huge-page counters for each (``/proc/self/smaps``: whether the pages under the experts are 2 MiB or
4 KiB ones); ``mapped_factor`` is the warm map's factor the peer rows' prediction applies.
``measure_map_uploads`` times expert uploads (``GpuExperts.upload``) out of the buffers and out of
the file's map, each page-locked in place as ``moelab run`` registers its file.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from .calibrate_fit import stats
from .experts import LayerExperts

__all__ = ["mapped_layers", "measure_pool_memory", "mapped_factor", "apply_mapped", "huge_page_kib",
           "measure_map_uploads"]

_ALIGN = 64  # bytes: each tensor starts on this boundary in the file (GGUF aligns to 32)


def mapped_layers(layers: list[LayerExperts], path: Path) -> tuple[list[LayerExperts], mmap.mmap]:
    """``layers``' gate, up and down bytes written to ``path``, and the same layers whose tensors
    are views of a read-only memory map of that file (keep the map open while they are used)."""
    offsets = []
    with open(path, "wb") as fh:
        for lx in layers:
            for t in (lx.gate, lx.up, lx.down):
                pad = -fh.tell() % _ALIGN
                fh.write(b"\0" * pad)
                offsets.append(fh.tell())
                t.data.tofile(fh)
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    buf = np.frombuffer(mm, np.uint8)
    out, i = [], 0
    for lx in layers:
        parts = []
        for t in (lx.gate, lx.up, lx.down):
            parts.append(replace(t, data=buf[offsets[i]:offsets[i] + t.data.size].reshape(t.data.shape)))
            i += 1
        out.append(replace(lx, gate=parts[0], up=parts[1], down=parts[2]))
    return out, mm


def huge_page_kib(arrays: list[np.ndarray]) -> dict:
    """KiB of the mappings under ``arrays`` backed by huge pages (``AnonHugePages``,
    ``FilePmdMapped``) and their resident size, from ``/proc/self/smaps``; {} where unreadable."""
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]
    out = {"Rss": 0, "AnonHugePages": 0, "FilePmdMapped": 0}
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return {}
    hit = False
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = any(a < hi and b > lo for a, b in spans)
        elif hit and head.rstrip(":") in out:
            out[head.rstrip(":")] += int(line.split()[1])
    return out


def _touch(lx: LayerExperts, experts) -> None:
    """Fault in the pages under ``experts`` of ``lx`` (one byte read per 4 KiB) without streaming them."""
    for t in (lx.gate, lx.up, lx.down):
        for e in experts:
            int(t.data[e, ::4096].sum())


def measure_pool_memory(layers: list[LayerExperts], threads: int, path: Path, n: int = 8, rounds: int = 3,
                        reps: int = 5, seed: int = 0) -> dict:
    """Pool compute time of calls on ``n`` experts (one token each) in three kinds of memory: the
    buffers of ``layers`` as given (``anon``), a read-only memory map of them written to ``path``
    (removed after) whose pages were faulted in beforehand (``mapped``: as a run reads its file
    after the prompt touched the experts) and the same map's pages touched for the first time
    (``cold``: each call faults its experts' pages in). Every call is on experts no call read
    before in that memory (``mapped`` on layer 0's experts, pre-touched; ``cold`` on layer 1's), so
    neither profits from the CPU caches; ``rounds`` rounds of ``reps`` calls per kind, the kinds'
    order rotating per round. Returns {kind: stats, "ratio": mapped / anon median, "cold_ratio",
    "touch_s_per_expert": (cold - mapped median) / n, "pages": {kind: huge_page_kib}}."""
    from .cpu_pool import CpuExpertPool

    if len(layers) < 2 or min(lx.num_experts for lx in layers[:2]) < n * rounds * reps:
        raise ValueError(f"measure_pool_memory: needs 2 layers of >= {n * rounds * reps} experts")
    rng = np.random.default_rng(seed)
    order = rng.permutation(layers[0].num_experts)[:n * rounds * reps].reshape(rounds * reps, n)
    hidden = layers[0].hidden
    mapped, mm = mapped_layers(layers[:2], path)
    try:
        views = {"anon": layers[0], "mapped": mapped[0], "cold": mapped[1]}
        tensors = lambda lx: [t.data for t in (lx.gate, lx.up, lx.down)]
        pages = {k: huge_page_kib(tensors(lx)) for k, lx in views.items()}
        _touch(mapped[0], order.reshape(-1))
        samples: dict[str, list] = {k: [] for k in views}
        with CpuExpertPool(threads, timeout_s=120) as pool:
            pool.warmup(layers[0])
            for i, experts in enumerate(order):
                kinds = list(views)[i // reps % 3:] + list(views)[:i // reps % 3]
                for k in kinds:
                    x = rng.standard_normal((n, hidden)).astype(np.float32)
                    job = pool.submit(views[k], experts, x)
                    job.result()
                    samples[k].append(job.compute_s)
        pages = {k: {**pages[k], **{f"{key}_after": v for key, v in huge_page_kib(tensors(lx)).items()}}
                 for k, lx in views.items()}
        out = {k: stats(v) for k, v in samples.items()}
        out["ratio"] = out["mapped"]["median"] / out["anon"]["median"]
        out["cold_ratio"] = out["cold"]["median"] / out["anon"]["median"]
        out["touch_s_per_expert"] = (out["cold"]["median"] - out["mapped"]["median"]) / n
        out["pages"] = pages
        out["expert_bytes"], out["experts_per_call"] = layers[0].expert_bytes, n
        return out
    finally:
        del mapped, views
        try:
            mm.close()
        except BufferError:  # a view still alive: the map closes with it
            pass
        os.unlink(path)


def mapped_factor(table: dict) -> float | None:
    """``cpu_mapped_factor`` from ``measure_pool_memory``'s table: the warm map over the buffers.
    A table without a ``cold`` entry was measured before the map was pre-touched: every call
    faulted its experts in, so its ratio is the first touch's; where both memories were backed by
    2 MiB pages (``AnonHugePages`` / ``FilePmdMapped`` at least 90% of each resident size) the warm
    map reads as the buffers do (1.0), else the old ratio stands. None where not measured."""
    ratio = (table or {}).get("ratio")
    if not ratio:
        return None
    if "cold" not in table:
        p = table.get("pages") or {}
        anon, mapped = p.get("anon") or {}, p.get("mapped") or {}
        huge = (anon.get("Rss", 0) > 0 and anon.get("AnonHugePages", 0) >= 0.9 * anon["Rss"]
                and mapped.get("Rss_after", 0) > 0 and mapped.get("FilePmdMapped_after", 0) >= 0.9 * mapped["Rss_after"])
        if huge:
            return 1.0
    return min(max(float(ratio), 0.01), 4.0)


def apply_mapped(hw: dict, m: dict, src: dict) -> None:
    """Put ``cpu_mapped_factor`` (``mapped_factor`` of ``m["cpu_mapped"]``) into hardware file ``hw``'s
    executor block and its source into ``src``, where measured."""
    factor = mapped_factor(m.get("cpu_mapped"))
    if factor:
        hw["executor"] = {**hw["executor"], "cpu_mapped_factor": factor}
        src["executor.cpu_mapped_factor"] = ("measured: the pool's 8-expert call on experts through a file's map, pages "
                                             "faulted in, / on the buffers (calibrate_memory.mapped_factor)")


def measure_map_uploads(layers: list[LayerExperts], path: Path, n: int = 32, rounds: int = 5,
                        seed: int = 0) -> dict:
    """Seconds per expert of ``n`` uploads back to back (``GpuExperts.upload``, one copy round,
    waited for) out of ``layers``' buffers (``anon``) and out of a read-only map of them written to
    ``path`` (``mapped``, removed after), each page-locked in place (``cudaHostRegister``, as
    ``moelab run`` registers its file; a range the driver refuses, such as one sharing a page with a
    range registered before, leaves that engine copying through its staging ring), and out of the
    buffers through the staging ring (``staged``: ``GpuExperts`` without registration), ``rounds``
    rounds in rotating order; each round's experts drawn across all the layers (the footprint a
    run's uploads spread over); {kind: stats (per expert), kind + "_host": stats of the host's time
    queueing them, "ratio": mapped / anon median, "pages": {kind: huge_page_kib}, "registered":
    {kind: bool}}."""
    import time

    from scheduler.core import Capacity, Geometry

    from .gpu_experts import GpuExperts
    from .gpu_host import PinnedRing

    E, L = layers[0].num_experts, len(layers)
    if E * L < n:
        raise ValueError(f"measure_map_uploads: {E * L} experts, expected >= {n}")
    mapped, mm = mapped_layers(layers, path)
    gxs = {}
    try:
        geo = Geometry((E,) * L, 8, (layers[0].expert_bytes,) * L)
        for k, lxs, pin in (("anon", layers, True), ("mapped", mapped, True), ("staged", layers, False)):
            gxs[k] = GpuExperts(lxs, Capacity.per_layer(geo, n), scratch_slots=1, pinned=pin, timeout_s=60)
        gxs["staged"].staging = PinnedRing(4, max(lx.expert_bytes for lx in layers))  # as a refused registration
        tensors = lambda lxs: [t.data for lx in lxs for t in (lx.gate, lx.up, lx.down)]
        pages = {"anon": huge_page_kib(tensors(layers)), "mapped": huge_page_kib(tensors(mapped))}  # staged: anon's
        rng = np.random.default_rng(seed)
        samples: dict[str, list] = {k: [] for k in gxs}
        samples.update({f"{k}_host": [] for k in gxs})
        for r in range(rounds + 1):  # round 0 warms them all (not recorded)
            pick = rng.choice(E * L, n, replace=False)
            for k in list(gxs)[r % 3:] + list(gxs)[:r % 3]:
                gx = gxs[k]
                t0 = time.perf_counter()
                gx.begin_copies()
                for i, x in enumerate(pick):
                    gx.upload(int(x) // E, int(x) % E, i)
                t1 = time.perf_counter()
                gx.wait(gx.copies_event(), "map upload probe")
                if r:
                    samples[k].append((time.perf_counter() - t0) / n)
                    samples[f"{k}_host"].append((t1 - t0) / n)
        out = {k: stats(v) for k, v in samples.items()}
        out["ratio"] = out["mapped"]["median"] / out["anon"]["median"]
        out["pages"] = pages
        out["registered"] = {k: gx.staging is None for k, gx in gxs.items() if k != "staged"}
        out["expert_bytes"], out["experts"], out["layers"] = layers[0].expert_bytes, n, L
        return out
    finally:
        for gx in gxs.values():
            gx.close()
        del mapped
        try:
            mm.close()
        except BufferError:
            pass
        os.unlink(path)
