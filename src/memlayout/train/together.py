"""The planned model against the original one with every rank computing at once (L2 train).

The planner times its candidates in one process: under torchrun, rank 0 plans alone while
the other ranks wait. In training every rank computes at the same time, on cores, caches
and memory they share, and what one process measured alone does not always carry over: a
plan measured faster alone can run slower with every rank computing (figures and commands:
``docs/training.md``, "Timed with every rank computing").

So before a distributed run trains a plan made with measured costs, every rank times the
planned model and the original (eager NCHW, the model as built) on the example batch:
forward and backward, interleaved (``memlayout.timing.interleaved``), each call started
together after a barrier and ended by one, so that every timed call shares the machine as
training will. Rank 0 decides from its rounds and every rank keeps the same model. Both
models are left in the state they had (buffers, gradients, the RNG).

>>> check = TogetherCheck(Ratio(ORIGINAL, PLANNED, 1.2, (1.2, 1.1, 1.3)), world_size=2)
>>> str(check.kept), round(check.ratio.median, 2)
('planned', 1.2)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.errors import TrainError
from memlayout.plan.runners import Runner
from memlayout.tensors import mean_square_loss
from memlayout.timing import Race, Ratio, interleaved

#: timed rounds (each model once per round) and training steps per timed call
ROUNDS = 5
STEPS = 2
PLANNED, ORIGINAL = Runner.PLAN_EAGER, Runner.ORIGINAL_EAGER


@dataclass(frozen=True)
class TogetherCheck:
    """The ratio ``original time / planned time`` (> 1: the plan is faster) measured with
    ``world_size`` ranks computing at once, and the model kept: the plan when it was faster
    by more than ``memlayout.timing.KEEP_MARGIN`` in the median of the per-round ratios,
    else the original (near ties keep the model as built)."""

    ratio: Ratio
    world_size: int

    @property
    def kept(self) -> str:
        race = Race(ORIGINAL, {PLANNED: self.ratio}, rounds=len(self.ratio.per_round))
        return race.kept(ORIGINAL)

    def describe(self) -> str:
        """One line for the log: the ratio, its range, and what is trained."""
        what = ("the plan is trained" if self.kept == PLANNED else
                "the original model is trained instead, in NCHW (layout nchw): the plan, "
                "faster in one process alone, is not when every rank computes")
        r = self.ratio
        return (f"planned vs the original model with all {self.world_size} ranks computing at "
                f"once: {r.median:.3f}x (range {r.min:.3f}-{r.max:.3f}, "
                f"{len(r.per_round)} interleaved rounds of {STEPS} training steps); {what}")


def check_together(planned: nn.Module, original: nn.Module, planned_input: torch.Tensor,
                   original_input: torch.Tensor, *, world_size: int,
                   dtype: torch.dtype | None = None, rounds: int = ROUNDS,
                   clock: Callable[[], float] = time.perf_counter) -> TogetherCheck:
    """Time ``planned`` (on ``planned_input``, in its format) and ``original`` (on
    ``original_input``) with every rank of the default process group doing the same; rank
    0's ratios, shared with every rank. Both models come back in the state they were in."""
    device = planned_input.device
    saved = {name: (copy.deepcopy(m.state_dict()), m.training)
             for name, m in ((PLANNED, planned), (ORIGINAL, original))}

    def steps(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            for _ in range(STEPS):
                with autocast(device, dtype):
                    out = model(x)
                loss = mean_square_loss(out)
                if loss is not None:
                    loss.backward()
                model.zero_grad(set_to_none=True)
        return run

    device_done = seam(device).synchronize

    def together() -> None:  # before each clock read: every rank starts and ends each call at once
        device_done()
        dist.barrier()

    with seam(device).fork_rng():
        planned.train()
        original.train()
        c = interleaved({PLANNED: steps(planned, planned_input),
                         ORIGINAL: steps(original, original_input)},
                        rounds=rounds, warmup=1, baseline=ORIGINAL, sync=together, clock=clock)
    for name, m in ((PLANNED, planned), (ORIGINAL, original)):
        state, training = saved[name]
        m.load_state_dict(state)
        m.train(training)
        m.zero_grad(set_to_none=True)
    failed = [f"{name}: {c[name].error}" for name in (PLANNED, ORIGINAL) if not c[name].ok]
    if failed:
        raise TrainError(f"timing the plan with every rank computing failed ({'; '.join(failed)})")
    box: list[Any] = [c.ratio(ORIGINAL, PLANNED)]
    dist.broadcast_object_list(box, src=0)  # rank 0 decides for everyone
    if box[0] is None:
        raise TrainError("timing the plan with every rank computing gave no round to compare")
    return TogetherCheck(box[0], world_size)


__all__ = ["ORIGINAL", "PLANNED", "ROUNDS", "STEPS", "TogetherCheck", "check_together"]
