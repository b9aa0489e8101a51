"""Predicted costs (L2 plan, costs): a layout node's seconds in each format from the analytical
model (``memlayout.plan.costs.analytical``), fitted to this machine's own cached measurements.

Every node measured here stores, beside its seconds, what the analytical model said (``"a"``),
its op kind (``"k"``: ``Conv2d:dense``, ``BatchNorm2d``, ``.mean``) and a pair id (``"id"``)
shared by its two formats' records. Per op kind and cost context (device, torch, dtype,
train, weights: the key's prefix), over this machine's quiet entries, the fit is

- ``r0``: the median of ``measured / analytical`` in contiguous format, and
- ``q``: the median of ``(m1 / m0) / (a1 / a0)``, how much more (or less) the
  channels-last run costs than the model says, taken from both formats of one measurement:
  the two move together with the machine, so their ratio spreads less than either.

A node then costs ``c0 = a0 * r0`` and ``c1 = c0 * (a1 / a0) * q``. Each factor's uncertainty
is ``Z`` robust standard deviations of its logs (1.4826 times their median absolute deviation:
a timing taken while another job held the cores is far off, and must not set the fit),
widened by ``sqrt(1 + 1/n)`` (an interval for one more sample, not for the centre); an op kind with fewer than ``MIN_SAMPLES`` pairs gets the
wide ``PRIOR_SIGMA``, so such nodes are measured unless the cut cannot depend on them.
:meth:`CostModel.predict` returns both seconds and ``width``: the largest change of
``c1 - c0`` (the only thing the cut reads) over the box of both factors.

>>> model = CostModel.fit([Sample("BatchNorm2d", 1e-3, 1e-4, 0.8e-3, 1e-4, "p")] * 5)
>>> guess = model.predict("BatchNorm2d", (2e-4, 2e-4))
>>> [round(s * 1e3, 3) for s in guess.seconds], guess.width > 0
([2.0, 1.6], True)
>>> model.predict("Conv2d:dense", (1e-3, 8e-4)).width > 1e-3  # no data: the wide prior
True
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import fx

from memlayout.plan.costs.analytical import _convolution_work, analytical_seconds
from memlayout.plan.graph import node_target_name
from memlayout.timing import centre_and_spread

#: standard deviations (of the log ratios) each prediction's interval spans either way
Z = 3.0
#: pairs of one op kind the fit needs before it trusts their spread
MIN_SAMPLES = 4
#: the log-space sigma of an op kind without enough samples: ``exp(Z * PRIOR_SIGMA)``, a
#: factor of 20 either way
PRIOR_SIGMA = 1.0
#: the smallest log-space sigma a fit keeps: two timings of one op differ by a few percent
SIGMA_FLOOR = 0.05


@dataclass(frozen=True)
class Sample:
    """One cached measurement in both formats: measured and analytical seconds."""

    kind: str
    m0: float
    a0: float
    m1: float
    a1: float
    pair: str


@dataclass(frozen=True)
class KindFit:
    """One op kind's fit: ``r0`` and ``q`` (module docstring), their log-space sigmas, and
    how many pairs they come from."""

    r0: float
    q: float
    sigma0: float
    sigma_q: float
    samples: int


@dataclass(frozen=True)
class Predicted:
    """A node's predicted seconds in each format (``None``: fails there) and ``width``: how
    far ``c1 - c0`` can be off within the fit's intervals (seconds; 0 when one format
    fails: the node is pinned, its costs decide nothing)."""

    seconds: tuple[float | None, float | None]
    width: float


@dataclass(frozen=True)
class CostModel:
    """The analytical model fitted per op kind to this machine's measurements."""

    kinds: Mapping[str, KindFit]
    prior_r0: float = 1.0  # over every kind: how fast this machine is, for an unseen kind

    @classmethod
    def fit(cls, samples: Iterable[Sample]) -> CostModel:
        """The fit of every op kind with a sample (the prior's where too few)."""
        by_kind: dict[str, dict[str, Sample]] = {}
        for s in samples:
            if min(s.m0, s.a0, s.m1, s.a1) > 0:
                by_kind.setdefault(s.kind, {})[s.pair] = s  # one pair counts once
        kinds: dict[str, KindFit] = {}
        everything: list[float] = []
        for kind, pairs in by_kind.items():
            logs0 = [math.log(s.m0 / s.a0) for s in pairs.values()]
            logs_q = [math.log((s.m1 / s.m0) / (s.a1 / s.a0)) for s in pairs.values()]
            everything += logs0
            n = len(logs0)
            centre0, sigma0 = centre_and_spread(logs0)
            centre_q, sigma_q = centre_and_spread(logs_q)
            if n < MIN_SAMPLES:
                kinds[kind] = KindFit(math.exp(centre0), math.exp(centre_q), PRIOR_SIGMA,
                                      PRIOR_SIGMA, n)
                continue
            widen = math.sqrt(1 + 1 / n)
            kinds[kind] = KindFit(
                math.exp(centre0), math.exp(centre_q),
                max(SIGMA_FLOOR, sigma0 * widen), max(SIGMA_FLOOR, sigma_q * widen), n)
        prior = math.exp(centre_and_spread(everything)[0]) if everything else 1.0
        return cls(kinds, prior)

    def predict(self, kind: str, analytic: tuple[float | None, float | None]) -> Predicted:
        """The seconds of a node of ``kind`` whose analytical seconds are ``analytic`` (``None``
        where the format fails), and the width of ``c1 - c0``."""
        fit = self.kinds.get(kind)
        if fit is None:
            fit = KindFit(self.prior_r0, 1.0, PRIOR_SIGMA, PRIOR_SIGMA, 0)
        a0, a1 = analytic
        if a0 is None or a1 is None:  # one format fails: pinned, its seconds decide nothing
            return Predicted((None if a0 is None else a0 * fit.r0,
                              None if a1 is None else a1 * fit.r0), 0.0)
        c0 = a0 * fit.r0
        rho = (a1 / a0 if a0 > 0 else 1.0) * fit.q
        delta = c0 * (rho - 1)
        corners = [c * (r - 1) for c, r in itertools.product(
            (c0 * math.exp(-Z * fit.sigma0), c0 * math.exp(Z * fit.sigma0)),
            (rho * math.exp(-Z * fit.sigma_q), rho * math.exp(Z * fit.sigma_q)))]
        width = max(abs(max(corners) - delta), abs(delta - min(corners)))
        return Predicted((c0, c0 * rho), width)


def op_kind(gm: fx.GraphModule, n: fx.Node) -> str:
    """What a node's fit is shared with: its op, and for a convolution whether it is dense,
    its kernel and its stride (``Conv2d:dense:3x3/1``).

    Each of those runs other kernels (a 1x1 convolution is a matrix product, a depthwise one
    reads one channel), so its ratio to the FLOP count is another one."""
    name = node_target_name(gm, n)
    work = _convolution_work(gm, n)
    if work is None:
        return name
    kind = f"{name}:{'dense' if work[1] else 'grouped'}"
    if n.op == "call_module":
        sub = gm.get_submodule(str(n.target))
        kind += f":{'x'.join(map(str, sub.kernel_size))}/{'x'.join(map(str, sub.stride))}"
    return kind


def analytic_pair(gm: fx.GraphModule, n: fx.Node, *,
                  train: bool) -> tuple[float, float]:
    """The analytical seconds of ``n`` in each format (a training step: about three times the
    forward)."""
    scale = 3.0 if train else 1.0
    return (scale * analytical_seconds(gm, n, 0), scale * analytical_seconds(gm, n, 1))


def pair_id(key: str) -> str:
    """The id both records of one measurement carry: a hash of the contiguous key."""
    return hashlib.sha1(key.encode()).hexdigest()[:16]


def samples_of(entries: Iterable[tuple[str, object]], context: Sequence[str]) -> list[Sample]:
    """The pairs among cached node ``entries`` (key, record) measured in ``context`` (the
    key's prefix after ``"node"``: device, torch, dtype, and train or weights where they
    apply), both formats present, each with its analytical seconds."""
    halves: dict[str, dict[int, tuple[str, float, float]]] = {}
    width = len(context)
    for key, record in entries:
        try:
            parts = json.loads(key)
        except ValueError:
            continue
        if (not isinstance(parts, list) or len(parts) != width + 3
                or parts[1:1 + width] != list(context) or not isinstance(record, dict)):
            continue
        label, s, a = parts[-1], record.get("s"), record.get("a")
        kind, pair = record.get("k"), record.get("id")
        if (label in (0, 1) and isinstance(s, (int, float)) and isinstance(a, (int, float))
                and isinstance(kind, str) and isinstance(pair, str)):
            halves.setdefault(pair, {})[label] = (kind, float(s), float(a))
    out = []
    for pair, both in halves.items():
        if 0 in both and 1 in both and both[0][0] == both[1][0]:
            (kind, m0, a0), (_, m1, a1) = both[0], both[1]
            out.append(Sample(kind, m0, a0, m1, a1, pair))
    return out
