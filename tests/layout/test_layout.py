"""L0 algebra against torch itself (the reference) and against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._prims_common as prims
from hypothesis import given, settings
from hypothesis import strategies as st

from memlayout.errors import LayoutError
from memlayout.layout import (
    Format,
    dim_order,
    formats_for_rank,
    formats_of,
    is_non_overlapping_and_dense,
    strides_for,
    strides_for_order,
)
from tests.support.formats import TORCH_FORMATS, torch_formats
from tests.support.strategies import shapes, strided_tensors

# torch renamed its Python mirror of c10's check; take whichever this build has.
_torch_nod = getattr(prims, "is_non_overlapping_and_dense", None) or prims.is_non_overlapping_and_dense_or_false




@settings(max_examples=400, deadline=None)
@given(strided_tensors())
def test_formats_of_agrees_with_torch(t):
    assert formats_of(t.shape, t.stride()) == torch_formats(t)


@settings(max_examples=200, deadline=None)
@given(shapes(min_rank=3, max_rank=5))
def test_strides_for_is_what_torch_allocates(shape):
    for fmt in formats_for_rank(len(shape)):
        if fmt is Format.CHANNELS_LAST_1D:
            n, c, length = shape
            expected = torch.empty(n, c, 1, length, memory_format=torch.channels_last).stride()
            expected = (expected[0], expected[1], expected[3])
        else:
            expected = torch.empty(shape, memory_format=TORCH_FORMATS[fmt]).stride()
        assert strides_for(shape, fmt) == expected, fmt
        assert fmt in formats_of(shape, strides_for(shape, fmt))


@settings(max_examples=300, deadline=None)
@given(strided_tensors())
def test_is_non_overlapping_and_dense_against_torch_and_brute_force(t):
    ours = is_non_overlapping_and_dense(t.shape, t.stride())
    assert ours == _torch_nod(t)
    if t.numel() > 0:
        offsets = sorted(
            sum(i * s for i, s in zip(idx, t.stride(), strict=True))
            for idx in itertools.product(*(range(n) for n in t.shape))
        )
        assert ours == (offsets == list(range(offsets[0], offsets[0] + t.numel())))


@settings(max_examples=300, deadline=None)
@given(shapes(max_size=3).flatmap(lambda s: st.tuples(st.just(s), st.permutations(range(len(s))))))
def test_dim_order_round_trips_dense_strides(case):
    shape, order = case
    strides = strides_for_order(shape, order)
    assert strides_for_order(shape, dim_order(shape, strides)) == strides


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(2, 5), min_size=1, max_size=5, unique=True).flatmap(
    lambda sizes: st.tuples(st.just(tuple(sizes)), st.permutations(range(len(sizes))))))
def test_dim_order_recovers_the_permutation_torch_made(case):
    sizes, order = case
    # Allocate dims in `order` (outermost first), then view them back in logical order.
    physical = torch.empty([sizes[d] for d in order])
    logical = physical.permute([list(order).index(d) for d in range(len(sizes))])
    assert tuple(logical.shape) == sizes
    assert dim_order(logical.shape, logical.stride()) == tuple(order)


@pytest.mark.parametrize("fmt", [Format.CHANNELS_LAST, Format.CHANNELS_LAST_3D, Format.CHANNELS_LAST_1D])
def test_canonical_strides_with_distinct_sizes_give_the_format_order(fmt):
    shape = tuple(range(2, 2 + fmt.rank))
    assert dim_order(shape, strides_for(shape, fmt)) == fmt.order(fmt.rank)


# The tutorial's and the design threads' worked examples: (shape, strides, formats).
CL, C, CL3, CL1 = Format.CHANNELS_LAST, Format.CONTIGUOUS, Format.CHANNELS_LAST_3D, Format.CHANNELS_LAST_1D
WORKED = [
    ((10, 3, 32, 32), (3072, 1024, 32, 1), {C}),            # tutorial: NCHW
    ((10, 3, 32, 32), (3072, 1, 96, 3), {CL}),              # tutorial: channels_last
    ((10, 3, 16, 16), (768, 1, 48, 3), {CL}),               # tutorial: 10x3x16x16
    ((4, 1, 4, 4), (16, 16, 4, 1), {C, CL}),                # tutorial: C == 1 is ambiguous
    ((4, 1, 4, 4), (16, 1, 4, 1), {C, CL}),                 # ... whichever strides it carries
    ((2, 3, 1, 1), (3, 1, 1, 1), {C, CL}),                  # H == W == 1
    ((1, 1, 1, 1), (1, 1, 1, 1), {C, CL}),                  # all ones
    ((2, 3, 4, 5), (60, 1, 3, 12), set()),                  # NCWH: neither
    ((2, 3, 4, 5), (60, 20, 1, 4), set()),                  # transposed H/W
    ((2, 3, 4, 5, 6), (360, 1, 90, 18, 3), {CL3}),          # NDHWC
    ((2, 8, 16), (128, 16, 1), {C}),
    ((2, 8, 16), (128, 1, 8), {CL1}),                       # N L C in memory
    ((2, 1, 16), (16, 16, 1), {C, CL1}),
    ((2, 0, 4, 5), (0, 1, 0, 0), {C, CL}),                  # torch's channels_last of a size-0
]


@pytest.mark.parametrize(("shape", "strides", "expected"), WORKED)
def test_worked_examples(shape, strides, expected):
    assert formats_of(shape, strides) == frozenset(expected)
    if len(shape) in (4, 5):
        t = torch.empty_strided(shape, strides)
        assert formats_of(shape, strides) == torch_formats(t)


def test_worked_canonical_strides():
    assert strides_for((10, 3, 32, 32), CL) == (3072, 1, 96, 3)
    assert strides_for((10, 3, 32, 32), C) == (3072, 1024, 32, 1)


def test_bad_rank_raises_layout_error_naming_shape_and_allowed_formats():
    with pytest.raises(LayoutError, match="rank-4.*got rank 3.*CONTIGUOUS, CHANNELS_LAST_1D"):
        strides_for((2, 3, 4), CL)


def test_format_parse_aliases():
    assert Format.parse("NHWC") is CL
    assert Format.parse("channels_last_3d") is CL3
    with pytest.raises(LayoutError, match="unknown memory format"):
        Format.parse("nchw16c")


def test_layout_does_not_import_torch():
    import ast
    import importlib.util
    from pathlib import Path

    tree = ast.parse(Path(importlib.util.find_spec("memlayout.layout").origin).read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
    assert not {m for m in modules if m.split(".")[0] == "torch"}, modules
    assert {m for m in modules if m.startswith("memlayout")} <= {"memlayout.errors"}


def test_mismatched_rank_is_an_error():
    with pytest.raises(ValueError, match="differ in rank"):
        formats_of((2, 3), (1,))
