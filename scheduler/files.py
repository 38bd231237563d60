"""Output paths checked before the work, and result files written atomically with the usual mode.

One rule for every command's output path: its parent directory must exist and be writable (moelab
never creates missing parents), and it must not be an existing directory (for a file) or an
existing file (for a directory). ``check_output`` applies it before the expensive work, so a bad
path costs nothing and leaves nothing behind.

``atomic_write`` writes a temporary file beside the destination, gives it the mode a plain
``open()`` would (``0o666`` less the umask, not ``mkstemp``'s ``0o600``), then renames it into place:
a reader sees the old file or the whole new one, and an interrupted write leaves no file.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["OutputPathError", "check_output", "atomic_write", "atomic_open", "file_mode", "dir_mode"]


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the path and what was expected."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: ``0o666`` less the umask."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode ``mkdir`` gives a new directory: ``0o777`` less the umask."""
    return 0o777 & ~_umask()


def check_output(path: str | os.PathLike, what: str = "output", is_dir: bool = False) -> Path:
    """``path`` as a Path if an output file (``is_dir``: directory) can be written there.

    Raises OutputPathError naming ``what`` (e.g. ``"--out"``) and the path when the parent
    directory is missing, is not a directory or is not writable, or when ``path`` is a directory
    and a file is expected (or a file and a directory is expected). An existing file (directory)
    at ``path`` is allowed: it is replaced (written into)."""
    p = Path(path)
    if str(path) == "":
        raise OutputPathError(f"{what}: empty path")
    parent = p.parent
    if not parent.exists():
        raise OutputPathError(f"{what} {p}: directory {parent} does not exist (moelab does not create it)")
    if not parent.is_dir():
        raise OutputPathError(f"{what} {p}: {parent} is not a directory")
    if is_dir:
        if p.exists() and not p.is_dir():
            raise OutputPathError(f"{what} {p}: exists and is not a directory; expected a directory")
        target = p if p.is_dir() else parent
    else:
        if p.is_dir():
            raise OutputPathError(f"{what} {p}: is a directory; expected a file path")
        target = parent
    if not os.access(target, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {p}: directory {target} is not writable")
    return p


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """A file object to write ``path`` through; renamed into place when the block ends without an
    exception, removed otherwise. ``mode`` is ``"w"`` or ``"wb"``; other keywords go to ``open``."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode: {mode!r}, expected 'w' or 'wb'")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, file_mode())
            with os.fdopen(fd, mode, **kwargs) as f:
                yield f
            os.replace(tmp, path)
        except OSError as e:  # a write's error (a full disk) names no file: name the destination
            if e.filename is None:
                raise OSError(e.errno, e.strerror or str(e), str(path)) from None
            raise
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically, with the usual mode."""
    if isinstance(data, str):
        with atomic_open(path, "w", encoding="utf-8") as f:
            f.write(data)
    else:
        with atomic_open(path, "wb") as f:
            f.write(data)
