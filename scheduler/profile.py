"""Ranked expert profiles and the STRP v1 file format.

STRP v1 (little-endian): ``b"STRP"``, five u32 (version = 1, n_layers, n_experts, slots,
n_ranked), then n_ranked pairs (u16 layer, u16 expert) hottest first, then optionally a trailer of
n_layers * n_experts 32-bit values, either a float32 frequency table (count / total) or an int32
table giving each pair's rank, -1 (0xFFFFFFFF) for unranked pairs. Readers reject: a file outside
24 B .. 64 MiB, a wrong magic or version, a size that is neither header + pairs nor header + pairs
+ trailer, ids out of range, duplicate pairs, ``slots > n_ranked``, and a trailer that is neither
kind. Nothing is loaded from a bad file.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .core import Geometry
from .files import atomic_write

__all__ = ["Profile", "ProfileError", "read_strp", "write_strp", "STRP_MAGIC"]

STRP_MAGIC = b"STRP"
_HEADER = struct.Struct("<4s5I")
MIN_BYTES, MAX_BYTES = _HEADER.size, 64 * 1024 * 1024


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Profile:
    """Experts ranked hottest first, for a model of ``num_layers`` x ``num_experts``.

    Invariants: pairs are distinct and in range; ``slots <= len(ranked)``. ``frequency`` is an
    optional ``(num_layers, num_experts)`` table of route shares.
    """

    num_layers: int
    num_experts: int
    ranked: tuple[tuple[int, int], ...]
    slots: int
    frequency: np.ndarray | None = None

    def __post_init__(self) -> None:
        seen = set()
        for i, (l, e) in enumerate(self.ranked):
            if not (0 <= l < self.num_layers and 0 <= e < self.num_experts):
                raise ProfileError(f"pair {i} ({l}, {e}) out of range for {self.num_layers}x{self.num_experts}")
            if (l, e) in seen:
                raise ProfileError(f"pair {i} ({l}, {e}) is listed twice")
            seen.add((l, e))
        if not 0 <= self.slots <= len(self.ranked):
            raise ProfileError(f"slots {self.slots} > ranked pairs {len(self.ranked)}")

    @classmethod
    def from_counts(cls, counts: np.ndarray, slots: int | None = None) -> "Profile":
        """Rank every pair with a non-zero count, most routed first (ties: lower layer, expert)."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.ndim != 2:
            raise ProfileError(f"counts: expected a (layers, experts) table, got shape {counts.shape}")
        flat = counts.ravel()
        order = np.lexsort((np.arange(flat.size), -flat))
        order = order[flat[order] > 0]
        ne = counts.shape[1]
        ranked = tuple((int(i // ne), int(i % ne)) for i in order)
        total = flat.sum()
        freq = (counts / total).astype(np.float32) if total > 0 else None
        return cls(counts.shape[0], ne, ranked, len(ranked) if slots is None else min(slots, len(ranked)), freq)

    def check_geometry(self, geometry: Geometry) -> None:
        if self.num_layers != geometry.num_layers or self.num_experts != geometry.max_experts:
            raise ProfileError(
                f"profile is for {self.num_layers} layers x {self.num_experts} experts; the model has "
                f"{geometry.num_layers} x {geometry.max_experts}"
            )
        for l, e in self.ranked:
            if e >= geometry.num_experts[l]:
                raise ProfileError(f"profile pair ({l}, {e}): layer {l} has {geometry.num_experts[l]} experts")


def write_strp(profile: Profile, path: str | os.PathLike, trailer: str | None = "freq") -> None:
    """Write ``profile`` atomically (temporary file, then rename), mode 0o666 less the umask. ``trailer``: "freq", "rank" or None."""
    n_l, n_e = profile.num_layers, profile.num_experts
    parts = [_HEADER.pack(STRP_MAGIC, 1, n_l, n_e, profile.slots, len(profile.ranked))]
    parts.append(np.asarray(profile.ranked, dtype="<u2").reshape(-1).tobytes())
    if trailer == "freq":
        if profile.frequency is None:
            raise ProfileError("trailer 'freq' needs a profile with a frequency table")
        parts.append(np.asarray(profile.frequency, dtype="<f4").reshape(n_l * n_e).tobytes())
    elif trailer == "rank":
        rank = np.full(n_l * n_e, -1, dtype="<i4")
        for i, (l, e) in enumerate(profile.ranked):
            rank[l * n_e + e] = i
        parts.append(rank.tobytes())
    elif trailer is not None:
        raise ValueError(f"trailer: {trailer!r}, expected 'freq', 'rank' or None")
    atomic_write(path, b"".join(parts))


def read_strp(path: str | os.PathLike) -> Profile:
    """Read an STRP v1 file, either trailer kind; raises ProfileError naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes() if path.stat().st_size <= MAX_BYTES else None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
    if data is None or len(data) < MIN_BYTES:
        raise ProfileError(f"{path}: size must be {MIN_BYTES} B .. {MAX_BYTES} B")
    magic, version, n_l, n_e, slots, n_r = _HEADER.unpack_from(data)
    if magic != STRP_MAGIC:
        raise ProfileError(f"{path}: magic {magic!r}, expected {STRP_MAGIC!r}")
    if version != 1:
        raise ProfileError(f"{path}: version {version}, expected 1")
    if not (0 < n_l <= 65536 and 0 < n_e <= 65536):
        raise ProfileError(f"{path}: n_layers {n_l} / n_experts {n_e} out of range")
    body = _HEADER.size + 4 * n_r
    table = 4 * n_l * n_e
    if len(data) not in (body, body + table):
        raise ProfileError(
            f"{path}: {len(data)} bytes, expected {body} (header + {n_r} pairs) or {body + table} "
            f"(with a {n_l}x{n_e} trailer): truncated or oversized"
        )
    pairs = np.frombuffer(data, dtype="<u2", count=2 * n_r, offset=_HEADER.size).reshape(n_r, 2)
    ranked = tuple((int(l), int(e)) for l, e in pairs)
    try:
        profile = Profile(n_l, n_e, ranked, slots)  # pairs checked before the trailer is indexed by them
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    if len(data) == body + table:
        profile = replace(profile, frequency=_read_trailer(path, data[body:], ranked, n_l, n_e))
    return profile


def _read_trailer(path, raw: bytes, ranked, n_l: int, n_e: int) -> np.ndarray | None:
    as_int = np.frombuffer(raw, dtype="<i4")
    if np.all((as_int == -1) | ((as_int >= 0) & (as_int < max(len(ranked), 1)))):
        for i, (l, e) in enumerate(ranked):
            if as_int[l * n_e + e] != i:
                raise ProfileError(f"{path}: rank trailer gives pair {i} ({l}, {e}) rank {as_int[l * n_e + e]}")
        return None  # a rank table carries nothing the pairs do not
    as_f = np.frombuffer(raw, dtype="<f4")
    if np.all(np.isfinite(as_f)) and np.all(as_f >= 0) and np.all(as_f <= 1) and as_f.sum() <= 1.0 + 1e-3:
        return as_f.reshape(n_l, n_e).copy()
    raise ProfileError(f"{path}: trailer is neither a rank table (int32, -1 or rank) nor a frequency table (float32 in [0, 1])")
