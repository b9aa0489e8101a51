"""Layout-neutral, atomic training checkpoints.

Layout-neutral: every tensor is saved contiguous, on the CPU, under the plain model's keys
(``OptimizedModule`` and DDP prefixes removed), so a checkpoint of a planned or channels-last
model loads into the plain torchvision model and back. Loading copies values into the model's
own tensors, which keep their layout; optimizer state is put back into its parameter's layout.

Atomic: the file is written to a temporary file in the same folder, flushed and fsynced, then
``os.replace``-d over the old one; a crash mid-write leaves the previous checkpoint intact.

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
import io
import os
import pickle
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.errors import CheckpointError
from memlayout.layout import Format
from memlayout.tensors import to_format
from memlayout.train.ddp import unwrap

FORMAT = "memlayout-train-checkpoint/1"
LATEST = "latest.pt"
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


def _pause(tmp: str) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    nth, _, seconds = spec.partition(":")
    if int(nth) == _writes:
        time.sleep(float(seconds or 60))


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that ``path`` is always either the old file or the
    complete new one: temporary file in the same folder, fsync, ``os.replace``, fsync of the
    folder. Returns ``path``."""
    global _writes
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    _writes += 1
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            _pause(tmp)
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
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


def stale_temporaries(folder: str | Path) -> list[Path]:
    """Temporary files a killed writer left in ``folder`` (never read; safe to delete)."""
    return sorted(Path(folder).glob(f".{LATEST}.*.tmp"))
