"""What a forward does besides its output (L2 plan, check): the state it changes (buffers, plain
attributes), the inputs it changes in place, two calls in a row, and the parameters (names,
ties, ``requires_grad``): the planned model must do all of it as the original does."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import LayoutVerificationError
from memlayout.plan.check.training import SEED, Draw, _LayoutFreeDropout
from memlayout.plan.compare import compare, detached, float64, float64_casts, tolerance
from memlayout.plan.graph import node_target_name
from memlayout.tensors import clone_inputs


@dataclass(frozen=True)
class ModuleState:
    """What a forward may change besides its output: every buffer's value (by name) and the
    plain attributes (numbers, strings, lists, dicts) of every submodule (by path)."""

    buffers: dict[str, torch.Tensor]
    attributes: dict[str, dict[str, Any]]


def _is_plain(value: Any, depth: int = 3) -> bool:
    """A number, string or ``None``, or a list / tuple / dict of them: state a forward may
    update that copying cannot detach from anything (a list of submodules is not plain)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if depth == 0 or not isinstance(value, (list, tuple, dict)):
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_is_plain(v, depth - 1) for v in items)


def plain_attributes(module: nn.Module) -> dict[str, dict[str, Any]]:
    """The plain attributes of every submodule (by path; ``training`` aside), as they are."""
    return {path: {k: v for k, v in vars(m).items()
                   if not k.startswith("_") and k != "training" and _is_plain(v)}
            for path, m in module.named_modules(remove_duplicate=False)}


def module_state(module: nn.Module) -> ModuleState:
    """A copy of ``module``'s state (see :class:`ModuleState`)."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers(remove_duplicate=False)}
    attributes = {path: copy.deepcopy(plain)
                  for path, plain in plain_attributes(module).items()}
    return ModuleState(buffers, attributes)


def restore_state(module: nn.Module, state: ModuleState) -> None:
    """Put ``state`` (taken from this module, or from the model it was planned from: same
    names) back into ``module``: buffer values copied in (in the buffer's own strides),
    attributes of the same name reset. Names ``module`` lacks are skipped."""
    with torch.no_grad():
        for name, b in module.named_buffers(remove_duplicate=False):
            saved = state.buffers.get(name)
            if saved is not None and saved.shape == b.shape and saved is not b:
                b.copy_(saved)
    for path, m in module.named_modules(remove_duplicate=False):
        for k, v in state.attributes.get(path, {}).items():
            if k in vars(m) and _is_plain(vars(m)[k]) and vars(m)[k] != v:
                m.__dict__[k] = copy.deepcopy(v)


@dataclass(frozen=True)
class Calls:
    """Two calls of a model from one state: each call's output, each call's inputs after it
    (a forward may change them in place), the buffers after both, and the element-wise
    random masks the first call drew (in a model in training mode: dropout)."""

    outputs: tuple[Any, Any]
    inputs_after: tuple[tuple[Any, ...], tuple[Any, ...]]
    buffers: dict[str, torch.Tensor]
    draws: tuple[Draw, ...] = ()


def call_twice(module: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None,
               device: torch.device, calls: int = 2) -> Calls:
    """``module`` called twice (``calls``: once; no grad, autocast for ``dtype``), each call
    on fresh copies of ``inputs`` from a fixed RNG state, element-wise dropout drawn in
    logical order, so two models in different layouts draw the same masks. The caller's RNG
    is left alone."""
    outputs, after, draws = [], [], []
    for i in range(calls):
        xs = clone_inputs(inputs)
        with seam(device).fork_rng(), _LayoutFreeDropout(module if i == 0 else None) as drawn:
            torch.manual_seed(SEED + i)
            with torch.no_grad(), autocast(device, dtype):
                outputs.append(detached(module(*xs)))
        after.append(xs)
        draws += drawn.draws
    buffers = {k: b.detach().clone() for k, b in module.named_buffers(remove_duplicate=False)}
    return Calls((outputs[0], outputs[-1]), (after[0], after[-1]), buffers, tuple(draws))


def check_semantics(want: Calls, got: Calls, dtype: torch.dtype | None, *,
                    inplace: tuple[str, ...] = ()) -> int:
    """Compare two calls of the planned model (``got``) with the original's (``want``),
    each from the caller's state: the second call's output (a forward that updates its own
    state), the inputs after each call (a forward that changes its input in place) and the
    buffers after both. Raises ``LayoutVerificationError`` saying which differs and why;
    returns the number of tensors compared. ``inplace``: the in-place ops on inputs the
    captured graph has (named when the inputs differ)."""
    rtol = tolerance(dtype)[0]
    count = 0
    for i in range(2):
        ok, err, n = compare(want.inputs_after[i], got.inputs_after[i], dtype)
        count += n
        if not ok:
            why = (f"it changes its input in place ({', '.join(inplace)})" if inplace else
                   "it changes its input in place")
            exc = LayoutVerificationError(
                f"after a call, the caller's input tensors differ between the planned model and "
                f"the original by {err:.3g} (relative): {why}, and the planned model converts "
                "that input to another format first, so the change lands on a copy. Make the "
                "op out of place in forward (x = x * 2 instead of x.mul_(2)), or pass inputs "
                "already in the format the plan gives them; the plan was not applied",
                cause=f"the caller's inputs differ after a call: {why}", inputs_changed=True)
            raise exc
    ok, err, n = compare(want.outputs[1], got.outputs[1], dtype)
    count += n
    if not ok:
        raise LayoutVerificationError(
            f"the planned model's second call differs from the original's second call by "
            f"{err:.3g} (relative; tolerance {rtol:g}), its first call matched: the forward "
            "depends on state it changes per call (a counter, a cache) that the captured graph "
            "holds as a constant. Keep such state in a registered buffer updated with tensor "
            "ops, or plan the stateless part of the model; the plan was not applied",
            cause="the second call differs")
    for name, w in want.buffers.items():
        g = got.buffers.get(name)
        if g is None:
            continue  # a buffer the plan does not hold (the original's is unchanged state)
        ok, err, _ = compare(w, g, dtype)
        count += 1
        if not ok:
            raise LayoutVerificationError(
                f"buffer {name!r} after two calls differs between the planned model and the "
                f"original by {err:.3g} (relative): the planned model updates the model's state "
                "differently; the plan was not applied; please report this with the model",
                cause=f"buffer {name} differs after two calls")
    return count


def verify_semantics(original: nn.Module, planned: nn.Module, inputs: tuple[Any, ...],
                     state: ModuleState, want: Calls, *, dtype: torch.dtype | None,
                     device: torch.device, inplace: tuple[str, ...] = (),
                     got: Calls | None = None) -> int:
    """``check_semantics`` of two calls of ``planned`` from ``state`` (``got``: those calls,
    made already) against ``want`` (the original's two calls from it), then
    ``check_parameters``. As for a training step, values
    beyond the dtype's tolerance pass only if float64 copies of both models, from the same
    state, agree within float32's: rounding (a train-mode BatchNorm amplifies it) is not a
    difference, a wrong state update is. Returns the tensors and parameters checked."""
    if got is None:
        restore_state(planned, state)
        got = call_twice(planned, inputs, dtype=dtype, device=device)
    try:
        count = check_semantics(want, got, dtype, inplace=inplace)
    except LayoutVerificationError as failure:
        restore_state(original, state)
        restore_state(planned, state)
        xs = float64(inputs)
        try:
            with float64_casts():
                want64 = call_twice(float64(original), xs, dtype=None, device=device)
                got64 = call_twice(float64(planned), xs, dtype=None, device=device)
        except RuntimeError:  # a dtype the model fixes otherwise: the mismatch stands
            raise failure from None
        count = check_semantics(want64, got64, torch.float32, inplace=inplace)
    return count + check_parameters(original, planned)


def state_changes(state: ModuleState, module: nn.Module) -> list[str]:
    """The buffers and attributes of ``module`` that differ from ``state`` (taken from it
    before it ran): what its forward changes per call."""
    changed = [k for k, b in module.named_buffers(remove_duplicate=False)
               if k in state.buffers and not torch.equal(state.buffers[k], b.detach())]
    for path, m in module.named_modules(remove_duplicate=False):
        saved = state.attributes.get(path, {})
        changed += [f"{path}.{k}" if path else k for k, v in saved.items()
                    if k in vars(m) and vars(m)[k] != v]
    return changed


def check_parameters(original: nn.Module, planned: nn.Module) -> int:
    """The planned model holds the original's parameters as the original does: every name,
    one tensor for names that share one (tied weights stay tied), the same
    ``requires_grad``. Raises ``LayoutVerificationError``; returns the parameters checked."""
    want = dict(original.named_parameters(remove_duplicate=False))
    got = dict(planned.named_parameters(remove_duplicate=False))
    missing = [k for k in want if k not in got]
    if missing:
        raise LayoutVerificationError(
            f"the planned model lacks the original's parameters {missing[:3]}: its state_dict "
            "would not load; the plan was not applied; please report this with the model",
            cause="parameters missing")
    groups: dict[int, list[str]] = {}
    for k, p in want.items():
        groups.setdefault(id(p), []).append(k)
    for names in groups.values():
        if len({id(got[k]) for k in names}) > 1:
            raise LayoutVerificationError(
                f"the original shares one parameter between {', '.join(names)} (tied weights); "
                "the planned model holds separate tensors for them, which a training step "
                "would update apart; the plan was not applied; please report this with the model",
                cause="tied weights untied")
    tied = {id(got[k]) for k in want}
    if len(tied) != len(groups):
        raise LayoutVerificationError(
            f"the planned model ties parameters the original keeps apart ({len(groups)} "
            f"parameters in the original, {len(tied)} planned); the plan was not applied",
            cause="parameters tied that were not")
    flipped = [k for k, p in want.items() if p.requires_grad != got[k].requires_grad]
    if flipped:
        raise LayoutVerificationError(
            f"the planned model's parameters {flipped[:3]} differ in requires_grad from the "
            "original's; the plan was not applied; please report this with the model",
            cause="requires_grad differs")
    return len(groups)


#: in-place operators of Python (``x += y`` traces to ``operator.iadd``)
_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                      "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}


def mutates_in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    """``n`` writes into its first argument: a trailing-underscore method or function
    (``x.mul_``, ``torch.relu_``), ``inplace=True``, an in-place operator (``x += 1``), or a
    module configured in place (``nn.ReLU(inplace=True)``)."""
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op not in ("call_method", "call_function"):
        return False
    if n.kwargs.get("inplace") is True:
        return True
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


def inplace_on_inputs(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that change one of its inputs in place: ``"mul_ (.mul_) on x"``."""
    found = []
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if isinstance(first, fx.Node) and first.op == "placeholder" and mutates_in_place(gm, n):
            found.append(f"{n.name} ({node_target_name(gm, n)}) on input {first.name}")
    return found
