"""One distributed training job three ways in one process: eager, ``torch.compile`` with
Inductor, and with memlayout's backend, as users run it: ``torch.compile(DDP(model),
backend=...)`` (DDP's optimizer splits the graph at its buckets), or FSDP2 with each block
compiled on its own and then ``fully_shard``-ed (``memlayout train --strategy fsdp
--compile``). Two ranks on the CPU, gloo, one thread each:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/backend/distributed.py --model benchmarks/real_models.py:smp_unet \\
        --strategy ddp

Each way is the same few SGD steps from the same weights, a batch of its own per rank
(channels-last, seeded by rank), and a target the same on both ranks per step (seeded):
cross-entropy on random classes for a ``(N, classes)`` output, else a mean-square loss against
a random tensor of the output's shape. Rank 0 prints one block: per way the first step's
seconds (the compile) and the median of the later steps; memlayout's graphs and how many it
planned; BackendWarnings; whether both ranks ran one plan per graph (digests gathered) and
which rank timed the costs; DDP's "Grad strides do not match bucket view strides" warnings
and the gradients not in their parameters' strides; the largest relative difference of the
parameters after the steps, memlayout against Inductor and Inductor against eager (the
tolerance of the job itself); and each way's distance from the same job run eagerly in float64,
which rounding alone cannot blur as it blurs the float32 ways' differences from each other.

The ways run memlayout, Inductor, eager, eager in float64, in that order: torch warns of grad strides once per
process, so the way that would warn first is memlayout's. memlayout's cost cache is a fresh
folder, and each way compiles into a fresh Inductor cache (``fresh_cache``: its folder and
its in-memory caches).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._inductor.utils import fresh_cache
from torch.nn.parallel import DistributedDataParallel

import memlayout
from memlayout.layout import Format
from memlayout.models import load_model
from memlayout.plan.compilers.backend import BackendWarning
from memlayout.tensors import iter_tensors, to_format
from memlayout.train.compiling import CompiledPlans, compile_blocks, compiled_plans, inductor
from memlayout.train.ddp import DistInfo, grad_layout_mismatches, init_distributed
from memlayout.train.fsdp import wrap_fsdp

#: (way, what ``torch.compile`` is given; ``None``: not compiled), in the order they run;
#: ``float64`` is eager in double precision: the reference each way's rounding is measured from
WAYS = (("memlayout", "memlayout"), ("inductor", "inductor"), ("eager", None), ("float64", None))
#: what torch says when a gradient and its DDP bucket disagree in layout (reducer.cpp)
GRAD_STRIDES = "Grad strides do not match bucket view strides"


@dataclass(frozen=True)
class Job:
    """The training job every way runs."""

    model: str
    strategy: str
    steps: int
    size: int
    batch: int
    lr: float
    timeout: float


@dataclass(frozen=True)
class WayResult:
    """One way's job on this rank: step seconds, warnings, and parameters after the steps."""

    way: str
    seconds: tuple[float, ...]
    backend_warnings: tuple[str, ...]
    grad_stride_warnings: int
    mismatched: tuple[str, ...]  # parameters whose gradient was not in their strides
    parameters: dict[str, torch.Tensor]
    error: str = ""  # the exception that stopped the way: its type and first line

    @property
    def later(self) -> float | None:
        return statistics.median(self.seconds[1:]) if len(self.seconds) > 1 else None


@dataclass(frozen=True)
class GraphSummary:
    """memlayout's graphs on this rank (``memlayout.backend_report()``)."""

    graphs: int
    planned: int
    ran: tuple[tuple[str, int], ...]
    fallbacks: tuple[str, ...]
    unplanned: tuple[str, ...]  # "graph: why not"


def step_input(example: Any, job: Job, fmt: Format, data: torch.Generator,
               dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    """The model's positional inputs for one step: its example's first image-like tensor
    drawn anew at ``(batch, C, ..., size, size)`` in ``fmt``, the rest as given (a timestep),
    floating tensors in ``dtype``."""
    args = example if isinstance(example, (tuple, list)) else (example,)
    out: list[Any] = []
    drawn = False
    for a in args:
        if not drawn and isinstance(a, torch.Tensor) and a.dim() in (4, 5):
            shape = (job.batch, *a.shape[1:-2], job.size, job.size)
            out.append(to_format(torch.randn(shape, generator=data).to(dtype), fmt))
            drawn = True
        else:
            out.append(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                       else a)
    if not drawn:
        raise SystemExit(f"{job.model}: no image-like (rank 4 or 5) input to draw")
    return tuple(out)


def loss_of(output: Any, targets: torch.Generator) -> torch.Tensor:
    """Cross-entropy against random classes for ``(N, classes)``, else a mean-square loss
    against a random tensor of the output's shape (a segmentation map, a UNet's sample)."""
    out = next(iter_tensors(output))
    if out.dim() == 2:
        return nn.functional.cross_entropy(
            out, torch.randint(0, out.shape[1], (out.shape[0],), generator=targets))
    return nn.functional.mse_loss(out, torch.randn(out.shape, generator=targets).to(out.dtype))


def run_way(way: str, backend: str | None, job: Job, info: DistInfo,
            scratch: Path) -> WayResult:
    """``job`` run one way on this rank, compiled (if at all) into a fresh Inductor cache
    under ``scratch``."""
    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    loaded = load_model(job.model, batch=job.batch, image_size=job.size, seed=0)
    dtype = torch.float64 if way == "float64" else torch.float32
    model = loaded.module.to(dtype).train()
    if job.strategy == "ddp":
        wrapped = DistributedDataParallel(model)
        run = torch.compile(wrapped, backend=backend) if backend else wrapped
    else:
        if backend:
            # as memlayout train does: Inductor under FSDP2 with each convolution's symbolic
            # stride fixed first (plain Inductor fails on blocks of one class with two strides)
            compile_blocks(model, inductor if backend == "inductor" else backend)
        run = wrap_fsdp(model, per_block=True)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr)
    data = torch.Generator().manual_seed(1 + info.rank)
    targets = torch.Generator().manual_seed(1000)
    torch.manual_seed(0)  # dropout: the same masks in every way
    seconds: list[float] = []
    mismatched: set[str] = set()
    error = ""
    with fresh_cache(dir=str(scratch)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(job.steps):
                args = step_input(loaded.example_input, job, loaded.fmt, data, dtype)
                start = time.perf_counter()
                loss_of(run(*args, **loaded.example_kwargs), targets).backward()
                if job.strategy == "ddp":
                    mismatched |= {m.split(" ")[0] for m in grad_layout_mismatches(model)}
                opt.step()
                opt.zero_grad()
                seconds.append(time.perf_counter() - start)
        except Exception as exc:  # both ranks fail alike (one graph, one plan): the next way runs
            error = f"{type(exc).__name__}: {first_line([str(exc)])}"
    messages = [(w.category, str(w.message)) for w in caught]
    parameters = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
                  for n, p in model.named_parameters()}
    return WayResult(
        way, tuple(seconds),
        tuple(m for c, m in messages if issubclass(c, BackendWarning)),
        sum(GRAD_STRIDES in m for _, m in messages), tuple(sorted(mismatched)),
        {} if error else parameters, error)


def graph_summary() -> GraphSummary:
    graphs = memlayout.backend_report().graphs
    ran = Counter(g.ran.value for g in graphs)
    return GraphSummary(len(graphs), sum(g.planned for g in graphs), tuple(sorted(ran.items())),
                        tuple(f"{g.graph}: {g.fallback}" for g in graphs if g.fallback),
                        tuple(f"{g.graph}: {g.reason}" for g in graphs if not g.planned))


def max_relative_difference(a: dict[str, torch.Tensor],
                            b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``max|a - b| / max|b|`` over the parameters, and which parameter."""
    worst, where = 0.0, ""
    for name, ref in b.items():
        scale = ref.abs().max().item() or 1.0
        diff = (a[name] - ref).abs().max().item() / scale
        if diff > worst:
            worst, where = diff, name
    return worst, where


def norm_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over all parameters as one vector: unlike the largest per-parameter
    difference, not led by a parameter whose few steps of gradients nearly cancel (a norm's
    bias at batch 2), which differ in any two summation orders."""
    diff = sum(float((a[n].double() - v.double()).square().sum()) for n, v in b.items())
    size = sum(float(v.double().square().sum()) for v in b.values())
    return (diff / size) ** 0.5 if size else 0.0


def first_line(messages: list[str]) -> str:
    return messages[0].splitlines()[0][:160] if messages else ""


def verdict(ours: float, tolerance: float) -> str:
    if ours <= tolerance:
        return "within"
    return f"BEYOND ({ours / tolerance:.2f}x)" if tolerance else "BEYOND"


def render(job: Job, ranks: list[list[WayResult]], graphs: list[GraphSummary],
           plans: CompiledPlans, caches: str) -> str:
    """Rank 0's block; ``ranks``: each rank's ways (only rank 0's with parameters)."""
    zero = {r.way: r for r in ranks[0]}
    size = f"{job.size}x{job.size}"
    lines = [f"distributed {job.strategy}: {job.model}, {len(graphs)} ranks (gloo, "
             f"{torch.get_num_threads()} thread each), batch {job.batch} per rank at {size} "
             f"channels-last, {job.steps} SGD steps; torch {torch.__version__}"]
    for way in ("eager", "inductor", "memlayout", "float64"):
        r = zero[way]
        if r.error:
            lines.append(f"  {way:10s} FAILED after {len(r.seconds)} steps: {r.error}")
            continue
        later = f"{r.later:8.3f} s" if r.later is not None else "       -"
        lines.append(f"  {way:10s} first step {r.seconds[0]:8.2f} s   later steps (median) "
                     f"{later}")
    g = graphs[0]
    ran = ", ".join(f"{k} {n}" for k, n in g.ran)
    lines.append(f"memlayout graphs (rank 0): {g.graphs}, planned {g.planned} (ran: {ran}); "
                 f"fallbacks {len(g.fallbacks)}" + (f", first: {g.fallbacks[0]}"
                                                    if g.fallbacks else ""))
    if g.unplanned:
        lines.append(f"  not planned: {'; '.join(u[:120] for u in g.unplanned)}")
    warned = [m for rank in ranks for r in rank if r.way == "memlayout"
              for m in r.backend_warnings]
    lines.append(f"BackendWarnings (both ranks): {len(warned)}"
                 + (f", first: {first_line(warned)}" if warned else ""))
    timed = [sum(gr[3] for gr in rank) for rank in plans.ranks]
    lines.append(f"plan digests equal on both ranks: {'yes' if plans.agree else 'NO'}; "
                 f"costs timed per rank: {', '.join(f'rank {i} {n}' for i, n in enumerate(timed))}")
    lines.append(f"  {plans.describe()}")
    strides = {way: sum(r.grad_stride_warnings for rank in ranks for r in rank
                        if r.way == way) for way, _ in WAYS}
    lines.append("grad-stride warnings (both ranks; torch warns once per process, ways ran "
                 "memlayout, inductor, eager, float64): "
                 + ", ".join(f"{w} {n}" for w, n in strides.items()))
    if job.strategy == "ddp":
        off = {way: sorted({m for rank in ranks for r in rank if r.way == way
                            for m in r.mismatched}) for way, _ in WAYS}
        lines.append("gradients not in their parameters' strides: "
                     + ", ".join(f"{w} {len(n)}" + (f" ({n[0]}, ...)" if n else "")
                                 for w, n in off.items()))
    ours_p, inductor_p, eager_p = (zero[w].parameters for w in ("memlayout", "inductor", "eager"))
    if not (ours_p and inductor_p and eager_p):
        lines.append("parameters: not compared (a way failed)")
        lines.append(f"caches: {caches}")
        return "\n".join(lines)
    ours, where = max_relative_difference(ours_p, inductor_p)
    tolerance, t_where = max_relative_difference(inductor_p, eager_p)
    lines.append(f"parameters after {job.steps} steps, max relative difference (max|a-b| / "
                 f"max|b| per parameter): memlayout vs inductor {ours:.2e} ({where}); inductor "
                 f"vs eager {tolerance:.2e} ({t_where}), the tolerance: {verdict(ours, tolerance)}")
    ours, tolerance = (norm_relative_difference(ours_p, inductor_p),
                       norm_relative_difference(inductor_p, eager_p))
    lines.append(f"  as one vector (||a-b|| / ||b||): memlayout vs inductor {ours:.2e}; inductor "
                 f"vs eager {tolerance:.2e}: {verdict(ours, tolerance)}")
    exact = zero["float64"].parameters
    if exact:  # each way's rounding from the same job in float64: well conditioned
        off = {w: norm_relative_difference(zero[w].parameters, exact)
               for w in ("eager", "inductor", "memlayout")}
        lines.append("  from the same job in float64 (||a-b|| / ||b||): " + ", ".join(
            f"{w} {d:.2e}" for w, d in off.items()) + f"; memlayout against the larger of the "
            f"others: {verdict(off['memlayout'], max(off['eager'], off['inductor']))}")
    lines.append(f"caches: {caches}")
    return "\n".join(lines)


def main(job: Job) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="memlayout-distributed-"))
    os.environ["MEMLAYOUT_CACHE_DIR"] = str(scratch / "memlayout")
    info = init_distributed("cpu", timeout=job.timeout)
    if not info.distributed:
        raise SystemExit("run under torchrun: python -m torch.distributed.run --standalone "
                         "--nproc-per-node 2 benchmarks/backend/distributed.py ...")
    mine: list[WayResult] = []
    summary = GraphSummary(0, 0, (), (), ())
    plans = CompiledPlans(((),))
    for way, backend in WAYS:
        mine.append(run_way(way, backend, job, info, scratch))
        if way == "memlayout":
            summary = graph_summary()
            plans = compiled_plans(0, info)  # a collective
    # the parameters stay on each rank: only rank 0's are compared (DDP and FSDP keep the
    # ranks' parameters equal)
    light = [WayResult(r.way, r.seconds, r.backend_warnings, r.grad_stride_warnings,
                       r.mismatched, {}, r.error) for r in mine]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, (light, summary))
    if info.is_main:
        ranks = [mine] + [list(ways) for ways, _ in gathered[1:]]
        caches = (f"fresh MEMLAYOUT_CACHE_DIR per rank; a fresh TORCHINDUCTOR_CACHE_DIR (and "
                  f"in-memory Inductor caches) per way, under {scratch}")
        print(render(job, ranks, [s for _, s in gathered], plans, caches), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def parse() -> Job:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a model spec: torchvision:NAME, timm:NAME or path/to/file.py:factory")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="DDP of the compiled model, or FSDP2 with each block compiled. "
                        "Default: ddp.")
    p.add_argument("--steps", type=int, default=3, help="SGD steps per way. Default: 3.")
    p.add_argument("--size", type=int, default=64,
                   help="image height and width (a model file's own input redrawn at it). "
                        "Default: 64.")
    p.add_argument("--batch", type=int, default=2, help="images per rank. Default: 2.")
    p.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate. Default: 0.05.")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds a rank waits in one collective (the others wait for rank 0's "
                        "measurement inside the first step). Default: 1800.")
    a = p.parse_args()
    return Job(a.model, a.strategy, a.steps, a.size, a.batch, a.lr, a.timeout)


if __name__ == "__main__":
    main(parse())
