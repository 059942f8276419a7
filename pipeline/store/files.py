"""File primitives of the store: streaming sha256 and crash-safe writes.

A write goes to a temp file in the target's directory, is fsynced and renamed over the target, and the
directory is fsynced, so a reader (or a machine after a power cut) sees the old file or the new one,
never a torn one. Digests stream in 1 MiB chunks, so hashing a multi-GB checkpoint takes constant
memory. This module imports nothing of the project.

A full disk (``ENOSPC``) is a ``DiskFullError`` (a ``RuntimeError``: the CLI prints it in one line)
naming the path, what was being written, the bytes it needed and the bytes free there; the temp file
is removed, so the target keeps its old content. A record that cannot be parsed (damaged outside
qerl: writes here are never torn) is a ``ValueError`` naming its path (``read_json``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


class DiskFullError(RuntimeError):
    """No space left on the device where an artifact or record was being written (see module docstring)."""


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # unreachable


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing ancestor), None if unknown."""
    here = Path(path)
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` or its cause chain is a full disk (an errno, or a library's wrapped message:
    torch's writer raises a RuntimeError that only quotes it)."""
    seen: set[int] = set()
    exc: BaseException | None = err
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "no space left on device" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full(path: str | Path, what: str, needed: str) -> DiskFullError:
    """The one-line error for a write to ``path`` that found the disk full; ``needed``: the space
    it needed, in words (``"12.0 MB"``, ``"more than 1.2 GB"``)."""
    free = free_bytes(path)
    return DiskFullError(
        f"no space left on device writing {what} to {path}: it needs {needed}, "
        f"{'an unknown amount' if free is None else human_bytes(free)} free there; free space "
        "(`qerl gc --dry-run` lists what the store can let go) and run again: finished stages are kept"
    )


def sha256_file(path: str | Path) -> str:
    """Streaming sha256 of a file (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if is_disk_full(err):
            raise disk_full(path, path.name, human_bytes(len(data))) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    """The JSON document at ``path``; one that does not parse is a ``ValueError`` naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError from a binary file
        raise ValueError(f"{path} cannot be read as JSON ({err})") from None
