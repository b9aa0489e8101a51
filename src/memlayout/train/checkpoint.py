"""Layout-neutral, atomic training checkpoints.

Layout-neutral: every tensor is saved contiguous, on the CPU, under the plain model's keys
(DDP prefixes removed), so a checkpoint of a planned or channels-last
model loads into the plain torchvision model and back. Loading copies values into the model's
own tensors, which keep their layout; optimizer state is put back into its parameter's layout.

Atomic: the file is written to a temporary file in the same folder, flushed and fsynced, then
``os.replace``-d over the old one; a crash mid-write leaves the previous checkpoint intact.

Sharded (``--strategy fsdp``): ``latest.dcp`` is written by every rank through
``torch.distributed.checkpoint`` (DCP): each rank its shards, into a temporary folder that rank
0 renames into a new version folder once DCP has finished, then points the ``latest.dcp``
symlink at it (``os.replace`` of a link: atomic) and removes the previous version. DCP stores
global shapes, so it loads at any world size, and into the plain, unsharded model.

One writer per folder: a training run holds :class:`CheckpointLock` (``flock`` on a lock file
in the folder) for its whole length, so a second run pointed at the same folder stops at its
start with the holder's pid. Temporary files carry their writer's pid; only those of dead
writers are ever removed.

>>> import tempfile, pathlib, torch
>>> from torch import nn
>>> conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
>>> sd = neutral_state_dict(conv)
>>> sd["weight"].is_contiguous(), torch.equal(sd["weight"], conv.weight)
(True, True)
>>> path = atomic_save({"model": sd}, pathlib.Path(tempfile.mkdtemp()) / "latest.pt")
>>> sorted(load_checkpoint(path, check_format=False))
['model']
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import pickle
import random
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from memlayout.errors import CheckpointError
from memlayout.files import atomic_file, fsync_dir, write_atomic
from memlayout.layout import Format
from memlayout.tensors import to_format
from memlayout.train.ddp import unwrap

FORMAT = "memlayout-train-checkpoint/1"
LATEST = "latest.pt"
#: the sharded checkpoint (``--strategy fsdp``): a symlink to the current version folder
LATEST_SHARDED = "latest.dcp"
#: what memlayout adds to a sharded checkpoint's folder (step, RNG states, settings)
SHARDED_META = "memlayout.pt"
_VERSION_PREFIX = "dcp-step"
LOCK = ".memlayout-train.lock"
#: "N:SECONDS": the N-th checkpoint write of this process sleeps SECONDS after writing half of
#: the file (tests kill the process there to show the previous checkpoint survives).
PAUSE_ENV = "MEMLAYOUT_CHECKPOINT_PAUSE"
_writes = 0


def _neutral(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return to_format(value.detach().to("cpu", copy=True), Format.CONTIGUOUS)
    if isinstance(value, dict):
        return {k: _neutral(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_neutral(v) for v in value)
    return value


def neutral_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` under the plain model's keys, every tensor a contiguous CPU copy."""
    return {k: _neutral(v) for k, v in unwrap(model).state_dict().items()}


def load_neutral_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Load a state dict from any layout into ``model`` (plain, channels-last, planned or
    DDP-wrapped); the model's tensors keep their own layout."""
    try:
        unwrap(model).load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"the checkpoint does not fit {type(unwrap(model)).__name__}: "
                              f"{exc}; was it saved from another model spec?") from exc


def neutral_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every tensor a contiguous CPU copy."""
    return _neutral(optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load optimizer state and lay each state tensor out as its parameter (momentum buffers
    of a channels-last weight are channels-last again: no strided update per step)."""
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this optimizer: "
                              f"{exc}") from exc
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride():
                    optimizer.state[p][k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generator states (torch CPU, the device's, Python)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def _pause() -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    nth, _, seconds = spec.partition(":")
    if int(nth) == _writes:
        time.sleep(float(seconds or 60))


def _os_problem(exc: OSError, path: Path, doing: str) -> str:
    """What went wrong with ``path`` and what to do, from an ``OSError``."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        remedy = "free space there or point --checkpoint at a folder on another disk"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        remedy = "make the folder writable for this user or point --checkpoint elsewhere"
    elif exc.errno == errno.ENOENT:
        remedy = ("was the folder or the temporary file removed while training ran? give each "
                  "run its own --checkpoint folder")
    else:
        remedy = "check the file system, or point --checkpoint elsewhere"
    return f"cannot {doing} {str(path)!r}: {reason} (errno {exc.errno}); {remedy}"


def _write_all(fd: int, data: memoryview) -> None:
    # straight to the descriptor, no copy of a checkpoint's bytes into a file buffer
    while data:
        data = data[os.write(fd, data):]


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that ``path`` is always either the old file or the
    complete new one (:func:`memlayout.files.atomic_file`: a temporary file named with this
    process's pid, fsync, ``os.replace``). Returns ``path``. A file system error (full disk,
    permissions) is a ``CheckpointError`` naming the path; the old file stays."""
    global _writes
    path = Path(path)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    _writes += 1
    try:
        with atomic_file(path) as f:
            half = len(data) // 2
            _write_all(f.fileno(), data[:half])
            _pause()
            _write_all(f.fileno(), data[half:])
    except OSError as exc:
        kept = f"; the previous {path.name} is kept" if path.is_file() else ""
        raise CheckpointError(_os_problem(exc, path, f"write {len(data) / 2**20:.1f} MiB to")
                              + kept) from exc
    return path


def load_checkpoint(path: str | Path, *, check_format: bool = True) -> dict[str, Any]:
    """Read a checkpoint (tensors on the CPU, ``weights_only``: no code runs)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}; train with --checkpoint DIR "
                              "first, or drop --resume")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a readable checkpoint ({type(exc).__name__}: "
                              f"{exc}); was it written by something else?") from exc
    if check_format and (not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT):
        raise CheckpointError(f"{str(path)!r} is not a memlayout training checkpoint "
                              f"(format {ckpt.get('format') if isinstance(ckpt, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    return ckpt


def temporaries(folder: str | Path) -> list[Path]:
    """Temporary files (and sharded checkpoints' temporary folders) of checkpoint writes in
    ``folder``: being written, or left by a writer that was killed."""
    folder = Path(folder)
    return sorted([*folder.glob(f".{LATEST}.*.tmp"), *folder.glob(f".{LATEST_SHARDED}.*.tmp")])


def _writer_pid(tmp: Path) -> int | None:
    # ".latest.pt.<pid>.<random>.tmp", ".latest.dcp.<pid>.<random>.tmp"
    for name in (LATEST, LATEST_SHARDED):
        if tmp.name.startswith(f".{name}."):
            head = tmp.name[len(f".{name}."):-len(".tmp")].split(".", 1)[0]
            return int(head) if head.isdigit() else None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def stale_temporaries(folder: str | Path) -> list[Path]:
    """Temporary files whose writer (the pid in the name) is no longer running: left by a
    writer that was killed, safe to delete. A live writer's file is never among them."""
    return [t for t in temporaries(folder)
            if (pid := _writer_pid(t)) is not None and not _alive(pid)]


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete :func:`stale_temporaries`; returns what was removed."""
    removed = []
    for tmp in stale_temporaries(folder):
        with contextlib.suppress(FileNotFoundError):  # another cleaner was first
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
            removed.append(tmp)
    # sharded versions no link points at: a writer killed between its rename and the link,
    # or before it removed the previous one (the caller holds the folder: no live writer)
    current = _sharded_target(Path(folder))
    for version in Path(folder).glob(f"{_VERSION_PREFIX}*"):
        if version != current and version.is_dir():
            shutil.rmtree(version, ignore_errors=True)
            removed.append(version)
    return removed


def saved_settings(folder: str | Path, *, sharded: bool = False) -> dict[str, Any]:
    """What the checkpoint in ``folder`` says of itself: ``step`` and the ``config`` it was
    trained with (empty when the file holds none). Reads only the small parts: a sharded
    checkpoint's ``memlayout.pt``, or ``latest.pt`` memory-mapped."""
    folder = Path(folder)
    if sharded:
        meta = load_sharded_meta(folder)
    else:
        path = folder / LATEST
        try:
            meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (EOFError, RuntimeError, pickle.UnpicklingError, ValueError, OSError) as exc:
            raise CheckpointError(f"{str(path)!r} is not a readable checkpoint "
                                  f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(meta, dict):
        return {}
    return {"step": meta.get("step"), "config": dict(meta.get("config") or {})}


def existing_checkpoint(folder: str | Path) -> str | None:
    """What a run without ``--resume`` would replace in ``folder``: ``latest.pt (step 12)``,
    ``latest.dcp (step 4)``, or ``None`` when it holds no checkpoint. Reads only."""
    folder = Path(folder)
    for name, sharded in ((LATEST, False), (LATEST_SHARDED, True)):
        if not (folder / name).exists():
            continue
        try:
            step = saved_settings(folder, sharded=sharded).get("step")
        except CheckpointError as exc:
            return f"{name} (which cannot be read: {exc})"
        return f"{name} (step {step})" if step is not None else name
    return None


def check_location(folder: str | Path, *, resume: bool = False, sharded: bool = False) -> Path:
    """Raise ``CheckpointError`` unless ``folder`` can hold checkpoints: an existing writable
    folder, or a new one whose parent is an existing writable folder (a mistyped parent is
    refused, not created); with ``resume``, ``folder/latest.pt`` (``sharded``:
    ``folder/latest.dcp``) must exist. Reads only."""
    folder = Path(folder)
    if resume:
        latest = folder / (LATEST_SHARDED if sharded else LATEST)
        if not (latest.is_dir() if sharded else latest.is_file()):
            other = folder / (LATEST if sharded else LATEST_SHARDED)
            hint = (f" (it holds {other.name}, written by --strategy "
                    f"{'ddp' if sharded else 'fsdp'}: resume with that strategy)"
                    if other.exists() else "")
            raise CheckpointError(f"no checkpoint at {str(latest)!r}{hint}; train with "
                                  "--checkpoint DIR first, or drop --resume")
        return folder
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"--checkpoint {str(folder)!r} is a file; expected a folder "
                              f"(it will hold {LATEST}): give a folder path")
    target = folder if folder.is_dir() else folder.parent
    if not folder.is_dir():
        if not target.exists():
            raise CheckpointError(f"--checkpoint {str(folder)!r}: its parent {str(target)!r} "
                                  "does not exist; create it first or fix the path")
        if not target.is_dir():
            raise CheckpointError(f"--checkpoint {str(folder)!r}: its parent {str(target)!r} "
                                  "is a file, not a folder; fix the path")
    if not os.access(target, os.W_OK | os.X_OK):
        raise CheckpointError(f"--checkpoint {str(folder)!r}: {str(target)!r} is not writable "
                              "for this user; make it writable or point --checkpoint elsewhere")
    return folder


class CheckpointLock:
    """Exclusive right to write checkpoints into a folder, for as long as it is held: an
    ``flock`` on ``folder/.memlayout-train.lock`` holding the owner's pid. The kernel drops
    the lock when its process dies, so a killed run never leaves the folder locked.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with CheckpointLock(folder):
    ...     CheckpointLock(folder)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    memlayout.errors.CheckpointError: checkpoint folder ... is in use by another training run (pid ...)...
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        try:
            self.folder.mkdir(exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointError(_os_problem(exc, self.path, "create the lock file")) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"checkpoint folder {str(self.folder)!r} is in use by another training run "
                f"(pid {holder}, which holds {str(self.path)!r}); give this run its own "
                "--checkpoint folder, or wait for that one to finish") from None
        except OSError as exc:
            os.close(fd)
            raise CheckpointError(_os_problem(exc, self.path, "lock")) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the folder up (the lock file stays: removing it would race a new holder)."""
        if getattr(self, "_fd", None) is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> CheckpointLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


# ---------------------------------------------------------------- sharded (DCP) checkpoints


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    # DCP warns that it assumes one process when there is no process group: here it is meant
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _sharded_target(folder: Path) -> Path | None:
    link = folder / LATEST_SHARDED
    if not link.is_symlink():
        return None
    return folder / os.readlink(link)


def save_sharded(state: dict[str, Any], meta: dict[str, Any], folder: str | Path, *,
                 rank: int, world_size: int) -> Path | None:
    """Write ``state`` (model and optimizer state dicts, sharded ``DTensor``s welcome) with
    ``torch.distributed.checkpoint`` and ``meta`` (plain values) beside it, atomically: every
    rank must call it (a collective under torchrun). Rank 0 returns ``folder/latest.dcp``,
    the others ``None``. A file system error is a ``CheckpointError``; the previous
    ``latest.dcp`` stays."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    box: list[Any] = [None]
    if rank == 0:
        box[0] = f".{LATEST_SHARDED}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = folder / box[0]
    try:
        with _one_process_is_meant():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except Exception as exc:  # DCP gathers every rank's failure into one exception
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write the sharded checkpoint {str(tmp)!r}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc}; "
                              f"the previous {LATEST_SHARDED} is kept. Free space or point "
                              "--checkpoint elsewhere") from exc
    if rank != 0:
        return None
    link = folder / LATEST_SHARDED
    previous = _sharded_target(folder)
    version = folder / f"{_VERSION_PREFIX}{int(meta.get('step', 0)):08d}-{secrets.token_hex(4)}"
    staged = folder / f".{LATEST_SHARDED}.{os.getpid()}.{secrets.token_hex(4)}.link.tmp"
    try:
        buf = io.BytesIO()
        torch.save(meta, buf)
        write_atomic(tmp / SHARDED_META, buf.getvalue())
        os.rename(tmp, version)
        fsync_dir(folder)
        os.symlink(version.name, staged)
        os.replace(staged, link)  # the switch: latest.dcp is the old version or the new one
        fsync_dir(folder)
    except OSError as exc:
        for leftover in (staged,):
            with contextlib.suppress(OSError):
                leftover.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        if _sharded_target(folder) != version:
            shutil.rmtree(version, ignore_errors=True)
        raise CheckpointError(_os_problem(exc, link, "write") + (
            f"; the previous {LATEST_SHARDED} is kept" if previous is not None else "")) from exc
    if previous is not None and previous != version:
        shutil.rmtree(previous, ignore_errors=True)
    return link


def load_sharded_meta(folder: str | Path) -> dict[str, Any]:
    """The plain values saved with a sharded checkpoint (step, RNG states, settings)."""
    path = Path(folder) / LATEST_SHARDED / SHARDED_META
    if not path.is_file():
        raise CheckpointError(f"no sharded checkpoint at {str(path.parent)!r} (no "
                              f"{SHARDED_META}); train with --strategy fsdp --checkpoint DIR "
                              "first, or drop --resume")
    meta = load_checkpoint(path)
    return meta


def load_sharded(state: dict[str, Any], folder: str | Path) -> None:
    """Fill ``state`` (state dicts of this process's model and optimizer, sharded or not) in
    place from ``folder/latest.dcp``, at whatever world size it was written (or none: a plain
    single-process load, no process group needed)."""
    import torch.distributed.checkpoint as dcp

    path = Path(folder) / LATEST_SHARDED
    try:
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=path.resolve())
    except Exception as exc:
        raise CheckpointError(f"cannot load the sharded checkpoint {str(path)!r} into this "
                              f"model: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}"
                              "; was it saved from another model spec?") from exc


def load_sharded_model(model: nn.Module, folder: str | Path) -> nn.Module:
    """Load the model part of ``folder/latest.dcp`` (written by any number of ranks) into
    ``model``: a plain, unsharded, unplanned model in one process works. Returns ``model``.

    The checkpoint's keys are the plain model's (a planned model's are its own)."""
    target = unwrap(model)
    state = {"model": target.state_dict()}
    load_sharded(state, folder)
    load_neutral_state_dict(target, state["model"])
    return model
