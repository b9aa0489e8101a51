"""What a steered module's boundary converts into (``memlayout.plan.steer.boundary``), checked
against the formats torch itself says a tensor is in, for tensors of rank 3, 4 and 5, in each
format they may come in, and shaped so that they are in both (C == 1, H == W == 1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from memlayout import Format
from memlayout.plan.graph import Label
from memlayout.plan.steer import boundary
from memlayout.plan.steer.boundary import (
    Boundary,
    convert_leaf,
    restride,
    storage_addresses,
    to_label,
)
from tests.support.formats import torch_formats

CONTIGUOUS, CHANNELS_LAST = int(Label.CONTIGUOUS), int(Label.CHANNELS_LAST)

#: the format a label means at each rank (what torch must then say the result is in)
FORMAT_OF_LABEL: dict[tuple[int, int], Format] = {
    (3, CONTIGUOUS): Format.CONTIGUOUS, (3, CHANNELS_LAST): Format.CHANNELS_LAST_1D,
    (4, CONTIGUOUS): Format.CONTIGUOUS, (4, CHANNELS_LAST): Format.CHANNELS_LAST,
    (5, CONTIGUOUS): Format.CONTIGUOUS, (5, CHANNELS_LAST): Format.CHANNELS_LAST_3D,
}

#: a shape of each rank in exactly one format whatever its strides (every dim longer than 1)
SHAPES: dict[int, tuple[int, ...]] = {3: (2, 3, 5), 4: (2, 3, 4, 5), 5: (2, 3, 4, 5, 6)}

#: shapes torch calls contiguous in both formats of their rank: nothing to convert
AMBIGUOUS: dict[str, tuple[int, ...]] = {
    "rank 3, C == 1": (2, 1, 5),
    "rank 3, L == 1": (2, 3, 1),
    "rank 4, C == 1": (2, 1, 4, 5),
    "rank 4, H == W == 1": (2, 3, 1, 1),
    "rank 5, C == 1": (2, 1, 3, 4, 5),
    "rank 5, D == H == W == 1": (2, 3, 1, 1, 1),
}


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its channels innermost in memory, made by torch's own permute and copy."""
    order = (0, *range(2, t.dim()), 1)
    inverse = sorted(range(t.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


def _every_other(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and values that is a strided slice: in no format."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    return wide[..., ::2]


#: the ways a tensor may come in: one per format, and one in neither
STARTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "channels last": _channels_last,
    "every other element": _every_other,
}


def in_label(t: torch.Tensor, label: int) -> bool:
    """``t`` is in ``label``'s format for its rank, as torch says."""
    return FORMAT_OF_LABEL[t.dim(), label] in torch_formats(t)


@pytest.mark.parametrize("label", [CONTIGUOUS, CHANNELS_LAST], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("start", STARTS.values(), ids=STARTS.keys())
@pytest.mark.parametrize("rank", SHAPES)
def test_a_leaf_of_the_planned_rank_converts_into_its_labels_format(
        rank: int, start: Callable[[torch.Tensor], torch.Tensor], label: int) -> None:
    t = start(torch.randn(SHAPES[rank]))
    out = convert_leaf(t, label, rank)
    assert in_label(out, label)
    assert not in_label(out, 1 - label)  # a shape with one format: it is that one alone
    assert torch.equal(out, t)
    # already in the format: the tensor itself, no copy
    assert (out is t) == in_label(t, label)


@pytest.mark.parametrize("label", [CONTIGUOUS, CHANNELS_LAST], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("start", [STARTS["contiguous"], STARTS["channels last"]],
                         ids=["contiguous", "channels last"])
@pytest.mark.parametrize("shape", AMBIGUOUS.values(), ids=AMBIGUOUS.keys())
def test_a_tensor_in_both_formats_is_not_copied(
        shape: tuple[int, ...], start: Callable[[torch.Tensor], torch.Tensor], label: int) -> None:
    t = start(torch.randn(shape))
    assert in_label(t, CONTIGUOUS) and in_label(t, CHANNELS_LAST)  # torch: in both
    assert to_label(t, label) is t
    (entered,), _ = Boundary(inputs=((0, label, t.dim()),)).enter((t,), {})
    assert entered is t
    assert Boundary(outputs=((0, label, t.dim()),)).exit(t) is t


#: what a leaf planned as a rank-4 tensor may be in another call: left as it comes
NOT_PLANNED: dict[str, Callable[[], Any]] = {
    "rank-5 tensor": lambda: torch.randn(SHAPES[5]),
    "rank-3 tensor": lambda: torch.randn(SHAPES[3]),
    "rank-2 tensor": lambda: torch.randn(3, 4),
    "number": lambda: 3,
    "None": lambda: None,
    "string": lambda: "mean",
}


@pytest.mark.parametrize("make", NOT_PLANNED.values(), ids=NOT_PLANNED.keys())
def test_a_leaf_not_of_the_planned_rank_is_left_as_it_comes(make: Callable[[], Any]) -> None:
    value = make()
    assert convert_leaf(value, CHANNELS_LAST, 4) is value
    (entered,), _ = Boundary(inputs=((0, CHANNELS_LAST, 4),)).enter((value,), {})
    assert entered is value


def test_a_rank_without_formats_is_never_converted() -> None:
    t = torch.randn(3, 4).t()  # not contiguous: to_label would have something to do
    assert to_label(t, CONTIGUOUS) is t and to_label(t, CHANNELS_LAST) is t


def test_enter_converts_each_planned_positional_leaf_into_its_rank_and_label() -> None:
    x3, x4, x5 = (torch.randn(SHAPES[r]) for r in (3, 4, 5))
    b = Boundary(inputs=((0, CHANNELS_LAST, 3), (1, CHANNELS_LAST, 4), (2, CHANNELS_LAST, 5)))
    (y3, y4, y5, flag), kwargs = b.enter((x3, x4, x5, 7), {})
    assert flag == 7 and kwargs == {}
    for x, y in ((x3, y3), (x4, y4), (x5, y5)):
        assert in_label(y, CHANNELS_LAST) and torch.equal(x, y)
    # the same call, planned at other positions: what was not planned stays the object given
    (z3, z4, z5, _), _ = Boundary(inputs=((1, CHANNELS_LAST, 4),)).enter((x3, x4, x5, 7), {})
    assert z3 is x3 and z5 is x5 and in_label(z4, CHANNELS_LAST)


def test_enter_converts_leaves_of_keyword_and_nested_arguments() -> None:
    a, b, skip = (torch.randn(SHAPES[4]) for _ in range(3))
    args, kwargs = ([a, b],), {"skip": skip, "scale": 2.0}
    leaves = pytree.tree_leaves((args, kwargs))
    at = {name: next(i for i, leaf in enumerate(leaves) if leaf is t)
          for name, t in (("b", b), ("skip", skip))}
    plan = Boundary(inputs=((at["b"], CHANNELS_LAST, 4), (at["skip"], CHANNELS_LAST, 4)))
    (pair,), entered = plan.enter(args, kwargs)
    assert isinstance(pair, list) and pair[0] is a
    assert in_label(pair[1], CHANNELS_LAST) and torch.equal(pair[1], b)
    assert in_label(entered["skip"], CHANNELS_LAST) and torch.equal(entered["skip"], skip)
    assert entered["scale"] == 2.0


def test_enter_leaves_a_call_with_fewer_leaves_than_planned_alone() -> None:
    x = torch.randn(SHAPES[4])
    (entered,), _ = Boundary(inputs=((1, CHANNELS_LAST, 4),)).enter((x,), {})
    assert entered is x


def test_a_boundary_with_nothing_planned_hands_back_the_call_itself() -> None:
    args, kwargs = (torch.randn(SHAPES[4]),), {"skip": torch.randn(SHAPES[4])}
    entered_args, entered_kwargs = Boundary().enter(args, kwargs)
    assert entered_args is args and entered_kwargs is kwargs
    output = (torch.randn(SHAPES[4]),)
    assert Boundary().exit(output) is output


#: results of a module: the planned leaf's position in them, and the structure
OUTPUTS: dict[str, tuple[Callable[[torch.Tensor], Any], int]] = {
    "alone": (lambda y: y, 0),
    "second of a tuple": (lambda y: (torch.randn(3), y), 1),
    "in a dict": (lambda y: {"logits": torch.randn(3), "features": y}, 1),
    "in a list in a tuple": (lambda y: ([torch.randn(3), y], 2.0), 1),
}


def _leaf(output: Any, position: int) -> Any:
    return pytree.tree_leaves(output)[position]


@pytest.mark.parametrize("label", [CONTIGUOUS, CHANNELS_LAST], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize(("wrap", "position"), OUTPUTS.values(), ids=OUTPUTS.keys())
@pytest.mark.parametrize("rank", SHAPES)
def test_exit_converts_the_planned_result_leaf(
        rank: int, wrap: Callable[[torch.Tensor], Any], position: int, label: int) -> None:
    y = STARTS["every other element"](torch.randn(SHAPES[rank]))  # in neither format
    output = wrap(y)
    out = Boundary(outputs=((position, label, rank),)).exit(output)
    assert type(out) is type(output)
    converted = _leaf(out, position)
    assert in_label(converted, label) and torch.equal(converted, y)
    others = [i for i in range(len(pytree.tree_leaves(output))) if i != position]
    assert all(_leaf(out, i) is _leaf(output, i) for i in others)


@pytest.mark.parametrize(("wrap", "position"), OUTPUTS.values(), ids=OUTPUTS.keys())
def test_exit_hands_back_a_returned_parameter_as_itself(
        wrap: Callable[[torch.Tensor], Any], position: int) -> None:
    weight = nn.Parameter(torch.randn(8, 3, 3, 3))  # contiguous: planned into channels last
    out = Boundary(outputs=((position, CHANNELS_LAST, 4),)).exit(wrap(weight))
    assert _leaf(out, position) is weight


def test_restride_hands_back_each_result_in_the_format_the_original_returned() -> None:
    y4, y5, y2 = torch.randn(SHAPES[4]), _channels_last(torch.randn(SHAPES[5])), torch.randn(2, 3)
    formats = ((0, CHANNELS_LAST, 4), (1, CONTIGUOUS, 5), (2, None, 2))
    out4, out5, out2 = restride((y4, y5, y2), formats)
    assert in_label(out4, CHANNELS_LAST) and torch.equal(out4, y4)
    assert in_label(out5, CONTIGUOUS) and torch.equal(out5, y5)
    assert out2 is y2  # label None: as it comes


def test_restride_of_another_structure_hands_back_the_inputs_format_but_views_of_inputs() -> None:
    # the original returned one feature map; this call (another flag, say) returns two tensors,
    # one of them a view of its input: that stays a view, the other goes to the input's format
    x = _channels_last(torch.randn(SHAPES[4]))
    made, view = torch.randn(SHAPES[4]), x[:, :2]
    out_made, out_view = restride((made, view), ((0, CONTIGUOUS, 4),), fallback=CHANNELS_LAST,
                                  keep=storage_addresses(x))
    assert in_label(out_made, CHANNELS_LAST) and torch.equal(out_made, made)
    assert out_view is view


def test_restride_hands_back_the_models_own_parameter_and_buffer_as_themselves() -> None:
    conv = nn.Conv2d(3, 8, 3)
    conv.register_buffer("mask", torch.randn(8, 3, 3, 3))
    formats = ((0, CHANNELS_LAST, 4), (1, CHANNELS_LAST, 4))
    weight, mask = restride((conv.weight, conv.mask), formats, own=conv)
    assert weight is conv.weight and mask is conv.mask
    # the same buffer's values, made by an op: an ordinary result, converted
    (copy_of_mask, _) = restride((conv.mask * 1, conv.weight), formats, own=conv)
    assert in_label(copy_of_mask, CHANNELS_LAST)


def test_these_checks_fail_for_a_boundary_that_converts_into_the_other_format(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar for the tests above: a conversion into the wrong format is seen."""
    real = boundary.to_label
    monkeypatch.setattr(boundary, "to_label", lambda t, label: real(t, 1 - label))
    for rank, shape in SHAPES.items():
        x = torch.randn(shape)
        (entered,), _ = Boundary(inputs=((0, CHANNELS_LAST, rank),)).enter((x,), {})
        assert not in_label(entered, CHANNELS_LAST)
        left = Boundary(outputs=((0, CONTIGUOUS, rank),)).exit(_channels_last(x))
        assert not in_label(left, CONTIGUOUS)


def _boundaries(model: nn.Module) -> dict[tuple[str, str], set[tuple[int, Label, int]]]:
    """Each steered module's leaves converted on the way in and out, as its boundary holds them."""
    found: dict[tuple[str, str], set[tuple[int, Label, int]]] = {}
    for path, m in model.named_modules():
        for b in getattr(m.__dict__.get("forward"), "boundaries", {}).values():
            for side, leaves in (("in", b.inputs), ("out", b.outputs)):
                if leaves:
                    found.setdefault((path, side), set()).update(leaves)
    return found


@pytest.mark.parametrize("saved", [False, True], ids=["planned", "applied from its JSON"])
def test_a_plans_conversions_are_boundaries_into_the_format_it_names(
        monkeypatch: pytest.MonkeyPatch, saved: bool) -> None:
    """Every conversion a plan lists (``plan.conversions``: module, side, leaves, format) is a
    leaf of that module's boundary converting into that format, and nothing else is: for the
    planned model and for the same plan applied from its JSON (``memlayout.apply``)."""
    import memlayout
    from memlayout.plan.costs import measure

    analytic = measure.analytical_seconds  # every node cheapest channels last
    monkeypatch.setattr(measure, "analytical_seconds", lambda gm, n, label: analytic(
        gm, n, label) * (1.0 if label == CHANNELS_LAST else 50.0))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = torch.randn(2, 3, 10, 10)  # contiguous: converted on the way in
    opt = memlayout.optimize(net, x, measure=False, cache=False, guard=False)
    if saved:
        opt = memlayout.apply(net, memlayout.Plan.from_json(opt.plan.to_json()), x)
    listed: dict[tuple[str, str], set[tuple[int, Label, int]]] = {}
    for c in opt.plan.conversions:
        listed.setdefault((c.module, c.side), set()).update(
            (position, Label.parse(c.to), rank) for position, rank in c.leaves)
    assert listed and _boundaries(opt) == listed
    for path, m in opt.named_modules():
        for b in getattr(m.__dict__.get("forward"), "boundaries", {}).values():
            for leaf in (*b.inputs, *b.outputs):
                assert isinstance(leaf, boundary.Leaf) and type(leaf.label) is Label
            for leaf in b.inputs:  # the boundary itself, entered with the leaf it converts
                args = tuple(_every_other(torch.randn(SHAPES[leaf.rank]))
                             for _ in range(leaf.position + 1))
                entered, _ = b.enter(args, {})
                assert in_label(entered[leaf.position], leaf.label), path
