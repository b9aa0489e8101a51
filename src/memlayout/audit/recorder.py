"""The recorder (L2): a thin ``TorchDispatchMode`` that records every aten call, owned by a
plain context manager (``AuditMode``) that knows which module each call ran under
(:mod:`memlayout.audit.attribution`, forward and backward) and what each call did to the
format (``_Ops``: drops, layout conversions). Nothing changes what the ops compute.

>>> import torch
>>> from torch import nn
>>> from memlayout.layout import Format
>>> from memlayout.tensors import to_format
>>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
>>> model = model.to(memory_format=torch.channels_last)
>>> x = to_format(torch.randn(2, 3, 8, 8), Format.CHANNELS_LAST)
>>> with AuditMode(model) as rec:
...     _ = model(x)
>>> [(r.module, r.op, r.dropped, r.conversion) for r in rec.report.records]
[('0', 'aten.convolution.default', False, False), ('1', 'aten.clone.default', True, True), ('1', 'aten._unsafe_view.default', False, False)]
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

import torch
from torch import nn

from memlayout.audit.attribution import Attribution, Label
from memlayout.audit.report import AuditReport, ModuleCall, OpRecord, TensorInfo
from memlayout.coverage.store import explain
from memlayout.dispatch import ObservingMode
from memlayout.dtypes import autocast, parse_dtype, torch_name
from memlayout.errors import LayoutDropError, MemlayoutError
from memlayout.layout import Format, formats_of
from memlayout.spatial import PASS_NAMES, is_spatial_name
from memlayout.tensors import (
    convert_batch,
    convert_module,
    device_of,
    format_answer,
    format_name,
    iter_tensors,
)

aten = torch.ops.aten

# Metadata queries and autograd bookkeeping: not compute, never recorded.
_NOT_RECORDED_NAMES = (
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim",
    "numel", "storage_offset", "is_contiguous", "is_strides_like_format",
    "is_non_overlapping_and_dense", "is_same_size", "detach", "alias", "lift_fresh",
    "_local_scalar_dense", "is_coalesced", "_nested_tensor_size",
)
NOT_RECORDED: frozenset[Any] = frozenset(
    getattr(aten, n) for n in _NOT_RECORDED_NAMES if hasattr(aten, n))
_NOT_RECORDED_NAMESPACES = frozenset({"profiler"})  # record_function markers

# Copy ops: op packet -> which argument is the copy's source. A call of one of these is a
# pure layout conversion when its result has the source's shape, dtype and device but other
# strides. Filled by ``copy_op``.
COPY_SOURCES: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Any]] = {}


def copy_op(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(args, kwargs) -> source tensor`` for the aten copy ops ``names``.
    Names this torch build lacks are skipped; a name that is no aten op at all is an error."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            if not name.replace("_", "").isalnum():
                raise ValueError(f"copy_op: {name!r} is not an aten op name")
            packet = getattr(aten, name, None)
            if packet is not None:
                COPY_SOURCES[packet] = fn
        return fn

    return register


@copy_op("clone", "_to_copy", "to_copy", "_reshape_copy")
def _source_is_self(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("self")


@copy_op("copy_", "copy", "_copy_from")
def _source_is_src(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("src")


def _ranks(fmt: Format) -> frozenset[int]:
    return frozenset({fmt.rank}) if fmt.rank is not None else frozenset({4, 5})


@lru_cache(maxsize=8192)
def _formats(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[frozenset[Format], str]:
    found = formats_of(shape, strides)
    return found, format_name(format_answer(found))


@cache
def _alias_kind(func: Any) -> str:
    """``view`` (a result aliases an input), ``inplace`` (writes an input), or ``new``."""
    returns = getattr(getattr(func, "_schema", None), "returns", ())
    kinds = {("inplace" if a.alias_info.is_write else "view")
             for a in returns if getattr(a, "alias_info", None) is not None}
    return "inplace" if "inplace" in kinds else "view" if kinds else "new"


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    return out


def _info(t: torch.Tensor) -> tuple[TensorInfo, frozenset[Format]]:
    shape = tuple(t.shape)
    try:
        strides = tuple(t.stride())
    except RuntimeError:  # sparse, nested: no strides, no format
        return TensorInfo(shape, (), torch_name(t.dtype), "non-strided", 0), frozenset()
    found, name = _formats(shape, strides)
    return TensorInfo(shape, strides, torch_name(t.dtype), name, t.numel() * t.element_size()), found


def _significant(info: TensorInfo) -> tuple[tuple[int, int], ...]:
    return tuple((d, st) for d, (sz, st) in enumerate(zip(info.shape, info.strides, strict=True))
                 if sz != 1)


class _Recorder(ObservingMode):
    """Hands each recorded op to the owner."""

    def __init__(self, owner: AuditMode) -> None:
        super().__init__()
        self.owner = owner

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        if (func.overloadpacket not in NOT_RECORDED
                and getattr(func, "namespace", "aten") not in _NOT_RECORDED_NAMESPACES):
            try:
                self.owner._record(func, args, kwargs, out)
            except LayoutDropError:
                raise
            except Exception as exc:  # an audit must never break the run it watches
                self.owner._unrecorded(func, exc)


class AuditMode:
    """Record every aten call run inside the block, with module, phase and formats.

    ``model`` (optional) names modules by their path in it (``layer3.0.downsample.1``); modules
    outside it are named on first call from their parent (or their type, at top level).
    ``fmt`` is the format whose drops are flagged. ``raise_on_drop`` raises
    ``LayoutDropError`` at the first drop (that is what ``strict`` does). After the block,
    ``rec.report`` is the ``AuditReport``. Forward, backward and ``optimizer.step()`` (phase
    ``optimizer``) are told apart.

    >>> model = nn.Linear(3, 2)
    >>> with AuditMode(model) as rec:
    ...     model(torch.randn(4, 3)).sum().backward()
    >>> sorted({(r.phase, r.module_type or "-") for r in rec.report.records})
    [('backward', '-'), ('backward', 'Linear'), ('forward', '-'), ('forward', 'Linear')]
    """

    def __init__(self, model: nn.Module | None = None, fmt: Format | str = Format.CHANNELS_LAST,
                 *, raise_on_drop: bool = False, meta: dict[str, Any] | None = None) -> None:
        self.fmt = Format.parse(fmt)
        self.raise_on_drop = raise_on_drop
        self.meta = dict(meta or {})
        self._records: list[OpRecord] = []
        self._where = Attribution(model, lambda t: _info(t)[0].format, self._unrecorded)
        self._ops = _Ops(self.fmt)
        self._mode: _Recorder | None = None
        self._report: AuditReport | None = None

    def __enter__(self) -> AuditMode:
        self._report = None
        self._where.start()
        self._mode = _Recorder(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self._mode = None
        self._where.stop()
        self._ops.clear()
        self._report = self._build()

    @property
    def report(self) -> AuditReport:
        """The ``AuditReport`` of everything recorded (so far, when read inside the block)."""
        return self._report if self._report is not None else self._build()

    def _unrecorded(self, func: Any, exc: Exception) -> None:
        self.meta["unrecorded"] = self.meta.get("unrecorded", 0) + 1
        self.meta.setdefault("first_unrecorded", f"{func}: {type(exc).__name__}: {exc}")

    def _build(self) -> AuditReport:
        calls = [ModuleCall(i, *call) for i, call in enumerate(self._where.modules.calls)]
        meta = {"torch": torch.__version__, **self.meta}
        notes = coverage_notes(self._records, self.fmt, meta)
        if notes:
            meta["coverage"] = notes
        return AuditReport.from_records(self.fmt.value, self._records, calls, meta)

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        phase, label = self._where.now()
        outs = _tensors(out, [])
        if phase == "forward" and outs:  # grad mode may be off: custom Function.forward
            self._where.created(outs, label)
        record = self._ops.record(len(self._records), phase, label, func, args, kwargs, outs)
        self._records.append(record)
        if record.dropped and self.raise_on_drop:
            raise LayoutDropError(_drop_message(record, self.fmt))


class _Ops:
    """What aten calls do to the format ``fmt``: each call's record (its tensors' formats,
    whether it dropped the format, whether it was a layout conversion), and which tensors made
    in the block are image-like (spatial), the values a drop is about."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self._ranks = _ranks(fmt)
        # tensors made inside the block: id -> (weak reference, spatial?); see is_spatial
        self._made: dict[int, tuple[Any, bool]] = {}

    def clear(self) -> None:
        self._made.clear()

    def is_spatial(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is an image-like value: made in the block by a spatial op or passed
        on from one by element-wise ops and views; a tensor from outside the block (the
        model's input, a parameter, a node run alone) is taken as one."""
        made = self._made.get(id(t))
        if made is None or made[0]() is not t:
            return True
        return made[1]

    def record(self, index: int, phase: str, label: Label, func: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any], outs: list[torch.Tensor]) -> OpRecord:
        """The record of one call of ``func`` that returned ``outs``."""
        ins = _tensors(args, [])
        if kwargs:
            _tensors(tuple(kwargs.values()), ins)
        in_pairs = [_info(t) for t in ins]
        out_pairs = [_info(t) for t in outs]
        kind = _alias_kind(func)
        target = frozenset({self.fmt})
        spatial_op = _spatial_op(func)
        spatial_in = [self.is_spatial(t) for t in ins]
        # A drop loses the format of an image-like (spatial) value: attention scores and
        # token tensors of rank 4 are not images, whatever their strides. A spatial op fed
        # inputs that are in the format only ambiguously (C == 1: a 3-d network's first
        # convolution) that returns another format drops it too: there the format is lost.
        dropped = (kind == "new"
                   and any(len(i.shape) in self._ranks and s
                           and (f == target or (spatial_op and self.fmt in f))
                           for (i, f), s in zip(in_pairs, spatial_in, strict=True))
                   and any(len(o.shape) in self._ranks and self.fmt not in f for o, f in out_pairs))
        spatial_out = spatial_op or ((kind == "view" or _passes_spatial(func)) and any(
            s and t.dim() in self._ranks for t, s in zip(ins, spatial_in, strict=True)))
        for t in outs:
            self._made[id(t)] = (_weak(t), spatial_out)
        return OpRecord(
            index=index, phase=phase, module=label[1], module_type=label[2],
            call=label[0], op=str(func), inputs=tuple(i for i, _ in in_pairs),
            outputs=tuple(o for o, _ in out_pairs), dropped=dropped,
            conversion=_is_conversion(func, kind, args, kwargs, outs),
            view=kind == "view", bytes=0 if kind == "view" else sum(o.nbytes for o, _ in out_pairs))


def _is_conversion(func: Any, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                   outs: list[torch.Tensor]) -> bool:
    """A copy op (``COPY_SOURCES``) whose result has its source's shape, dtype and device but
    other strides: a pure layout conversion."""
    source_of = COPY_SOURCES.get(func.overloadpacket)
    if source_of is None or not outs:
        return False
    src = source_of(args, kwargs)
    dst = args[0] if kind == "inplace" and args else outs[0]
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return False
    si, di = _info(src)[0], _info(dst)[0]
    return (si.shape == di.shape and si.dtype == di.dtype
            and src.device == dst.device and _significant(si) != _significant(di))


def _weak(t: torch.Tensor) -> Any:
    try:
        return weakref.ref(t)
    except TypeError:
        return lambda: None


@cache
def _spatial_op(func: Any) -> bool:
    """A convolution, pooling, spatial normalization, padding or resampling op (and their
    backward ops), by name: ``memlayout.spatial``'s rule."""
    return is_spatial_name(str(func.overloadpacket))


@cache
def _passes_spatial(func: Any) -> bool:
    """An element-wise or joining op: its output is as spatial as its inputs."""
    return torch.Tag.pointwise in getattr(func, "tags", ()) or \
        func.overloadpacket.__name__ in PASS_NAMES


def _drop_message(r: OpRecord, fmt: Format) -> str:
    lines = [f"{r.op} dropped {fmt.value} in {r.phase} at {r.where()}: an input is "
             f"{fmt.value} but a rank-{fmt.rank or '4/5'} result is not."]
    lines += [f"  input {i}: {t.describe()}" for i, t in enumerate(r.inputs)]
    lines += [f"  output {i}: {t.describe()}" for i, t in enumerate(r.outputs)]
    lines.append("Convert back after this module (memlayout.to_format), replace the op, or run "
                 "`memlayout audit` / memlayout.audit(...) to see every drop and its cost.")
    return "\n".join(lines)


def strict(fmt: Format | str = Format.CHANNELS_LAST, *, model: nn.Module | None = None) -> AuditMode:
    """A context in which the first op (not a view) that takes an input unambiguously in
    ``fmt`` and returns a result of that rank not in ``fmt`` raises ``LayoutDropError``, in
    forward and in backward.

    >>> from memlayout.tensors import to_format
    >>> x = to_format(torch.randn(1, 2, 4, 4), Format.CHANNELS_LAST)
    >>> with strict(Format.CHANNELS_LAST):
    ...     _ = torch.relu(x)          # keeps channels-last: fine
    ...     _ = x.contiguous()         # a copy to NCHW: a drop
    Traceback (most recent call last):
    ...
    memlayout.errors.LayoutDropError: aten.clone.default dropped channels_last in forward at (outside modules): ...
    """
    return AuditMode(model, fmt, raise_on_drop=True)


# -- one-call audit ---------------------------------------------------------------------------
def call_model(model: nn.Module, inputs: Any, kwargs: dict[str, Any] | None = None) -> Any:
    """``model(*inputs, **kwargs)`` for a tuple or list, ``model(inputs, **kwargs)`` otherwise."""
    kwargs = kwargs or {}
    return model(*inputs, **kwargs) if isinstance(inputs, (list, tuple)) else model(inputs, **kwargs)


def scalar_loss(outputs: Any) -> torch.Tensor:
    """The sum of every floating-point output that requires grad: what ``train=True``
    backpropagates. Not ``tensors.mean_square_loss`` (the loss of timed training steps): the
    loss's own ops are recorded with the model's, and a sum adds one forward op whose gradient
    is an ``expand`` view (no copy, no format), so the record is the model's ops."""
    parts = [t.sum() for t in iter_tensors(outputs) if t.requires_grad and t.is_floating_point()]
    if not parts:
        raise MemlayoutError(
            "train=True needs an output that requires grad; the model returned none "
            "(are all its parameters frozen?). Audit with train=False, or unfreeze a parameter.")
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()




def inputs_format(inputs: Any, kwargs: dict[str, Any] | None = None) -> Format:
    """The channels-last format of a model's inputs: ``CHANNELS_LAST_3D`` when the first
    tensor has rank 5, else ``CHANNELS_LAST``.

    >>> inputs_format(torch.zeros(1, 1, 4, 4, 4)).name, inputs_format((torch.zeros(2, 3, 8, 8), 1)).name
    ('CHANNELS_LAST_3D', 'CHANNELS_LAST')
    """
    first = next(iter_tensors((inputs, kwargs or {})), None)
    return Format.CHANNELS_LAST_3D if first is not None and first.dim() == 5 else Format.CHANNELS_LAST


def prepare(model: nn.Module, inputs: Any, fmt: Format,
            kwargs: dict[str, Any] | None = None) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Copies of ``model``, ``inputs`` and keyword inputs in ``fmt``; inputs that require grad
    are detached leaves of their own, so nothing flows back into the caller's tensors or graph."""
    model = convert_module(copy.deepcopy(model), fmt)
    inputs = convert_batch(inputs, fmt)
    return model, _fresh_leaves(inputs), _fresh_leaves(convert_batch(dict(kwargs or {}), fmt))


def _fresh_leaves(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_() if obj.requires_grad else obj
    if isinstance(obj, dict):
        out = copy.copy(obj)
        out.update({k: _fresh_leaves(v) for k, v in obj.items()})
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_fresh_leaves(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fresh_leaves(v) for v in obj)
    return obj


def run_once(model: nn.Module, inputs: Any, *, train: bool, dtype: torch.dtype | None,
             kwargs: dict[str, Any] | None = None) -> Any:
    """One forward (no grad unless ``train``), then backward of ``scalar_loss`` when ``train``."""
    with torch.set_grad_enabled(train):
        with autocast(device_of(inputs, model), dtype):
            out = call_model(model, inputs, kwargs)
        if train:
            scalar_loss(out).backward()
    return out


def coverage_notes(records: Any, fmt: Format, meta: dict[str, Any]) -> dict[str, str]:
    """For each op that dropped ``fmt``, what the cached coverage matrix says about it on this
    torch build, device and dtype (``memlayout coverage`` fills the cache; without it: ``{}``).
    Reads only the cache, never runs an op."""
    device = str(meta.get("device", "cpu")).split(":")[0]
    dtype = str(meta.get("dtype", "float32"))
    notes: dict[str, str] = {}
    for op in sorted({r.op for r in records if r.dropped}):
        sentence = explain(op, device, dtype, fmt)
        if sentence:
            notes[op] = sentence
    conv3d = [r for r in records if r.dropped and r.op.startswith("aten.convolution")
              and any(o.rank == 5 for o in r.outputs)]
    if conv3d and conv3d[0].op not in notes:
        # a fact of this build, seen in this run: worth saying where it happens, not as a
        # puzzle about the convolutions after it
        notes[conv3d[0].op] = (
            f"a 3-d convolution on {device} {dtype} returned NCDHW for an NDHWC input and weight "
            f"in this run (torch {torch.__version__}): there is no channels_last_3d kernel "
            "here, so every 3-d convolution drops the format where it runs")
    return notes


def audit(model: nn.Module, inputs: Any, *, train: bool = False,
          fmt: Format | str | None = None,
          dtype: torch.dtype | str | None = None,
          kwargs: dict[str, Any] | None = None) -> AuditReport:
    """Audit one run of ``model`` on ``inputs`` (one tensor, or a tuple of ``forward``'s
    positional inputs) and keyword inputs ``kwargs`` in ``fmt`` (on copies: the caller's model
    and tensors are left as they were): forward, plus backward of the outputs' sum when
    ``train``, under autocast when ``dtype`` is bf16/fp16. The model runs in the mode it is in.
    ``fmt`` defaults to the inputs' channels-last format: ``channels_last_3d`` when the first
    input tensor has rank 5 (a 3-d model), else ``channels_last``.

    >>> from torch import nn
    >>> m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))
    >>> report = audit(m, torch.randn(2, 3, 16, 16), train=True)
    >>> [(r.phase, r.where(), r.op, r.bytes) for r in report.drops]
    [('forward', '1 (Flatten)', 'aten.clone.default', 12544)]
    """
    fmt = inputs_format(inputs, kwargs) if fmt is None else Format.parse(fmt)
    autocast_dtype = parse_dtype(dtype)
    run_model, run_inputs, run_kwargs = prepare(model, inputs, fmt, kwargs)
    meta = {"model": type(model).__name__, "train": train,
            "dtype": torch_name(autocast_dtype or torch.float32),
            "inputs": [list(t.shape) for t in iter_tensors((run_inputs, run_kwargs))],
            "device": str(device_of(run_inputs, run_model))}
    with AuditMode(run_model, fmt, meta=meta) as rec:
        run_once(run_model, run_inputs, train=train, dtype=autocast_dtype, kwargs=run_kwargs)
    return rec.report

