"""Hypothesis strategies shared by the layout tests: real torch tensors with odd strides."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def shapes(draw, min_rank: int = 1, max_rank: int = 5, max_size: int = 4):
    rank = draw(st.integers(min_rank, max_rank))
    return tuple(draw(st.lists(st.integers(0, max_size), min_size=rank, max_size=rank)))


@st.composite
def strided_tensors(draw, min_rank: int = 1, max_rank: int = 5):
    """A tensor built the ways real code builds them: allocate in some dim order, then
    optionally slice with a step, and optionally expand a size-1 dim (stride 0)."""
    shape = draw(shapes(min_rank, max_rank))
    rank = len(shape)
    perm = draw(st.permutations(range(rank)))
    base = torch.arange(max(1, _numel([shape[p] for p in perm])), dtype=torch.float32)
    base = base[: _numel([shape[p] for p in perm])].reshape([shape[p] for p in perm])
    inverse = [perm.index(d) for d in range(rank)]
    t = base.permute(inverse)
    kind = draw(st.sampled_from(["dense", "dense", "slice", "expand"]))
    if kind == "slice" and rank:
        d = draw(st.integers(0, rank - 1))
        step = draw(st.integers(1, 2))
        t = t.narrow(d, 0, t.shape[d]).__getitem__((slice(None),) * d + (slice(None, None, step),))
    elif kind == "expand" and rank:
        d = draw(st.integers(0, rank - 1))
        if t.shape[d] == 1:
            size = list(t.shape)
            size[d] = draw(st.integers(1, 3))
            t = t.expand(size)
    return t


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
