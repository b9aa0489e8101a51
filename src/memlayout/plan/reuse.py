"""A verified plan stored for the model it was made for (L2 plan): a later ``optimize`` of the
same model on the same inputs' signature rebuilds it from the cost cache and verifies it
again, nothing captured, measured or guarded.

"The same model" is a :func:`fingerprint` taken before anything runs: every module's path,
class, train/eval mode, plain attributes (``semantics.plain_attributes``) and hook counts; the
code of every class in the tree that is not torch's own (each function's compiled code, so an
edited ``forward`` is another model); every parameter's and buffer's name, shape, strides,
dtype, device, ``requires_grad`` and ties; the inputs' shape signature; the planning options;
torch's version and memlayout's own code (:func:`own_code`). Values are not in it: a plan does
not depend on them, and the verification that runs on every reuse compares the rebuilt model
with the original on this call's weights. A stored plan that no longer verifies (code the
fingerprint cannot see changed: a helper function the forward calls) is dropped, and the model
is planned again from the start. A plan made on a busy machine is not read on a quiet one, as
the costs it was made from are not (:func:`remember`), and it is recalled only while the
guard's race it kept still stands (:func:`recall`).

>>> import torch
>>> from torch import nn
>>> net = nn.Sequential(nn.Conv2d(3, 4, 3))
>>> a = fingerprint(net, (torch.zeros(1, 3, 8, 8),), "options")
>>> b = fingerprint(nn.Sequential(nn.Conv2d(3, 4, 3)), (torch.zeros(1, 3, 8, 8),), "options")
>>> a == b, a == fingerprint(net, (torch.zeros(2, 3, 8, 8),), "options")
(True, False)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import marshal
import time
import typing
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memlayout.errors import LayoutVerificationError
from memlayout.plan.check.guard import reusable
from memlayout.plan.check.semantics import ModuleState, plain_attributes, restore_state
from memlayout.plan.check.verification import verify
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.graph import Label
from memlayout.plan.options import RunOptions
from memlayout.plan.report.clock import StepClock
from memlayout.plan.report.plan import Plan
from memlayout.plan.report.records import Verification, decode
from memlayout.plan.steer.build import Build, build
from memlayout.plan.steer.state import Formats, shape_signature
from memlayout.plan.steer.steering import Steering, planned_state

#: the first element of a stored plan's key in the cost cache (its form's version with it)
KIND = "plan"
FORM = 2
#: the options that do not change the plan (where the cache is, whether a stored plan is
#: taken, how progress is shown)
_NOT_THE_PLAN = ("cache", "refresh", "reuse", "progress")


@dataclasses.dataclass(frozen=True)
class Stored:
    """What rebuilds a verified plan: the plan, the steering of the model it kept (padding
    included), the format its inputs are converted to on entry, the strides it hands results
    back in, the one format of a model run entirely in one (``None``: the plan), and the
    forward's in-place changes of its inputs (what verification names)."""

    plan: Plan
    steering: Steering
    input_label: Label | None
    outputs: Formats
    label: Label | None
    inplace: tuple[str, ...]
    guard: str | None = None  # the guard's race's key in the cost cache (None: no race)

    def to_value(self) -> Any:
        """The record as plain JSON data: its ``dataclasses.asdict`` form."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_value(cls, value: Any) -> Stored:
        """The record :meth:`to_value` wrote (``PlanError`` naming the field for anything
        else)."""
        return typing.cast(Stored, decode(cls, value, cls.__name__))


def options_text(options: RunOptions) -> str:
    """The planning options that decide the plan, as text."""
    return repr([(f.name, getattr(options, f.name)) for f in dataclasses.fields(options)
                 if f.name not in _NOT_THE_PLAN])


def fingerprint(model: nn.Module, inputs: tuple[Any, ...], options: str) -> str:
    """What identifies ``model`` called on ``inputs`` and planned with ``options`` (their
    text) without running it (module docstring)."""
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        h.update(repr(parts).encode())

    add(FORM, torch.__version__, own_code(), options, shape_signature(inputs))
    codes: dict[type, str] = {}
    attributes = plain_attributes(model)
    for path, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        if cls not in codes:
            codes[cls] = _code(cls)
        plain = sorted(attributes[path].items())
        hooks = (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                 len(m._state_dict_hooks), len(getattr(m, "_backward_pre_hooks", {})))
        add(path, cls.__module__, cls.__qualname__, codes[cls], m.training, plain, hooks)
    first: dict[int, str] = {}
    for name, t in chain(model.named_parameters(remove_duplicate=False),
                         model.named_buffers(remove_duplicate=False)):
        tie = first.setdefault(id(t), name)
        add(name, tie, tuple(t.shape), t.stride() if t.layout == torch.strided else None,
            str(t.dtype), str(t.device), t.requires_grad)
    return h.hexdigest()


@functools.cache
def own_code() -> str:
    """memlayout's version and its source files' names, sizes and modification times: an
    upgraded or edited memlayout plans anew."""
    from memlayout import __version__

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        stat = path.stat()
        h.update(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}".encode())
    return h.hexdigest()


def _get(value: Any, name: str) -> Any:
    """``value.name``, or ``None`` (an object whose ``__getattr__`` raises anything)."""
    try:
        return getattr(value, name, None)
    except Exception:
        return None


def _code(cls: type) -> str:
    """A digest of the compiled code of every function the classes of ``cls``'s MRO define,
    torch's own classes left to torch's version."""
    h = hashlib.sha256()
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] == "torch":
            continue
        for name, attr in sorted(vars(klass).items()):
            for fn in (attr, _get(attr, "__func__"), _get(attr, "fget")):
                code = _get(fn, "__code__")
                if code is not None:
                    h.update(name.encode())
                    h.update(marshal.dumps(code))
                    break
    return h.hexdigest()


def key_of(print_: str) -> str:
    """The cost-cache key of the plan stored under fingerprint ``print_``."""
    return json.dumps([KIND, print_])


def recall(store: CostCache, key: str) -> Stored | None:
    """The plan stored under ``key`` where it stands as it was made: the guard's race it
    kept is one the guard would read from the cache now (``guard.reusable``). ``None``:
    none, a record of another form (the cache warns), or a race to time again: the model is
    planned again."""
    read: list[Stored] = []

    def parsed(v: Any) -> bool:  # parsed once, by the cache's validity check
        read.append(Stored.from_value(v))
        return True

    value = store.get(key, check=parsed)
    if value is None or not read:
        return None
    found = read[-1]
    guard = found.plan.guard
    if found.guard is not None and (
            guard is None or reusable(store, found.guard, guard.margin) is None):
        return None
    return found


def remember(store: CostCache, key: str, plan: Plan, built: Build,
             inplace: tuple[str, ...], guard: str | None) -> None:
    """Store the verified ``plan``, the build it kept and the key of the guard's race under
    ``key``, with the machine's conditions now: as a cost taken on a busy machine, a plan
    made on one is not read on a quiet one (it is planned again, its costs measured again)."""
    state = planned_state(built.model)
    assert state is not None
    stored = Stored(plan, built.steering, state.input_label, state.outputs[state.example],
                    built.label, inplace, guard)
    store.put(key, stored.to_value())


def rebuilt(reference: nn.Module, stored: Stored, example: tuple[Any, ...],
            options: RunOptions, state: ModuleState,
            clock: StepClock) -> tuple[Build, Verification] | str:
    """The stored plan's model, steered on a copy of ``reference`` and verified against it
    on ``example`` as a new plan is; the verification's failure, as text, where it no longer
    verifies (the caller plans again)."""
    with clock("guard"):  # steering a copy, as the guard's build does
        try:
            made = build(reference, stored.steering, options, outputs=stored.outputs,
                         input_label=stored.input_label, label=stored.label)
        except Exception as exc:  # a stored steering this model no longer takes
            return f"it does not steer: {type(exc).__name__}: {exc}"
    with clock("verify"):
        try:
            verification = verify(reference, made, example, options, state, stored.inplace)
        except LayoutVerificationError as failure:
            return failure.cause or str(failure)
    restore_state(made.module, state)
    return made, verification


@dataclasses.dataclass(frozen=True)
class Reused:
    """What the cost cache held for a model: the key its plan is stored under (``None``: no
    cache), the stored plan rebuilt and verified (``made``: the plan and its build; ``None``:
    plan the model), and the notes of the plan made instead (the stored one did not verify)."""

    key: str | None
    made: tuple[Plan, Build] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def reused(reference: nn.Module, inputs: tuple[Any, ...], store: CostCache | None,
           example: tuple[Any, ...], options: RunOptions, state: Any, clock: StepClock,
           start: float) -> Reused:
    """The plan stored for ``reference`` called on ``inputs``, rebuilt and verified again
    (with ``options.reuse``; the fingerprint timed as the capture it replaces)."""
    if store is None:
        return Reused(None)
    with clock("capture"):
        key = key_of(fingerprint(reference, inputs, options_text(options)))
    stored = recall(store, key) if options.reuse else None
    if stored is None:
        return Reused(key)
    made = rebuilt(reference, stored, example, options, state, clock)
    if isinstance(made, str):
        return Reused(key, notes=[stale_note(made)])
    built, verification = made
    for step in ("costs", "solve"):  # nothing measured or solved
        with clock(step):
            pass
    total = time.perf_counter() - start
    guard = stored.plan.guard  # its decision read from the cache, as the plan is
    plan = dataclasses.replace(
        stored.plan, verification=verification, measured=0, cached=0, planning_seconds=total,
        price=clock.price(total, measured=0, cached=0, ran=set()),
        guard=(dataclasses.replace(guard, source="cache")
               if guard is not None and guard.source == "measured" else guard),
        notes=[*stored.plan.notes, REUSED])
    return Reused(key, (plan, built))


#: what a reused plan says of itself
REUSED = ("the plan stored for this model (the same code, modules, parameters' shapes and "
          "formats, input signature, options, torch and memlayout) rebuilt from the cost "
          "cache and verified again: nothing captured, measured or guarded")


def stale_note(why: str) -> str:
    """What a plan says where the one stored for the same fingerprint no longer verified."""
    return (f"the plan stored for this model no longer verified ({why}): code the "
            "fingerprint does not read changed; planned again from the start")


__all__ = ["REUSED", "Reused", "Stored", "fingerprint", "key_of", "options_text", "rebuilt", "recall",
           "remember", "reused", "stale_note"]
