"""What the steered model really ran (L2 plan, after verification): the format of every module's
results against the plan's.

Inside a module's own code eager propagation decides the formats; the plan predicts them from
each op's measured behaviour. One run with a forward hook on every module whose results the
plan has a format for (every boundary a value leaves a once-called module through) compares
the two; where they differ the plan says so (``Plan.realized``), naming the module, the format
planned and the one that ran.

>>> from memlayout.tensors import format_of
>>> difference("layer1", 0, 1, torch.zeros(2, 3, 4, 4))
'layer1 result 0: planned channels_last, ran contiguous'
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from memlayout.plan.capture.calls import run_hooked
from memlayout.plan.graph import Label
from memlayout.plan.solve.boundaries import OUT
from memlayout.plan.solve.regions import Solution
from memlayout.tensors import format_of, in_format


def expected_results(solution: Solution) -> dict[str, dict[int, int]]:
    """The format the plan gives each result leaf of each module it steers or reads (by
    module path, then leaf position): the label outside the module's exit."""
    expected: dict[str, dict[int, int]] = {}
    for s in solution.regions:
        for c in s.form.crossings:
            if c.side == OUT and c.convertible:
                expected.setdefault(c.module, {}).update(
                    (p, s.labels[c.outer]) for p, _ in c.leaves)
    return expected


def realized_differences(module: nn.Module, inputs: tuple[Any, ...], solution: Solution, *,
                         dtype: torch.dtype | None, device: torch.device) -> list[str]:
    """Run ``module`` (the planned model as the planner calls it) once and list every result
    whose format is not the plan's (:func:`difference`)."""
    expected = expected_results(solution)
    found: list[str] = []
    handles = []
    modules = dict(module.named_modules())
    for path, leaves in expected.items():
        target = modules.get(path)
        if target is None:
            continue

        def hook(_m: nn.Module, _args: Any, output: Any, path: str = path,
                 leaves: dict[int, int] = leaves) -> None:
            flat = pytree.tree_leaves(output)
            for p, label in leaves.items():
                if p < len(flat):
                    text = difference(path, p, label, flat[p])
                    if text is not None and text not in found:
                        found.append(text)
        handles.append(target.register_forward_hook(hook))
    run_hooked(module, inputs, handles, dtype=dtype, device=device)
    return found


def difference(path: str, position: int, label: Label, value: Any) -> str | None:
    """What differs when the result ``value`` of the module at ``path`` is not in ``label``'s
    format (an ambiguous tensor is in both: no difference); ``None`` when it is."""
    if not isinstance(value, torch.Tensor) or value.dim() < 3:
        return None
    want = Label(label).format(value.dim())
    ran = format_of(value)
    if in_format(ran, want):
        return None
    ran_text = "no one format" if ran is None else ran.value if not isinstance(ran, frozenset) \
        else "/".join(sorted(f.value for f in ran))
    return (f"{path or 'the model'} result {position}: planned {Label(label).text}, "
            f"ran {ran_text}")
