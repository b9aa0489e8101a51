"""The verification step (L2 plan): the model that will run against the original, both from the
caller's state.

The planned model is the user's own forward with planned layouts, so it is verified as it will
run: one call (one training step when training) compared value by value with the original's
within the dtype's tolerance (beyond it, only if float64 copies of both agree), then two calls
of each (the second call's output, the inputs and buffers after them) and the parameters
(names, ties, ``requires_grad``). A mismatch names the first module whose output differs
(:func:`first_divergent_module`). When the plan fails, :func:`verified_fallback` tries the
model run entirely in one format, the faster first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memlayout.errors import LayoutVerificationError
from memlayout.plan.capture.regions import Captured
from memlayout.plan.check import guard
from memlayout.plan.check.guard import GuardDecision, build_uniform
from memlayout.plan.check.semantics import (
    Calls,
    ModuleState,
    call_twice,
    inplace_on_inputs,
    restore_state,
    verify_semantics,
)
from memlayout.plan.check.training import redrawn, verify_training
from memlayout.plan.compare import (
    compare,
    detached,
    float64,
    float64_agreement,
    float64_casts,
    tolerance,
)
from memlayout.plan.graph import Label
from memlayout.plan.inputs import inputs_in
from memlayout.plan.options import RunOptions
from memlayout.plan.report.records import (
    DTYPE_TOLERANCE,
    FLOAT64_RECHECK,
    GuardRecord,
    Verification,
)
from memlayout.plan.solve.regions import Solution
from memlayout.plan.steer.build import Build
from memlayout.plan.steer.state import Formats
from memlayout.tensors import clone_inputs


def verify_model(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
                 dtype: torch.dtype | None, device: torch.device, train: bool,
                 state: ModuleState, inplace: tuple[str, ...] = ()) -> Verification:
    """``planned`` against ``reference`` (the original) on ``inputs``, both from ``state``:
    one call (``train``: one training step), then the semantic checks. Raises
    ``LayoutVerificationError`` saying what differs (and where, when a module's output does);
    leaves both models in ``state``."""
    start = time.perf_counter()
    restore_state(reference, state)
    want = call_twice(reference, inputs, dtype=dtype, device=device)
    try:
        restore_state(reference, state)
        restore_state(planned, state)
        ran = _runs(planned, inputs, dtype=dtype, device=device)  # its two calls, checked below
        restore_state(planned, state)
        if train:
            verification = verify_training(reference, planned, inputs, dtype=dtype, device=device)
        else:
            verification = _one_call(reference, planned, inputs, dtype=dtype, device=device,
                                     expected=want.outputs[0], got=ran.outputs[0])
        restore_state(reference, state)
        restore_state(planned, state)
        count = verify_semantics(reference, planned, inputs, state, want, dtype=dtype,
                                 device=device, inplace=inplace, got=ran)
    finally:
        restore_state(reference, state)
        restore_state(planned, state)
    again = list(redrawn(want.draws, ran.draws))
    return dataclasses.replace(verification, semantics=count,
                               seconds=time.perf_counter() - start, redrawn=again,
                               # same_draws handles the rank-4/5 layouts: else it is said
                               draws=[d.format for d in want.draws] if again and all(
                                   len(d.shape) in (4, 5) for d in want.draws) else [])


def _runs(planned: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None,
          device: torch.device, calls: int = 2) -> Calls:
    """The planned model's two calls (``calls``) from the caller's state, as ``call_twice``
    makes the original's (what the output and semantic checks compare); ``LayoutVerificationError``
    when it fails where the original runs (an op that needs a format the plan did not give
    it: a ``.view`` of a channels-last tensor)."""
    try:
        return call_twice(planned, inputs, dtype=dtype, device=device, calls=calls)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LayoutVerificationError(
            f"the planned model fails where the original runs: {type(exc).__name__}: {first}",
            cause=f"it fails: {type(exc).__name__}") from exc


def _one_call(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...], *,
              dtype: torch.dtype | None, device: torch.device, expected: Any,
              got: Any) -> Verification:
    """The planned model's first call (``got``) against ``expected`` (the original's, from
    the same state and seed: ``call_twice``), with the float64 re-check beyond tolerance."""
    ok, err, count = compare(expected, got, dtype)
    rtol = tolerance(dtype)[0]
    if ok:
        return Verification(True, DTYPE_TOLERANCE, err, rtol, count)
    exact = float64_agreement(reference, planned, inputs, device=device,
                              runs=(expected, got, dtype))
    if exact is not None:  # rounding of the run dtype, equal in float64
        return Verification(True, FLOAT64_RECHECK, err, rtol, count, float64_error=exact)
    where = first_divergent_module(reference, planned, inputs, dtype=dtype, device=device)
    named = (f"; the first module whose output differs: {where}" if where else
             "; no module's output differs alone: the difference is in the model's own code")
    raise LayoutVerificationError(
        f"the planned model's outputs differ from the original's by {err:.3g} (relative; "
        f"tolerance {rtol:g} for {dtype or 'float32'}; not rounding alone: they differ in float64 "
        f"too, or farther from it than the original's own run){named}",
        cause="outputs differ", node=where)


def first_divergent_module(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...],
                           *, dtype: torch.dtype | None, device: torch.device) -> str | None:
    """The first module call (in the order the calls end) whose output differs between float64
    copies of the two models, as ``"path (Class)"``; ``None`` when none does."""
    ref64, planned64, xs = float64(reference), float64(planned), float64(inputs)
    try:
        with float64_casts():
            want = _module_outputs(ref64, xs, device)
            got = _module_outputs(planned64, xs, device)
    except RuntimeError:  # a dtype the model fixes otherwise: no float64 run
        return None
    for (path, kind, w), (path2, _, g) in zip(want, got, strict=False):
        if path != path2:
            return None  # another control flow: nothing to compare call by call
        if not compare(w, g, torch.float32)[0]:
            return f"{path or 'the model'} ({kind})"
    return None


def _module_outputs(model: nn.Module, inputs: tuple[Any, ...],
                    device: torch.device) -> list[tuple[str, str, Any]]:
    """Every module call's output, in the order the calls end."""
    seen: list[tuple[str, str, Any]] = []
    handles = [m.register_forward_hook(
        lambda mod, _a, out, path=path: seen.append((path, type(mod).__name__, detached(out))))
        for path, m in model.named_modules()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model(*clone_inputs(inputs))
    finally:
        for h in handles:
            h.remove()
    return seen


def verified_fallback(candidates: list[tuple[str, Callable[[], nn.Module]]],
                      verify: Callable[[nn.Module], Verification],
                      failure: LayoutVerificationError,
                      ) -> tuple[str, nn.Module, Verification, list[str]]:
    """The first of ``candidates`` (name, builder; the faster first) that verifies, with the
    reasons the others did not. Raises ``failure`` when none does."""
    tried = []
    for name, make in candidates:
        module = make()
        try:
            return name, module, verify(module), tried
        except LayoutVerificationError as exc:
            tried.append(f"{name}: {exc.cause or str(exc)}")
    raise failure


__all__ = ["first_divergent_module", "verified_fallback", "verify_model"]


def changed_inputs(captured: Captured, options: RunOptions) -> tuple[str, ...]:
    """What the forward changes of its inputs in place: the graph's in-place ops on its inputs,
    and the inputs the eager run changed (a graph may trace ``x += 1`` out of place)."""
    graph = [f for r in captured.regions if r.path == "" for f in inplace_on_inputs(r.gm)]
    call = captured.calls.get("module" if options.keywords else "")
    eager = [f"input {p} in place" for p in (call.mutated if call is not None else ())]
    return tuple(graph or eager)


def verify(reference: nn.Module, built: Build, inputs: tuple[Any, ...], options: RunOptions,
           state: Any, inplace: tuple[str, ...]) -> Verification:
    """The planned model against the original (``memlayout.plan.check.verification``).
    Refused before it runs, whatever the format: a forward that changes its input in place
    when inputs that arrive in another format are converted on entry (the change would land
    on the copy)."""
    if inplace and (options.input_label is not None or options.auto_input):
        raise LayoutVerificationError(
            f"the forward changes its input in place ({', '.join(inplace)}), and with "
            "input_format the planned model converts inputs that arrive in another format on "
            "entry: the change would land on that copy, not on the caller's tensor. Plan "
            "without input_format (inputs taken as they come), or make the op out of place "
            "(x = x * 2 instead of x.mul_(2))", cause="the forward changes its input in place",
            fallback=False)
    verification = verify_model(reference, built.module, inputs, dtype=options.dtype,
                                device=options.device, train=options.train, state=state,
                                inplace=inplace)
    if options.input_label is not None:
        verify_other_format(reference, built.module, inputs, options, state)
    if not options.same_draws:  # the planned model draws in its own layouts
        verification = dataclasses.replace(verification, draws=[])
    return verification


def verify_other_format(reference: nn.Module, planned: nn.Module, inputs: tuple[Any, ...],
                        options: RunOptions, state: ModuleState) -> None:
    """With a declared ``input_format``, the planned model converts inputs that arrive in the
    other format on entry: one call on the example in that other format against the original
    on the same, so that a model whose results depend on its input's format (a declaration it
    does not honour) is caught. Raises ``LayoutVerificationError``. Where the original
    itself does not run on the other format (an op that takes one), there is nothing to
    compare: the declaration is what makes such inputs run."""
    other = inputs_in(inputs, 1 - int(options.input_label), options.ranks)  # type: ignore[arg-type]
    try:
        restore_state(reference, state)
        try:
            want = call_twice(reference, other, dtype=options.dtype, device=options.device,
                              calls=1).outputs[0]
        except Exception:
            return
        restore_state(planned, state)
        got = _runs(planned, other, dtype=options.dtype, device=options.device,
                   calls=1).outputs[0]
        ok, err, _ = compare(want, got, options.dtype)
        if not ok:  # rounding of the run dtype alone, when float64 copies agree
            ok = float64_agreement(reference, planned, other, device=options.device,
                                   runs=(want, got, options.dtype)) is not None
    finally:
        restore_state(reference, state)
        restore_state(planned, state)
    if not ok:
        fmt = Label(1 - int(options.input_label)).text  # type: ignore[arg-type]
        raise LayoutVerificationError(
            f"with input_format, an input that arrives {fmt} gives other outputs than the "
            f"original on the same input (relative error {err:.3g}): the model's results "
            "depend on its input's format. Plan without input_format",
            cause=f"outputs differ on a {fmt} input")


def fall_back(reference: nn.Module, captured: Captured, solution: Solution,
              decision: GuardDecision, inputs: tuple[Any, ...], example: tuple[Any, ...],
              options: RunOptions, state: Any, failure: LayoutVerificationError,
              outputs: Formats, inplace: tuple[str, ...]
              ) -> tuple[GuardDecision, Verification, str]:
    """The plan failed verification: the model run entirely in one format, the faster first
    (as the guard measured them; unmeasured: NHWC, then NCHW), the first that verifies, with
    the note that says so. Raises ``failure`` when none does."""
    timed = decision.record.candidates if decision.record is not None else {}
    names = sorted((n for n in guard.UNIFORM if n != decision.kept and not (
        guard.UNIFORM[n] is Label.CHANNELS_LAST and guard.faulty(solution))),
                   key=lambda n: (-timed[n].median if n in timed else 0.0, -guard.UNIFORM[n]))
    own_inputs = options.auto_input and decision.input_label is not None
    arrive = {n: guard.UNIFORM[n] if own_inputs else options.input_label for n in names}
    candidates = [(n, lambda n=n: build_uniform(reference, captured, solution, guard.UNIFORM[n],
                                                options, outputs, arrive=arrive[n]))
                  for n in names]
    kept, built, verification, tried = verified_fallback(
        candidates, lambda b: verify(reference, b, example, options, state, inplace), failure)
    label = guard.UNIFORM[kept]
    record = (dataclasses.replace(decision.record, kept=kept) if decision.record is not None
              else GuardRecord(kept, options.guard_margin, "none", 0))
    why = failure.cause or str(failure)
    where = f" at {failure.node}" if failure.node else ""
    note = (f"the {decision.kept} model failed verification ({why}{where}); kept {kept}, "
            f"the model run entirely {'channels-last' if label else 'contiguous'}, verified"
            + (f" (also failed: {'; '.join(tried)})" if tried else ""))
    return (GuardDecision(built, record, label if own_inputs else decision.input_label),
            verification, note)
