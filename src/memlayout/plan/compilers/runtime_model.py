"""A peer runtime as a candidate of ``memlayout.compile`` (L2 plan, compilers): the model
converted once into OpenVINO, ONNX Runtime or whole-model mkldnn (``memlayout.runtimes``),
held as an ``nn.Module`` that guards what it cannot see (hooks, a changed copy of the model),
and the checks every candidate passes: outputs against the original's, dtype-aware.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlayout import runtimes as rt
from memlayout.devices import seam
from memlayout.dtypes import autocast, dtype_name
from memlayout.errors import LayoutVerificationError, MemlayoutError
from memlayout.layout import Format
from memlayout.plan.compare import compare, float64, tolerance
from memlayout.plan.graph import Label
from memlayout.plan.inputs import _add_prefix, _strip_prefix
from memlayout.plan.steer.state import PlannedState
from memlayout.plan.steer.steering import STATE
from memlayout.tensors import clone_inputs, convert_batch, device_of


class RuntimeModule(nn.Module):
    """A peer runtime's model (``memlayout.runtimes``) as the result of :func:`compile`:
    called with the example's input tensor, returns fp32 CPU tensors. Inference only.

    It runs no Python of the model: it holds its own copy of the weights (converted once,
    inside the runtime) and, as ``.module``, a copy of the original model. ``state_dict``
    returns that copy's (the original's keys and values); ``load_state_dict`` loads into it,
    then rebuilds the runtime model from it and checks it against it
    (``LayoutVerificationError`` when it differs). A hook registered on it raises, and a call
    after anything changed in the copy (a hook on one of its modules, a replaced submodule, a
    parameter changed in place) raises too, saying that the runtime would not see it:
    :meth:`rebuild` converts the copy again. ``memlayout.prepare_inputs`` gives the input in
    the layout the runtime reads (NCHW-contiguous, or channels-last for an NHWC export).
    """

    def __init__(self, model: nn.Module, plan: Any, example: torch.Tensor,
                 options: rt.RuntimeOptions) -> None:
        super().__init__()
        self.module = copy.deepcopy(model).eval()
        self.kept = options.runtime
        self.__dict__["options"] = options
        self.__dict__["plan"] = plan
        self.__dict__["_example"] = example.detach().cpu().clone()
        self.__dict__["runtime"] = rt.build_runtime(self.module, self._example, options)
        self.__dict__["_built"] = _fingerprint(self.module)
        # what memlayout.prepare_inputs and memlayout.plan_of read: the input format the
        # runtime takes without a copy
        self.__dict__[STATE] = PlannedState(
            plan=plan, key=None, dtype=options.dtype, ranks=(4, 5), outputs=(),
            input_label=Label.parse(self.input_format))
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)
        self.register_load_state_dict_post_hook(lambda module, _keys: module.rebuild())
        self.eval()

    @property
    def input_format(self) -> Format:
        """The format of the inputs the runtime reads without a copy."""
        return Format.CHANNELS_LAST if self.options.input_layout == "nhwc" else Format.CONTIGUOUS

    def prepare_inputs(self, *args: Any) -> tuple[Any, ...]:
        return convert_batch(args, self.input_format)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise MemlayoutError(self._runs_no_python("a forward hook"))

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise MemlayoutError(self._runs_no_python("a forward pre-hook"))

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        raise MemlayoutError(self._runs_no_python("a backward hook"))

    def _runs_no_python(self, what: str) -> str:
        return (f"the {self.kept} model runs no Python of the model: {what} would never run. "
                "Register it on the model before memlayout.compile(..., runtimes=()), which "
                "keeps a PyTorch candidate that runs the model's own forward")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"the {self.kept} model takes one input tensor, as the example it "
                            f"was built for; got {len(args)} positional and {len(kwargs)} "
                            "keyword arguments")
        if self.training:
            raise MemlayoutError(f"the {self.kept} model runs inference only; compile with "
                                 "runtimes=() to train a compiled PyTorch model")
        if _fingerprint(self.module) != self._built:
            raise MemlayoutError(
                f"the model copy behind the {self.kept} model changed since it was built (a "
                "hook, a replaced submodule or an in-place parameter change), which the "
                "runtime does not see; call .rebuild() to convert it again, or compile the "
                "changed model")
        (x,) = self.prepare_inputs(args[0])
        try:
            return self.runtime(x)
        except Exception as exc:
            if tuple(x.shape) == tuple(self._example.shape):
                raise
            raise MemlayoutError(
                f"the {self.kept} model was built for input shape {tuple(self._example.shape)} "
                f"and failed on {tuple(x.shape)} ({type(exc).__name__}); compile again with an "
                "example of that shape") from exc

    def rebuild(self) -> None:
        """Convert ``.module`` (the original's copy, with its current weights) again and check
        the new runtime model against it on the example."""
        runtime = rt.build_runtime(self.module, self._example, self.options)
        reference = reference_outputs(self.module, (self._example,), self.options.dtype)
        ok, err = reference.agrees(runtime(self._example), self.options.dtype)
        if not ok:
            raise LayoutVerificationError(
                f"the {self.kept} model rebuilt after loading weights differs from the "
                f"original by {err:.3g} (relative); it was not replaced",
                cause="the rebuilt runtime model differs")
        self.__dict__["runtime"] = runtime
        self.__dict__["_built"] = _fingerprint(self.module)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


def _fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """What a runtime built from ``model`` depends on: its modules, their hooks, and the
    versions of its parameters and buffers (an in-place change bumps them)."""
    return tuple((path, id(m), len(m._forward_hooks), len(m._forward_pre_hooks),
                  tuple(t._version for t in [*m._parameters.values(), *m._buffers.values()]
                        if t is not None))
                 for path, m in model.named_modules())


def runtimes_unavailable(names: Sequence[str], inputs: tuple[Any, ...], model: nn.Module,
                          dtype: torch.dtype | None, train: bool) -> dict[str, str]:
    """Why each runtime asked for is not a candidate here (absent: it is one)."""
    if isinstance(names, str):
        raise TypeError(f"runtimes={names!r}: a tuple of names, e.g. ({names!r},)")
    unknown = [n for n in names if n not in rt.ADAPTERS]
    if unknown:
        raise ValueError(f"unknown runtimes {unknown}; expected some of {', '.join(rt.ADAPTERS)}")
    device = device_of(inputs, model)
    common = ("a runtime model cannot train: training plans are compiled in PyTorch" if train
              else f"runtimes run on the CPU only; the model runs on {device}"
              if not seam(device).host
              else f"the runtime adapters run fp32 or bf16, not {dtype_name(dtype)}"
              if dtype not in (None, torch.bfloat16)
              else "the runtime adapters take one input tensor; the model takes "
                   f"{len(inputs)} arguments"
              if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor) else "")
    out = {}
    for name in names:
        reason = common or rt.available(name)
        if reason:
            out[name] = reason
    return out


def precision_of(name: str, dtype: torch.dtype | None) -> str:
    """What a candidate computes in, before it is built (a runtime's own words replace it)."""
    if name in rt.ADAPTERS:
        return f"{name} {dtype_name(dtype)}"
    return "fp32" if dtype is None else f"torch.autocast {dtype_name(dtype)} (weights fp32)"


@dataclass(frozen=True)
class Reference:
    """What a compiled candidate must reproduce: the original's outputs on the example, and
    the original itself, for the float64 re-check."""

    outputs: Any
    model: nn.Module
    inputs: tuple[Any, ...]

    def agrees(self, got: Any, dtype: torch.dtype | None) -> tuple[bool, float]:
        """(agrees, worst relative error) of a candidate's outputs ``got``. Outside the run
        dtype's tolerance, the float64 re-check: a candidate no farther from the original's
        float64 result than the original itself (twice, or the tolerance) computes what it
        does and rounds otherwise (NHWC kernels, TF32, a fused graph); a wrong one does not."""
        ok, err, _ = compare(self.outputs, got, dtype)
        if ok:
            return True, err
        xs = float64(self.inputs)
        try:
            with torch.no_grad():
                exact = float64(self.model)(*xs)
        except RuntimeError:  # a dtype fixed in the model's code: no re-check, the mismatch stands
            return False, err
        own = compare(exact, self.outputs, dtype)[1]
        theirs = compare(exact, got, dtype)[1]
        return theirs <= max(2 * own, tolerance(dtype)[0]), err


def reference_outputs(model: nn.Module, inputs: tuple[Any, ...],
                      dtype: torch.dtype | None) -> Reference:
    work = copy.deepcopy(model).eval()
    with torch.no_grad(), autocast(device_of(inputs, work), dtype):
        outputs = work(*clone_inputs(inputs))
    return Reference(outputs, work, inputs)


def check_candidate(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
                    reference: Reference, name: str) -> float:
    """Call ``module`` once (the compile) and compare with ``reference``; the seconds taken."""
    start = time.perf_counter()
    with torch.no_grad():
        got = module(*clone_inputs(inputs))
    seconds = time.perf_counter() - start
    ok, err = reference.agrees(got, dtype)
    if not ok:
        rtol = tolerance(dtype)[0]
        raise LayoutVerificationError(
            f"the compiled {name} model's outputs differ from the original's by {err:.3g} "
            f"(relative; tolerance {rtol:g})")
    return seconds
