"""The CPU pool on two kinds of expert memory: the calibration's (anonymous buffers, as
``sim_vs_real``'s executor holds its experts) and a file's read-only memory map (as ``moelab run``
reads a GGUF file, ``gguf_file.GGUFFile``).

``mapped_layers`` writes layers' expert bytes to a file and returns the same layers viewed through
a memory map of it; ``measure_pool_memory`` times the pool's calls on both, interleaved, and reads
the kernel's huge-page counters for each (``/proc/self/smaps``: whether the pages under the
experts are 2 MiB or 4 KiB ones).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from .calibrate_fit import stats
from .experts import LayerExperts

__all__ = ["mapped_layers", "measure_pool_memory", "huge_page_kib"]

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


def measure_pool_memory(layers: list[LayerExperts], threads: int, path: Path, n: int = 8, rounds: int = 4,
                        reps: int = 5, seed: int = 0) -> dict:
    """Pool compute time of calls on ``n`` cold experts (one token each) on ``layers`` as given
    (anonymous) and memory-mapped from ``path`` (written here, removed after), ``rounds`` rounds of
    ``reps`` calls per kind, every other round in reverse: {kind: stats, "ratio": mapped / anon
    median, "pages": {kind: huge_page_kib}}."""
    from .calibrate_measure import measure_cpu_pool

    mapped, mm = mapped_layers(layers, path)
    try:
        kinds = {"anon": layers, "mapped": mapped}
        pages = {k: huge_page_kib([t.data for lx in v for t in (lx.gate, lx.up, lx.down)]) for k, v in kinds.items()}
        samples: dict[str, list] = {k: [] for k in kinds}
        for r in range(rounds):
            for k in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                table = measure_cpu_pool(kinds[k], threads, counts=(n,), reps=reps, seed=seed + r)["compute_s"][n]
                samples[k].append(table["median"])
        pages = {k: {**pages[k], **{f"{key}_after": v for key, v in huge_page_kib(
            [t.data for lx in kinds[k] for t in (lx.gate, lx.up, lx.down)]).items()}} for k in kinds}
        out = {k: stats(v) for k, v in samples.items()}
        out["ratio"] = out["mapped"]["median"] / out["anon"]["median"]
        out["pages"] = pages
        out["expert_bytes"], out["experts_per_call"] = layers[0].expert_bytes, n
        return out
    finally:
        del mapped, kinds
        try:
            mm.close()
        except BufferError:  # a view still alive: the map closes with it
            pass
        os.unlink(path)
