"""Files memlayout writes (L1): where its caches live, and one way to replace a file whole.

Every cache (measured costs, the coverage matrix, the JPEGs of ``bench-data``) lives under
:func:`cache_dir`. Every file a reader may open while it is rewritten (a checkpoint, a
benchmark's results, a cache entry) is written by :func:`atomic_file`: a reader, or a run
killed mid-write, sees the old file or the whole new one, never half of it.

>>> import tempfile
>>> path = Path(tempfile.mkdtemp()) / "notes.txt"
>>> write_atomic(path, "first\\n").read_text(), write_atomic(path, b"second\\n").read_text()
('first\\n', 'second\\n')
>>> sorted(p.name for p in path.parent.iterdir())  # no temporary file left
['notes.txt']
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def cache_dir() -> Path:
    """memlayout's cache folder: ``$MEMLAYOUT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memlayout``
    (``~/.cache/memlayout`` when unset). Each cache is a file or folder in it."""
    root = os.environ.get("MEMLAYOUT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "memlayout"


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends: a temporary file in the same
    folder (``.NAME.PID.RANDOM.tmp``: its writer's pid, so a cleaner can tell a dead writer's
    leftover from a live one's), flushed and fsynced, ``os.replace``-d over ``path``, then the
    folder fsynced. When the block raises, the temporary file is removed and ``path`` is
    untouched. The folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp",
                               dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Replace ``path`` by ``data`` (text is written as UTF-8) through :func:`atomic_file`;
    returns ``path``."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new file in ``folder`` durable (a no-op where a file system does not
    let a folder be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
