"""Pure stride algebra on ``(shape, strides)`` tuples. No torch import: this is L0.

The rules mirror PyTorch's own (``c10/core/Contiguity.h``, ``TensorImpl::refresh_contiguous``):
a dimension of size 1 does not constrain its stride, and a tensor with no elements is
contiguous. Channels-last-1d (N, C, L stored as N, L, C) has no torch counterpart; it follows
the same rule with the dimension order (N, L, C).

>>> strides_for((10, 3, 32, 32), Format.CHANNELS_LAST)
(3072, 1, 96, 3)
>>> sorted(f.name for f in formats_of((4, 1, 4, 4), (16, 16, 4, 1)))
['CHANNELS_LAST', 'CONTIGUOUS']
>>> dim_order((10, 3, 32, 32), (3072, 1, 96, 3))
(0, 2, 3, 1)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from functools import lru_cache

Shape = tuple[int, ...]
Strides = tuple[int, ...]


class Format(enum.Enum):
    """A memory format: which dimension order the strides encode.

    ``rank`` is the tensor rank the format applies to (``None``: any rank), ``order`` the
    dimension order from outermost to innermost (``None`` for CONTIGUOUS: the identity).
    """

    CONTIGUOUS = "contiguous"
    CHANNELS_LAST = "channels_last"
    CHANNELS_LAST_3D = "channels_last_3d"
    CHANNELS_LAST_1D = "channels_last_1d"

    @property
    def rank(self) -> int | None:
        return _RANK[self]

    def order(self, rank: int) -> tuple[int, ...]:
        """Dimension order, outermost first, for a tensor of ``rank`` dims.

        >>> Format.CHANNELS_LAST.order(4)
        (0, 2, 3, 1)
        """
        check_rank(rank, self)
        if self is Format.CONTIGUOUS:
            return tuple(range(rank))
        return (0, *range(2, rank), 1)

    @classmethod
    def parse(cls, name: str | Format) -> Format:
        """``Format`` from its value or name, case-insensitive (``"channels_last"``, ``"NHWC"``)."""
        if isinstance(name, Format):
            return name
        key = str(name).strip().lower()
        fmt = _ALIASES.get(key)
        if fmt is None:
            from memlayout.errors import LayoutError

            known = ", ".join(sorted(_ALIASES))
            raise LayoutError(f"unknown memory format {name!r}; known: {known}")
        return fmt

    def __str__(self) -> str:
        return self.value


_RANK: dict[Format, int | None] = {
    Format.CONTIGUOUS: None,
    Format.CHANNELS_LAST: 4,
    Format.CHANNELS_LAST_3D: 5,
    Format.CHANNELS_LAST_1D: 3,
}

_ALIASES: dict[str, Format] = {
    **{f.value: f for f in Format},
    **{f.name.lower(): f for f in Format},
    "nchw": Format.CONTIGUOUS,
    "ncdhw": Format.CONTIGUOUS,
    "ncl": Format.CONTIGUOUS,
    "nhwc": Format.CHANNELS_LAST,
    "ndhwc": Format.CHANNELS_LAST_3D,
    "nlc": Format.CHANNELS_LAST_1D,
}


def formats_for_rank(rank: int) -> tuple[Format, ...]:
    """Every format a tensor of ``rank`` dims can be in.

    >>> [f.name for f in formats_for_rank(4)]
    ['CONTIGUOUS', 'CHANNELS_LAST']
    """
    return tuple(f for f in Format if f.rank is None or f.rank == rank)


def channels_last_for_rank(rank: int) -> Format | None:
    """The channels-last format of ``rank`` (3, 4 or 5), else ``None``."""
    return next((f for f in Format if f.rank == rank), None)


def check_rank(rank: int, fmt: Format) -> None:
    """Raise ``LayoutError`` when ``fmt`` does not apply to tensors of ``rank`` dims."""
    if fmt.rank is not None and fmt.rank != rank:
        from memlayout.errors import LayoutError

        allowed = ", ".join(f.name for f in formats_for_rank(rank))
        raise LayoutError(
            f"{fmt.name} needs a rank-{fmt.rank} tensor, got rank {rank}; "
            f"a rank-{rank} tensor can be: {allowed}"
        )


@lru_cache(maxsize=4096)
def _strides_for_order(shape: Shape, order: tuple[int, ...], clamp: bool = True) -> Strides:
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        # not ``*=``: under a jit trace sizes are traced values, and ``*=`` updates one in place
        step = step * (max(shape[d], 1) if clamp else shape[d])
    return tuple(strides)


def strides_for_order(shape: Sequence[int], order: Sequence[int]) -> Strides:
    """Dense strides that lay ``shape`` out in dimension ``order`` (outermost first).

    >>> strides_for_order((2, 3, 4), (0, 2, 1))
    (12, 1, 3)
    """
    shape, order = tuple(shape), tuple(order)
    if sorted(order) != list(range(len(shape))):
        raise ValueError(f"order {order} is not a permutation of the {len(shape)} dims of {shape}")
    return _strides_for_order(shape, order)


def strides_for(shape: Sequence[int], fmt: Format) -> Strides:
    """Canonical strides of ``shape`` in ``fmt``: what ``torch.empty(shape, memory_format=...)``
    gives. As in torch, CONTIGUOUS counts a size-0 dim as size 1 when multiplying strides and
    the channels-last formats do not (``torch.empty(2, 0, 4, 5, memory_format=channels_last)``
    has strides ``(0, 1, 0, 0)``).

    >>> strides_for((10, 3, 32, 32), Format.CONTIGUOUS)
    (3072, 1024, 32, 1)
    >>> strides_for((2, 8, 16), Format.CHANNELS_LAST_1D)
    (128, 1, 8)
    """
    shape = tuple(shape)
    return _strides_for_order(shape, fmt.order(len(shape)), fmt is Format.CONTIGUOUS)


@lru_cache(maxsize=4096)
def _satisfies(shape: Shape, strides: Strides, order: tuple[int, ...]) -> bool:
    expected = 1
    for d in reversed(order):
        size = shape[d]
        if size != 1:
            if strides[d] != expected:
                return False
            expected *= size
    return True


def is_format(shape: Sequence[int], strides: Sequence[int], fmt: Format) -> bool:
    """Whether ``(shape, strides)`` is dense in ``fmt`` (``is_contiguous(memory_format=...)``).

    >>> is_format((4, 1, 4, 4), (16, 16, 4, 1), Format.CHANNELS_LAST)
    True
    """
    shape, strides = tuple(shape), tuple(strides)
    _check_pair(shape, strides)
    if fmt.rank is not None and fmt.rank != len(shape):
        return False
    if fmt is Format.CONTIGUOUS and 0 in shape:
        return True  # torch: a tensor with no elements is contiguous, whatever its strides
    return _satisfies(shape, strides, fmt.order(len(shape)))


def formats_of(shape: Sequence[int], strides: Sequence[int]) -> frozenset[Format]:
    """Every format the layout satisfies; empty when it satisfies none (a slice, a transpose).

    >>> sorted(f.name for f in formats_of((2, 3, 1, 1), (3, 1, 1, 1)))
    ['CHANNELS_LAST', 'CONTIGUOUS']
    >>> formats_of((2, 3, 4, 5), (60, 1, 3, 12))
    frozenset()
    """
    shape, strides = tuple(shape), tuple(strides)
    return frozenset(f for f in formats_for_rank(len(shape)) if is_format(shape, strides, f))


def dim_order(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """The dimension order (outermost to innermost) the strides encode.

    Larger stride is outer. Ties (size-1 and size-0 dims, broadcast dims with stride 0) are
    broken deterministically: a dim that spans more memory (larger size) is outer, then the
    lower index is outer. So canonical strides of every format give back that format's order.

    >>> dim_order((4, 1, 4, 4), (16, 1, 4, 1))
    (0, 2, 3, 1)
    >>> dim_order((4, 1, 4, 4), (16, 16, 4, 1))
    (0, 1, 2, 3)
    """
    shape, strides = tuple(shape), tuple(strides)
    _check_pair(shape, strides)
    return tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], -shape[d], d)))


def is_non_overlapping_and_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the elements exactly fill ``numel`` consecutive slots in some dim order
    (PyTorch's ``compute_non_overlapping_and_dense``).

    >>> is_non_overlapping_and_dense((2, 3), (1, 2))
    True
    >>> is_non_overlapping_and_dense((2, 3), (0, 1))
    False
    """
    shape, strides = tuple(shape), tuple(strides)
    if formats_of(shape, strides):
        return True  # as torch: contiguous in some format (an empty tensor is contiguous)
    if len(shape) == 1:
        return shape[0] < 2 or strides[0] == 1
    perm = sorted(range(len(shape)), key=lambda d: (shape[d] < 2, strides[d] if shape[d] >= 2 else 0))
    required = 1
    for d in perm:
        if shape[d] < 2:
            return True
        if strides[d] != required:
            return False
        required *= shape[d]
    return True


def _check_pair(shape: Shape, strides: Strides) -> None:
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in rank")
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative size")


def strides_agree(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Two stride tuples of a tensor of ``shape`` lay it out alike: equal on every dim of size
    > 1 (a size-1 dim's stride moves nothing; autograd's gradient layout contract compares
    strides the same way).

    >>> strides_agree((8, 4, 1, 1), (4, 1, 1, 1), (4, 1, 4, 4))
    True
    >>> strides_agree((8, 4, 3, 3), (36, 9, 3, 1), (36, 1, 12, 4))
    False
    """
    return all(s == 1 or x == y for s, x, y in zip(shape, a, b, strict=True))
