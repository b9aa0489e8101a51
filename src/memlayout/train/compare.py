"""Layouts trained side by side in one process (L2 train, ``memlayout train --compare``):
one :class:`~memlayout.train.loop.Trainer` per layout, same initial weights and data order,
``log_every`` steps of each in turn through the one timer (``memlayout.timing.interleaved``).

>>> layout_of("nchw-again"), layout_of("planned")
('nchw', 'planned')
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from memlayout.devices import seam
from memlayout.errors import TrainError
from memlayout.timing import Comparison, interleaved
from memlayout.train.config import TrainConfig
from memlayout.train.ddp import DistInfo, collectives
from memlayout.train.loop import Event, Trainer, diverged, doing_step


@dataclass(frozen=True)
class LayoutComparison:
    """Layouts trained side by side in one process, interval by interval
    (``memlayout.timing.interleaved``): seconds per interval and the per-round ratios."""

    comparison: Comparison
    images_per_interval: int              # over all processes
    steps_per_interval: int
    final: dict[str, tuple[float, float]]  # layout -> (loss, top-1 %) of its last interval

    def images_per_second(self, layout: str) -> float:
        return self.images_per_interval / self.comparison[layout].median


#: ``--compare nchw,planned,nchw-again``: a second copy of a layout compared, trained exactly
#: as it is (its own model, same weights and data order): an A/A control, whose ratio to the
#: first copy is the run's noise floor
CONTROL_SUFFIX = "-again"


def layout_of(name: str) -> str:
    """The layout a ``--compare`` entry trains: ``nchw-again`` trains ``nchw``."""
    return name.removesuffix(CONTROL_SUFFIX)


def check_compare(layouts: list[str]) -> None:
    """``TrainError`` for a ``--compare`` list that cannot be run: fewer than two entries, a
    repeat, or an A/A control whose layout is not itself compared."""
    if len(layouts) < 2 or len(set(layouts)) != len(layouts):
        raise TrainError(f"--compare needs two or more different layouts, got {layouts}")
    alone = [n for n in layouts if n != layout_of(n) and layout_of(n) not in layouts]
    if alone:
        raise TrainError(f"--compare: {', '.join(alone)} is a second copy of a layout (an A/A "
                         f"control) that is not itself compared; add {layout_of(alone[0])}")


def run_steps(trainer: Trainer, n: int) -> tuple[float, float]:
    """``n`` steps of ``trainer``; returns the mean loss and the top-1 % over their images
    (this process)."""
    losses, correct = [], []
    for _ in range(n):
        with collectives(trainer.dist, trainer.config.timeout, doing_step(trainer)):
            loss, c = trainer.train_step(*trainer.next_batch())
        losses.append(loss)
        correct.append(c)
    loss = torch.stack(losses).mean().item()
    if not math.isfinite(loss):
        raise diverged(trainer, torch.stack(losses).tolist())
    return loss, 100.0 * torch.stack(correct).sum().item() / (n * trainer.config.batch)


def compare_layouts(config: TrainConfig, layouts: list[str], *, rounds: int = 7,
                    dist_info: DistInfo | None = None, on_event: Event | None = None,
                    on_step: Callable[[int, str], None] | None = None) -> LayoutComparison:
    """Train one model per layout (same initial weights and data order), alternating
    ``config.log_every`` steps of each, ``rounds`` timed rounds after one warm-up interval;
    the first layout is the baseline of the ratios. ``LAYOUT-again`` (e.g. ``nchw-again``)
    is a second copy of a layout also compared: an A/A control. Under torchrun every rank
    runs the same order, so DDP's collectives line up."""
    check_compare(layouts)
    info = dist_info or DistInfo()
    base = replace(config, checkpoint=None, resume=False, max_steps=None)
    trainers = {}
    for layout in layouts:
        if on_event is not None:
            on_event(f"building {layout}")
        trainers[layout] = Trainer(replace(base, layout=layout_of(layout)), info, on_event)
    final: dict[str, tuple[float, float]] = {}

    def interval(layout: str) -> Callable[[], None]:
        def run() -> None:
            final[layout] = run_steps(trainers[layout], config.log_every)
        return run

    c = interleaved({name: interval(name) for name in layouts}, rounds=rounds, warmup=1,
                    baseline=layouts[0], sync=seam(trainers[layouts[0]].device).synchronize,
                    on_step=on_step)
    return LayoutComparison(c, config.log_every * config.batch * info.world_size,
                            config.log_every, final)


__all__ = ["CONTROL_SUFFIX", "LayoutComparison", "check_compare", "compare_layouts", "layout_of",
           "run_steps"]
