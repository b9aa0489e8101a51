"""What memlayout keeps on a planned model (application): ``model.memlayout``.

The plans by input signature (the example's first, others planned on first sight, at most
``max_plans`` held, least recently used dropped first), which of them the call in progress
runs (each steered module reads it), the input format, the autocast dtype, and how each plan's
results are handed back (in the strides the original returns them in).

>>> shape_signature((torch.zeros(2, 3, 8, 8),))
(Argument(shape=(2, 3, 8, 8), dtype='float32', device='cpu', format='contiguous'),)
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import MemlayoutError
from memlayout.layout import Format
from memlayout.plan.graph import Label, Request, label_of, value_meta
from memlayout.plan.steer.boundary import Returned, convert_leaf, restride, storage_addresses
from memlayout.plan.steer.draws import OriginalDraws
from memlayout.tensors import clone_inputs, device_of, iter_tensors

if TYPE_CHECKING:
    from memlayout.plan.report.plan import Plan



class Argument(NamedTuple):
    """One tensor argument as a plan is made for it: shape, dtype, device type and memory
    format (:func:`propagated_format`). A tuple: signatures are dict keys on every call,
    pickled with the planned model."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    format: str


class Mode(NamedTuple):
    """The last entry of the signature of a call in the other train/eval mode than the
    example's plan (``mode``: ``"train"`` or ``"eval"``); its fields line up with an
    :class:`Argument`'s (no shape, no format), so that a signature is one tuple of entries.

    >>> Mode(mode="train") == ((), "train", "mode", "")
    True
    """

    shape: tuple[()] = ()
    mode: str = "eval"
    kind: str = "mode"
    format: str = ""


#: every tensor argument of a call, in ``iter_tensors`` order, and its :class:`Mode` where the
#: model is in the other train/eval mode than the example's plan
Signature = tuple[Argument | Mode, ...]
#: each tensor of a result, and the format the original hands it back in
Formats = tuple[Returned, ...]
#: plans a new input signature of a planned model: ``(model, args, kwargs, key) -> plan``
#: (``None``: it failed; the model then runs its own computation for that signature, unsteered)
Replanner = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], "Plan | None"]

_CONTIGUOUS = Format.CONTIGUOUS.value


def shape_signature(args: Any) -> Signature:
    """What a plan is made for: shape, dtype, device type and memory format
    (:func:`propagated_format`) of every tensor argument. A call in another memory format is
    planned as another shape is: the original hands its results back in other strides.

    >>> [tuple(a) for a in shape_signature((torch.zeros(2, 3, 8, 8),))]
    [((2, 3, 8, 8), 'float32', 'cpu', 'contiguous')]
    >>> shape_signature((torch.zeros(2, 3, 8, 8).to(memory_format=torch.channels_last),))[0].format
    'channels_last'
    """
    return tuple(_entry(t) for t in iter_tensors(args))


def _entry(t: torch.Tensor) -> Argument:
    shape = tuple(t.shape)
    fmt = _propagated_format(shape, t.stride()) \
        if len(shape) in (4, 5) and t.layout is torch.strided else _CONTIGUOUS
    return Argument(shape, str(t.dtype).removeprefix("torch."), t.device.type, fmt)


def propagated_format(t: torch.Tensor) -> str:
    """The memory format torch's ops read from ``t``'s strides and give their results
    (``Tensor.suggest_memory_format``): ``channels_last`` (``channels_last_3d``) for a 4-d
    (5-d) tensor whose strides are like it, ``contiguous`` for any other. An ambiguous
    tensor (C == 1, H == W == 1) is in the one torch reads from its strides: converting it
    (a no-op) keeps its answer, and only strides that torch reads otherwise change it.

    >>> propagated_format(torch.zeros(2, 1, 8, 8).contiguous(memory_format=torch.channels_last))
    'contiguous'
    >>> propagated_format(torch.zeros(2, 8, 8, 1).permute(0, 3, 1, 2))
    'channels_last'
    """
    return _entry(t).format


@lru_cache(maxsize=1024)
def _propagated_format(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    # c10's is_channels_last_strides_2d / _3d: channels, then the spatial dims from the
    # innermost out, then the batch, each stride at least the extent of the dims before it;
    # a size-1 dim's stride counts (it tells N1H1 channels-last from contiguous), and a
    # channel stride of 0, or a batch stride equal to the channels' (N111), reads contiguous
    if strides[1] == 0:
        return _CONTIGUOUS
    least = 0
    for d in (1, *range(len(shape) - 1, 1, -1), 0):
        if shape[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return _CONTIGUOUS
        least = strides[d] * shape[d] if shape[d] > 1 else strides[d]
    return (Format.CHANNELS_LAST if len(shape) == 4 else Format.CHANNELS_LAST_3D).value


class PlannedState:
    """A planned model's plans and the call in progress (see the module docstring).

    ``plan``: the example's plan; ``plans``: every plan held, by input signature;
    ``replans``: the plans made after the example's; ``enabled``: ``False`` runs the model's
    own forward everywhere, unsteered (the parameters keep their formats);
    ``original_strides``: the name and strides in the original of each parameter and buffer
    the plan converted."""

    def __init__(self, *, plan: Plan, key: Any, dtype: torch.dtype | None,
                 ranks: tuple[int, ...], input_label: Label | None, outputs: Formats,
                 max_plans: int = 8, replanner: Replanner | None = None,
                 original_strides: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> None:
        self.plan = plan
        self.example = key
        self.dtype = dtype
        self.ranks = tuple(ranks)
        self.input_label = input_label
        self.max_plans = max_plans
        self.replanner = replanner
        self.replans = 0
        self.enabled = True
        self.original_strides = tuple(original_strides)
        self.outputs: dict[Any, Formats] = {key: outputs}
        self._held: OrderedDict[Any, Plan | None] = OrderedDict()  # other keys, LRU order
        self._local = threading.local()

    # ------------------------------------------------------------ the call in progress

    @property
    def active(self) -> Any:
        """The key of the plan the call in progress runs (the example's outside a call)."""
        return getattr(self._local, "key", self.example)

    def activate(self, key: Any) -> Any:
        """Make ``key`` the active plan; returns the one it replaces."""
        previous = self.active
        self._local.key = key
        return previous

    def key_for(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The key of the plan for this call, planning its input signature (and, for a
        model in the other train/eval mode than the example's plan, that mode) on first sight.
        With an input format (``plan.input_format``) the layout-rank inputs are converted to
        it on arrival: their memory format as called tells no plan apart."""
        if self.replanner is None or _tracing() or _sharded(model):
            # under a tracer or compiler the example's plan serves every shape: planning
            # would run inside the trace; a sharded model (FSDP) is planned on rank 0 before
            # it is sharded and runs that plan on every rank, whatever the shape
            return self.example
        key = _call_signature(args, kwargs)
        if model.training != (self.plan.mode == "train"):
            # a plan is made and verified for one mode (padded weights do not train): the
            # other mode is planned on first sight like another shape
            key = (*key, Mode(mode="train" if model.training else "eval"))
        if key == self.example:
            return key
        if self.input_label is not None:
            key = self._arrived(key)
            if key == self._arrived(self.example):
                return self.example
        if key in self._held:
            self._held.move_to_end(key)
            return key
        if not _binds(model, args, kwargs):
            return self.example  # a call the forward does not take: it raises its own error
        try:
            plan = self.replanner(model, args, kwargs, key)
        except MemlayoutError as exc:
            warnings.warn(f"memlayout: planning input shapes {[e[0] for e in key]} failed "
                          f"({exc}); the model runs its own computation, unsteered, for them",
                          stacklevel=4)
            plan = None
        if plan is not None and self.original_strides and self.plan.output_format == Request.KEEP:
            # the new plan was captured on the live parameters, some in the plan's formats:
            # what the original returns, fed this call, is read from the original's strides
            self.outputs[key] = self._original_outputs(model, args, kwargs)
        self.replans += 1
        self._held[key] = plan
        while len(self._held) > max(0, self.max_plans - 1):
            dropped, _ = self._held.popitem(last=False)
            self.outputs.pop(dropped, None)
        return key

    def _arrived(self, key: Any) -> Any:
        """``key`` with the memory format of each layout-rank tensor the one it arrives in."""
        assert self.input_label is not None
        label = Label(self.input_label)
        return tuple(Argument(e[0], e[1], e[2], label.format(len(e[0])).value)
                     if len(e[0]) in self.ranks else e for e in key)

    def original_copy(self, model: nn.Module) -> nn.Module:
        """A copy of ``model`` running the original's computation: the parameters and
        buffers the plan converted back in their original strides (copies), the others
        shared (the forward only reads them), every steered forward switched off."""
        originals = dict(self.original_strides)
        quiet = copy.copy(self)  # the copy's steered forwards read it: they run their own
        quiet.enabled = False
        memo: dict[int, Any] = {id(self): quiet, id(self.plan): self.plan}
        tensors = [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)]
        for name, t in tensors:
            if name in originals:  # the name it was converted by (a tied one has several)
                own = torch.empty_strided(t.shape, originals[name], dtype=t.dtype,
                                          device=t.device).copy_(t.detach())
                memo[id(t)] = nn.Parameter(own, t.requires_grad) \
                    if isinstance(t, nn.Parameter) else own
        for _, t in tensors:
            if isinstance(t, nn.Parameter):
                memo.setdefault(id(t), t)  # shared: the forward only reads it
        return copy.deepcopy(model, memo)

    def _original_outputs(self, model: nn.Module, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Formats:
        """The formats the original hands this call's results back in (:func:`output_formats`):
        the model's own forward, unsteered, once on a copy of ``model`` that shares its
        parameters but has those the plan converted back in their original strides, on
        copies of the call's tensors, under the plan's autocast; the caller's tensors, the
        model's buffers and the random state as they were."""
        original = self.original_copy(model)
        inputs = clone_inputs((args, kwargs), detach=True, nested=True)
        with seam(device_of(inputs, model)).fork_rng(), torch.no_grad(), \
                self.autocast(*inputs):
            output = original(*inputs[0], **inputs[1])
        return output_formats(output, inputs, self.ranks)

    def forget(self) -> None:
        """Drop the plans of other signatures (the model moved: its tensors are new)."""
        for key in self._held:
            self.outputs.pop(key, None)
        self._held.clear()

    @property
    def plans(self) -> dict[Signature, Plan]:
        """The plans held, by input signature: the example's first (a plan for the other
        train/eval mode is held under its signature and a last entry :class:`Mode`; its
        ``mode`` says which too)."""
        held: dict[Signature, Plan] = {self.example: self.plan}
        held.update((key, plan) for key, plan in self._held.items() if plan is not None)
        return held

    # ------------------------------------------------------------ what a call does

    def arrive(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's layout-rank tensors in the plan's input format (a no-op for those
        already in it); as they are when the plan takes inputs as they come."""
        if self.input_label is None:
            return args, kwargs
        return (tuple(self._arrive(a) for a in args),
                {k: self._arrive(v) for k, v in kwargs.items()})

    def prepare_inputs(self, *args: Any) -> tuple[Any, ...]:
        """``args`` as the plan's inputs arrive (``plan.input_format``), converted once here
        so that the calls that follow convert nothing: what a data pipeline (or a benchmark)
        does before its loop."""
        return self.arrive(args, {})[0]

    def _arrive(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return convert_leaf(value, self.input_label, value.dim()) \
                if value.dim() in self.ranks else value
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(self._arrive(v) for v in value)
        return value

    def autocast(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The plan's autocast region, on the device of this call's tensors."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return autocast(device_of((args, kwargs)), self.dtype)

    def draws(self, key: Any) -> Any:
        """Where the plan for ``key`` draws random masks as the original does
        (``same_draws``): each element-wise dropout in the original's format
        (:class:`~memlayout.plan.steer.draws.OriginalDraws`)."""
        plan = self.plan if key == self.example else self._held.get(key)
        formats = (getattr(plan.verification, "draws", ())  # a plan pickled before it had any
                   if plan is not None and plan.verification else ())
        return OriginalDraws(formats) if formats else contextlib.nullcontext()

    def restride(self, output: Any, key: Any, inputs: Any, model: nn.Module) -> Any:
        """``output`` of ``model`` in the formats the original model returns it in
        (``restride``; ``model``'s own parameters and buffers as themselves)."""
        formats = self.outputs.get(key, ())
        if not formats:
            return output
        if _tracing():  # what a tracer records: the plan's own formats, no storage read
            return restride(output, formats)
        return restride(output, formats, _arrival_label(inputs, self.ranks),
                        storage_addresses(inputs), self.ranks, model)

    # ------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]  # the call in progress is this process's, this thread's
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()


def output_formats(output: Any, inputs: Any, ranks: tuple[int, ...]) -> Formats:
    """Every tensor of the original's ``output`` (on ``inputs``), in ``iter_tensors`` order
    (:class:`~memlayout.plan.steer.boundary.Returned`): the label of each one of a layout rank
    in one definite format that is not a view of an input, ``None`` for the others (as they
    come)."""
    formats = []
    views = storage_addresses(inputs)
    for i, t in enumerate(iter_tensors(output)):
        label = None
        if t.dim() in ranks and not storage_addresses(t) & views:
            found = label_of(value_meta(t, ranks).tensors, ranks)
            if found in (Label.CONTIGUOUS, Label.CHANNELS_LAST):
                label = found
        formats.append(Returned(i, label, t.dim()))
    return tuple(formats)


def _arrival_label(inputs: Any, ranks: tuple[int, ...]) -> Label | None:
    """The label of the first layout-rank input in one definite format (``None``: none)."""
    for t in iter_tensors(inputs):
        if t.dim() in ranks:
            found = label_of(value_meta(t, ranks).tensors, ranks)
            if found in (Label.CONTIGUOUS, Label.CHANNELS_LAST):
                return found
    return None


def _call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """``shape_signature((args, kwargs))``, without walking the structure in the common call
    of plain tensor arguments (this runs on every forward)."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        return shape_signature(args)
    return shape_signature((args, kwargs))


def _sharded(model: nn.Module) -> bool:
    """``model`` is sharded by FSDP's ``fully_shard``: one rank cannot plan it alone."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module is not None and isinstance(model, module)


def _binds(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The model's own forward takes these arguments (else it raises, as the original would)."""
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the forward decide
        return True
    return True


def _tracing() -> bool:
    """Inside ``torch.compile``, ``torch.export``, ``torch.jit.trace`` or
    ``torch.fx.symbolic_trace``."""
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if compiling is not None and compiling():
        return True
    return torch.jit.is_tracing() or _fx_tracing()


try:  # torch.fx.symbolic_trace alone (is_fx_tracing warns that it also means torch.export)
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as _fx_tracing
except ImportError:  # older torch
    from torch.fx._symbolic_trace import is_fx_tracing as _fx_tracing
