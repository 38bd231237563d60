"""The GGUF container: this project's own parser of a file's header, metadata and tensor table.

Part of ``execute.gguf_io`` (which re-exports everything here and remains the one module that
imports gguf): the reader needs no gguf-py. Shapes come out in numpy order (the reversed-dims trap
is documented in ``execute.gguf_io``); tensor data is a memory map.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import quant as Q
from .experts import ExecutorError

__all__ = ["GGUFError", "GGUFFile", "TensorEntry", "QUANT_SIZES", "qtype_name"]

# (weights per block, bytes per block) of every GGML type id a file may hold: the layouts of
# execute.quant, and the types no moelab kernel reads (tested against gguf-py's table)
_OTHER_TYPES = {9: ("Q8_1", 32, 40), 15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
                27: ("I64", 1, 8), 28: ("F64", 1, 8), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
                40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18)}
QUANT_SIZES = {**{t: (q.block_weights, q.block_bytes) for t, q in Q.LAYOUTS.items()},
               **{t: (w, b) for t, (_, w, b) in _OTHER_TYPES.items()}}
_NAMES = {**{t: q.name for t, q in Q.LAYOUTS.items()}, **{t: v[0] for t, v in _OTHER_TYPES.items()}}


class GGUFError(ExecutorError, ValueError):
    """A GGUF file that is unreadable, incomplete or unsupported; the message names file and field."""


def qtype_name(qtype: int) -> str:
    """Name of a ``GGMLQuantizationType`` value (``8 -> "Q8_0"``; ``"type99"`` when unknown)."""
    return _NAMES.get(int(qtype), f"type{int(qtype)}")


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table. ``shape`` is numpy order, in elements (GGUF order reversed);
    ``data_offset`` is where its bytes start in the file."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int = field(default=0, repr=False)

    @property
    def qtype_name(self) -> str:
        return qtype_name(self.qtype)


# GGUF value types: (struct code, size) of the scalars; 8 is a string, 9 an array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
            10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Corrupt(Exception):
    """A read past the end of the file or a malformed entry, while parsing one section."""


class GGUFFile:
    """A GGUF file parsed by this module (little-endian v2/v3): header, metadata and tensor table.

    ``gguf.GGUFReader`` builds Python objects for every metadata element, which takes seconds for a
    150k-entry vocabulary; here each key's value type and offset are recorded in one pass and a
    value is decoded when :meth:`value` asks for it. ``data`` is the whole file as a read-only
    uint8 array on a memory map; ``tensors`` the tensor table as :class:`TensorEntry` rows (numpy
    order, ``data_offset`` absolute in the file, checked to lie inside it); :meth:`raw` a tensor's
    bytes as a view on the map. Parsing checks every length and offset against the file's size, so a
    truncated or corrupt file is a :class:`GGUFError` naming the file and the section."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_dir():
            raise GGUFError(f"{p}: is a directory; expected a GGUF file")
        if not p.is_file():
            raise GGUFError(f"{p}: no such file")
        self.path = str(path)
        try:
            with open(p, "rb") as fh:
                self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap of an empty file
            raise GGUFError(f"{p}: empty file, not a GGUF file") from None
        except OSError as exc:
            raise GGUFError(f"{p}: cannot read ({exc.strerror or exc})") from None
        self.data = np.frombuffer(self._buf, np.uint8)
        self._values: dict = {}
        pos = self._header()
        try:
            self.fields, pos = self._fields(pos)
        except (_Corrupt, struct.error, OverflowError) as exc:
            raise GGUFError(f"{self.path}: metadata section truncated or corrupt ({exc})") from None
        try:
            self.tensors = self._tensor_table(pos)
        except (_Corrupt, struct.error, OverflowError) as exc:
            raise GGUFError(f"{self.path}: tensor table truncated or corrupt ({exc})") from None

    def _header(self) -> int:
        buf = self._buf
        if buf[:4] != b"GGUF":
            raise GGUFError(f"{self.path}: not a little-endian GGUF v2/v3 file (starts with {bytes(buf[:4])!r})")
        if len(buf) < 24:
            raise GGUFError(f"{self.path}: {len(buf)} bytes, truncated inside the 24-byte GGUF header")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version not in (2, 3):
            swapped = struct.unpack_from(">I", buf, 4)[0]
            kind = "a big-endian GGUF file" if swapped in (2, 3) else f"GGUF version {version}"
            raise GGUFError(f"{self.path}: {kind}; supported: little-endian GGUF v2/v3")
        self.version = version
        self.num_tensors, self.num_kv = struct.unpack_from("<QQ", buf, 8)
        return 24

    def _end(self, pos: int, n: int, what: str) -> int:
        """``pos + n``, after checking that ``n`` bytes of ``what`` at ``pos`` lie inside the file."""
        if n < 0 or pos + n > len(self._buf):
            raise _Corrupt(f"{what}: {n} bytes at offset {pos} run past the end of the file ({len(self._buf)} bytes)")
        return pos + n

    def _string(self, pos: int, what: str) -> tuple[bytes, int]:
        n = struct.unpack_from("<Q", self._buf, pos)[0]
        end = self._end(pos + 8, n, what)
        return self._buf[pos + 8:end], end

    def _skip(self, vtype: int, pos: int, what: str) -> int:
        """The offset after a value of ``vtype`` at ``pos`` (arrays walked, not decoded)."""
        if vtype in _SCALARS:
            return self._end(pos, _SCALARS[vtype][1], what)
        if vtype == _STRING:
            return self._string(pos, what)[1]
        if vtype != _ARRAY:
            raise _Corrupt(f"{what}: value type {vtype} unknown")
        itype, n = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if itype in _SCALARS:
            return self._end(pos, n * _SCALARS[itype][1], what)
        self._end(pos, 8 * n if itype == _STRING else 4 * n, what)  # every element takes at least that
        if itype == _STRING:
            buf, unpack, size = self._buf, struct.unpack_from, len(self._buf)
            for _ in range(n):
                pos += 8 + unpack("<Q", buf, pos)[0]
            if pos > size:
                raise _Corrupt(f"{what}: a string runs past the end of the file ({size} bytes)")
            return pos
        for _ in range(n):
            pos = self._skip(itype, pos, what)
        return pos

    def _decode(self, vtype: int, pos: int):
        """The value of ``vtype`` at ``pos`` as Python values (arrays as lists, strings UTF-8)."""
        buf = self._buf
        if vtype in _SCALARS:
            return struct.unpack_from("<" + _SCALARS[vtype][0], buf, pos)[0]
        if vtype == _STRING:
            return self._string(pos, "string")[0].decode("utf-8", "replace")
        itype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _SCALARS:
            return np.frombuffer(buf, np.dtype("<" + _SCALARS[itype][0]), n, pos).tolist()
        out = []
        for _ in range(n):
            if itype == _STRING:
                m = struct.unpack_from("<Q", buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + m].decode("utf-8", "replace"))
                pos += 8 + m
            else:
                out.append(self._decode(itype, pos))
                pos = self._skip(itype, pos, "array")
        return out

    def _fields(self, pos: int) -> tuple[dict, int]:
        self._end(pos, 12 * self.num_kv, f"{self.num_kv} metadata entries")  # a key length and a type each
        fields = {}
        for i in range(self.num_kv):
            raw, pos = self._string(pos, f"key of metadata entry {i}")
            key = raw.decode("utf-8", "replace")
            if key in fields:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            vtype = struct.unpack_from("<I", self._buf, pos)[0]
            fields[key] = (vtype, pos + 4)
            pos = self._skip(vtype, pos + 4, f"metadata key {key!r}")
        return fields, pos

    def _tensor_table(self, pos: int) -> tuple[TensorEntry, ...]:
        self._end(pos, 24 * self.num_tensors, f"{self.num_tensors} tensor entries")  # name length, dims, type, offset
        rows = []
        for i in range(self.num_tensors):
            raw, pos = self._string(pos, f"name of tensor {i}")
            name = raw.decode("utf-8", "replace")
            n_dims = struct.unpack_from("<I", self._buf, pos)[0]
            if not 1 <= n_dims <= _MAX_DIMS:
                raise _Corrupt(f"tensor {name!r}: {n_dims} dimensions, expected 1..{_MAX_DIMS}")
            self._end(pos + 4, 8 * n_dims + 12, f"tensor {name!r}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)  # GGUF order: ne[0] (a row's length) first
            qtype, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 16 + 8 * n_dims
            if qtype not in QUANT_SIZES:
                raise _Corrupt(f"tensor {name!r}: quant type {qtype} unknown")
            block, size = QUANT_SIZES[qtype]
            if not all(dims) or dims[0] % block:
                raise _Corrupt(f"tensor {name!r}: dimensions {list(dims)} (GGUF order), expected >= 1 each and a "
                               f"row length that is a multiple of {qtype_name(qtype)}'s block of {block}")
            nbytes = math.prod(dims) // block * size
            # the reversed-dims trap, undone here once: numpy order is GGUF order reversed
            rows.append(TensorEntry(name, qtype, tuple(reversed(dims)), nbytes, offset))
        if len({t.name for t in rows}) != len(rows):
            seen = set()
            dup = next(t.name for t in rows if t.name in seen or seen.add(t.name))
            raise _Corrupt(f"tensor {dup!r} appears twice")
        if self.fields.get("general.alignment", (_UINT32,))[0] != _UINT32:
            raise _Corrupt(f"general.alignment has value type {self.fields['general.alignment'][0]}, expected uint32")
        align = self.value("general.alignment", 32)
        if align < 1 or align & (align - 1):
            raise _Corrupt(f"general.alignment = {align}, expected a power of two")
        start = -(-pos // align) * align
        out = []
        for t in rows:
            if t.data_offset % align:  # llama.cpp refuses it too: every tensor starts on the alignment
                raise _Corrupt(f"tensor {t.name!r}: data offset {t.data_offset} is not a multiple of "
                               f"general.alignment {align}")
            at = start + t.data_offset
            if at + t.nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: tensor data truncated: tensor {t.name!r}'s {t.nbytes} bytes at offset "
                                f"{at} run past the end of the file ({len(self._buf)} bytes; an incomplete copy?)")
            out.append(TensorEntry(t.name, t.qtype, t.shape, t.nbytes, at))
        return tuple(out)

    def value(self, key: str, default=None):
        """The value of metadata ``key`` (numbers, str, lists for arrays), or ``default``."""
        if key not in self.fields:
            return default
        if key not in self._values:
            vtype, pos = self.fields[key]
            self._values[key] = self._decode(vtype, pos)
        return self._values[key]

    def raw(self, t: TensorEntry) -> np.ndarray:
        """Tensor ``t``'s bytes as uint8 ``(*shape[:-1], row_bytes)``, a view on the map."""
        return self.data[t.data_offset:t.data_offset + t.nbytes].reshape(*t.shape[:-1], -1)


class _Meta:
    """Typed access to a file's key/value metadata, with errors naming file and key."""

    def __init__(self, reader: GGUFFile, path: str):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None, required: bool = False):
        if key not in self.reader.fields:
            if required:
                raise GGUFError(f"{self.path}: metadata key {key!r} missing")
            return default
        return self.reader.value(key)

    def int(self, key: str, default=None, required: bool = False) -> int:
        v = self.get(key, default, required)
        if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): all equal supported here
            if len(set(v)) != 1:
                raise GGUFError(f"{self.path}: metadata key {key!r} varies per layer {v[:8]}..., not supported")
            v = v[0]
        if v is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} missing")
        return int(v)
