"""How much faster the planned model is, honestly (L2 plan): the optimized model against eager
NCHW and eager NHWC copies of the original, interleaved round by round, and the lines that
show it, every ratio agreeing with the medians printed beside it.

>>> from memlayout.timing import interleaved
>>> ticks = iter([0.0, 1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 6.0])  # optimized 1 s, eager 2 s
>>> c = interleaved({"optimized": lambda: None, "eager_nchw": lambda: None}, rounds=2, warmup=0,
...                 clock=lambda: next(ticks))
>>> print("\\n".join(ModelComparison.of(c, "optimized", ("eager_nchw",)).lines("batch")))
 optimized: median   1000.0 ms per batch (spread 0 %)
eager_nchw: median   2000.0 ms per batch (spread 0 %)
optimized vs eager_nchw: 2.000x faster (eager_nchw / optimized median time; per-round ratios: median 2.000, range 2.000-2.000 over 2 rounds)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.layout import Format
from memlayout.machine import SPREAD_LIMIT, Conditions, busier, noisy
from memlayout.plan.check.guard import train_step
from memlayout.plan.inputs import example_inputs_of
from memlayout.plan.steer.steering import planned_state, prepare_inputs
from memlayout.tensors import convert_batch, convert_module, device_of
from memlayout.timing import Comparison, Ratio, interleaved


@dataclass(frozen=True)
class ModelComparison:
    """An interleaved comparison of ``base`` against ``others``: per other mode the ratio
    ``other time / base time`` (> 1: ``base`` is faster), and the conditions it ran under."""

    comparison: Comparison
    base: str
    others: tuple[str, ...]
    ratios: dict[str, Ratio]
    conditions: Conditions | None = None

    @classmethod
    def of(cls, c: Comparison, base: str, others: tuple[str, ...],
           conditions: Conditions | None = None) -> ModelComparison:
        ratios = {name: r for name in others if (r := c.ratio(name, base)) is not None}
        return cls(c, base, others, ratios, conditions)

    @property
    def noisy(self) -> bool:
        """Some mode's rounds spread more than ``SPREAD_LIMIT``, or the machine was busy."""
        spreads = [t.spread for t in self.comparison.modes.values() if t.ok]
        busy = self.conditions is not None and self.conditions.busy
        return busy or any(noisy(s) for s in spreads)

    def lines(self, unit: str) -> list[str]:
        """Each mode's median time, then ``base`` against each other mode: the ratio of the
        medians shown, with the per-round ratios' median and range; a warning when noisy."""
        c = self.comparison
        width = max(len(n) for n in (self.base, *self.others))
        out = []
        for name in (self.base, *self.others):
            t = c[name]
            if not t.ok:
                out.append(f"{name}: failed: {t.error}")
                continue
            out.append(f"{name:>{width}}: median {t.median * 1e3:8.1f} ms per {unit} "
                       f"(spread {100 * t.spread:.0f} %)")
        for name, r in self.ratios.items():
            word = "faster" if r.of_medians >= 1 else "slower"
            out.append(f"{self.base} vs {name}: {max(r.of_medians, 1 / r.of_medians):.3f}x {word} "
                       f"({name} / {self.base} median time; per-round ratios: median "
                       f"{r.median:.3f}, range {r.min:.3f}-{r.max:.3f} over {len(r.per_round)} "
                       "rounds)")
        if self.noisy:
            why = []
            spreads = {n: t.spread for n, t in c.modes.items() if t.ok and noisy(t.spread)}
            if spreads:
                why.append("rounds spread up to "
                           f"{100 * max(spreads.values()):.0f} % (above {100 * SPREAD_LIMIT:.0f} %)")
            if self.conditions is not None and self.conditions.busy:
                why.append(f"the machine was busy ({self.conditions.describe()})")
            out.append("warning: these figures are noisy: " + "; ".join(why)
                       + "; rerun on a quiet machine before trusting the ratios")
        return out


def compare_with_eager(model: nn.Module, optimized: nn.Module, example_inputs: Any, *,
                       rounds: int = 7, warmup: int = 1, train: bool = False) -> ModelComparison:
    """Time the optimized model against eager NCHW and eager NHWC copies of ``model``,
    interleaved round by round (``memlayout.timing.interleaved``), under the plan's autocast.
    All three get the same input (as the example, or in the plan's ``input_format``); the eager
    modes convert it to their format inside the timed call, as a user of them would.
    ``train``: each call is a training step (gradients cleared, forward, the loss
    ``memlayout.tensors.mean_square_loss``, backward outside autocast, ``SGD.step``) of the
    mode's own model in train mode; ``optimized`` is trained by it.
    """
    inputs = example_inputs_of(example_inputs)
    dtype = planned_state(optimized).dtype
    device = device_of(inputs, model)
    nchw = convert_module(copy.deepcopy(model).train(train), Format.CONTIGUOUS)
    nhwc = copy.deepcopy(model).train(train)
    convert_module(nhwc, Format.CHANNELS_LAST)
    convert_module(nhwc, Format.CHANNELS_LAST_3D)
    inputs = prepare_inputs(optimized, *inputs)

    def runner(module: nn.Module, fmt: Format | None) -> Callable[[], Any]:
        # Every mode gets the same input; an eager mode converts it as its user would.
        sgd = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-4) \
            if train else None

        def run() -> Any:
            xs = inputs
            if fmt is not None:
                xs = convert_batch(xs, fmt)
                if fmt is Format.CHANNELS_LAST:
                    xs = convert_batch(xs, Format.CHANNELS_LAST_3D)
            if sgd is not None:
                out = train_step(module, xs, dtype, device)()
                sgd.step()
                return out
            with torch.no_grad(), autocast(device, dtype):
                return module(*xs)
        return run

    conditions = Conditions.now()
    c = interleaved({"optimized": runner(optimized, None),
                     "eager_nchw": runner(nchw, Format.CONTIGUOUS),
                     "eager_nhwc": runner(nhwc, Format.CHANNELS_LAST)},
                    rounds=rounds, warmup=warmup, baseline="optimized",
                    sync=seam(device).synchronize)
    return ModelComparison.of(c, "optimized", ("eager_nchw", "eager_nhwc"),
                              busier(conditions, Conditions.now()))
