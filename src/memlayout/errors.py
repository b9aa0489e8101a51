"""One exception family for memlayout. No torch import (usable from every layer).

Messages name what was given, what was expected, and what to do.
"""

from __future__ import annotations


class MemlayoutError(Exception):
    """Base of every error memlayout raises on purpose."""


class LayoutError(MemlayoutError, ValueError):
    """A layout request that cannot be met (wrong rank for the format, unknown format)."""


class ModelSpecError(MemlayoutError, ValueError):
    """A model spec (``torchvision:resnet18``, ``file.py:factory``) that cannot be built."""


class CaptureError(MemlayoutError):
    """A model (or part of one) that cannot be captured as a graph."""


class LayoutVerificationError(MemlayoutError):
    """A planned model whose results differ from the original's beyond dtype tolerance.

    Fields a note reads (never the message text): ``cause``, what differs, in a few words;
    ``node``, the first module (or graph node) whose output differs, when known;
    ``fallback``, whether the model run entirely in one format may be verified in the plan's
    place (``False`` for a refusal that no format changes, e.g. an in-place change of an
    input that arrives converted); ``inputs_changed``, the difference is in the caller's
    inputs after the call (the forward changes an input in place)."""

    def __init__(self, message: str, *, cause: str | None = None, node: str | None = None,
                 fallback: bool = True, inputs_changed: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        self.node = node
        self.fallback = fallback
        self.inputs_changed = inputs_changed


class LayoutDropError(MemlayoutError):
    """An operator dropped the memory format inside ``memlayout.strict``."""


class CoverageUnavailableError(MemlayoutError):
    """PyTorch's operator database (OpInfo), or a coverage matrix, is not available here."""


class DtypeError(MemlayoutError, ValueError):
    """A dtype name or ``torch.dtype`` a verb does not run (see ``memlayout.dtypes``)."""


class PlanError(MemlayoutError, ValueError):
    """A bad argument to the planner (``memlayout.optimize``): dtype, formats, inputs."""


class DataPipelineError(MemlayoutError, ValueError):
    """Input the channels-last data pipeline cannot turn into a batch."""


class MixedImageSizeError(DataPipelineError):
    """Images of one batch differ in (C, H, W); ``sizes`` maps each (C, H, W) to its samples."""

    def __init__(self, message: str, sizes: dict[tuple[int, int, int], list[int]]):
        super().__init__(message)
        self.sizes = sizes


class TrainError(MemlayoutError, ValueError):
    """A training run that cannot start or go on as asked (``memlayout train``, ``memlayout.train``)."""


class CheckpointError(MemlayoutError):
    """A training checkpoint that cannot be written, read, or loaded into this model."""


class CacheFileError(MemlayoutError, ValueError):
    """A file at the measurement cache's path that memlayout did not create: ``memlayout
    cache`` refuses it and a planning run measures without a cache; it is never moved."""


class ScriptError(MemlayoutError, AttributeError):
    """``torch.jit.script`` given a planned model (or a steered module of one): TorchScript
    compiles a forward from its Python source, and a planned model's steering has none. An
    ``AttributeError`` too: what reads a forward's ``__globals__`` with a default
    (``getattr``, ``hasattr``) gets the default, as before."""


class ExportError(MemlayoutError):
    """``torch.export`` of a (planned) model failed; the message says why and what to do."""


class FSDPError(TrainError):
    """A model FSDP's ``fully_shard`` cannot take as given (``memlayout.train.fsdp``)."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (torch's often run to many), else its type's name.

    >>> first_line(RuntimeError("shape mismatch\\n  at node conv1")), first_line(KeyError())
    ('shape mismatch', 'KeyError')
    """
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
