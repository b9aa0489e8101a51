"""The planner's one label type (L2 plan): a value's format in its two-format choice.

A label is contiguous or channels-last; which ``Format`` channels-last is depends on the
tensor's rank (``channels_last_1d`` / ``channels_last`` / ``channels_last_3d``). As an
``IntEnum`` it is also the 0 / 1 the min-cut solver (``memlayout.plan.solve.mincut``) works with.

>>> Label.CHANNELS_LAST.format(5), Label(0).format(4)
(<Format.CHANNELS_LAST_3D: 'channels_last_3d'>, <Format.CONTIGUOUS: 'contiguous'>)
>>> Label.parse("channels_last_3d"), Label.CHANNELS_LAST.text
(<Label.CHANNELS_LAST: 1>, 'channels_last')
"""

from __future__ import annotations

import enum

from memlayout.layout import Format, channels_last_for_rank


class Label(enum.IntEnum):
    CONTIGUOUS = 0
    CHANNELS_LAST = 1

    @property
    def text(self) -> str:
        """The name a plan shows and stores: ``contiguous`` or ``channels_last``."""
        return self.name.lower()

    def format(self, rank: int) -> Format:
        """The ``Format`` this label means for a tensor of ``rank`` dims (contiguous for a
        rank without a channels-last format)."""
        if self is Label.CHANNELS_LAST:
            fmt = channels_last_for_rank(rank)
            if fmt is not None:
                return fmt
        return Format.CONTIGUOUS

    @classmethod
    def parse(cls, fmt: str | Format | Label) -> Label:
        """The label of a format (any channels-last rank is ``CHANNELS_LAST``) or of its name;
        ``LayoutError`` (from ``Format.parse``) for a name that is no format."""
        if isinstance(fmt, Label):
            return fmt
        return cls.CONTIGUOUS if Format.parse(fmt) is Format.CONTIGUOUS else cls.CHANNELS_LAST


LABELS = (Label.CONTIGUOUS, Label.CHANNELS_LAST)
