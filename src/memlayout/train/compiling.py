"""``memlayout train --compile`` (L2 train): the model compiled in place (by Inductor, or with
memlayout's backend), and, after a run compiled with the backend, which ranks measured and
whether every rank ran one plan per graph.

With the backend under torchrun, each graph is measured and decided by rank 0 alone and every
rank compiles that plan (``memlayout.plan.compilers.backend_shared``); the ranks wait for rank
0's measurement inside their first step, so a long one needs a longer ``--timeout``.

>>> CompiledPlans(((("0/0", "8667d5d7eaeb", 0, 9),), (("0/0", "8667d5d7eaeb", 0, 0),))).describe()
'memlayout backend: 1 graph, decided by rank 0 (9 costs timed there, 0 on the other ranks); every rank runs the same plan for each graph'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import fx, nn

from memlayout.train.ddp import DistInfo

#: ``--compile``: none, torch.compile (Inductor), torch.compile with memlayout's backend
COMPILES = ("none", "inductor", "backend")

#: one graph on one rank: (Dynamo's compile id, the plan's digest, the rank that decided it
#: or ``None``, the timings this rank took for it)
Graph = tuple[str, str, int | None, int]


def compile_model(model: nn.Module, how: str, *, measure: bool, per_block: bool = False) -> None:
    """``model`` compiled in place (``nn.Module.compile``: its parameters, names and
    ``state_dict`` unchanged) before DDP or FSDP wraps it: by Inductor (``"inductor"``), with
    memlayout's backend (``"backend"``: ``memlayout.backend(measure=measure)``), or not at all
    (``"none"``). Under DDP its graphs are split at the gradient buckets (Dynamo's DDP
    optimizer), as for ``torch.compile`` of the wrapped model, and a model whose ``forward``
    is torch's own (``nn.Sequential``) is compiled too.

    ``per_block`` (FSDP2): each block of ``memlayout.train.fsdp.shard_groups`` compiled on its
    own, what runs outside the blocks (a stem, a head) left eager. ``fully_shard`` of each
    block (``wrap_fsdp(..., per_block=True)``) then puts FSDP's all-gather and its hooks
    around the block's compiled forward, outside its graph: one graph per block, planned
    like any graph.

    >>> from torch import nn
    >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    >>> compile_model(net, "inductor", measure=False, per_block=True)
    >>> [net[i]._compiled_call_impl is not None for i in (0, 2)], net._compiled_call_impl
    ([True, True], None)
    """
    if how == "none":
        return
    # under FSDP2, blocks of one class with other strides need their strides fixed first
    backend: Any = inductor if per_block else "inductor"
    if how == "backend":
        from memlayout.plan.compilers.backend import Backend

        backend = Backend(measure=measure, shared_plan=True)  # every rank compiles it
    if per_block:
        compile_blocks(model, backend)
    else:
        model.compile(backend=backend)


def inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
    """``torch.compile``'s own backend, Inductor, each convolution's symbolic stride,
    padding, dilation and groups fixed at its example value first
    (``backend_graphs.fix_convolution_arguments``, as memlayout's backend does): blocks of one
    class with different strides under FSDP2 otherwise fail inside Inductor, on the training
    BatchNorm after the convolution ("Cannot convert expression to float")."""
    from torch._inductor.compile_fx import compile_fx

    from memlayout.plan.compilers.backend_graphs import fix_convolution_arguments

    fix_convolution_arguments(gm)
    return compile_fx(gm, example_inputs)


def compile_blocks(model: nn.Module, backend: Any) -> None:
    """Each block of ``model`` (``memlayout.train.fsdp.shard_groups``) compiled in place with
    ``backend``, the rest of ``model`` left as it is."""
    from memlayout.train.fsdp import shard_groups

    for name, _ in shard_groups(model):
        model.get_submodule(name).compile(backend=backend)


def graphs_so_far() -> int:
    """How many graphs the backend has compiled in this process (the start of a run's)."""
    from memlayout.plan.compilers.backend_report import backend_report

    return len(backend_report().graphs)


@dataclass(frozen=True)
class CompiledPlans:
    """The graphs the backend compiled in a run, as each rank recorded them (in rank order;
    one process: its own alone)."""

    ranks: tuple[tuple[Graph, ...], ...]

    @property
    def agree(self) -> bool:
        """Every rank ran the same plan (digest) for each graph."""
        first = [g[1] for g in self.ranks[0]]
        return all([g[1] for g in r] == first for r in self.ranks)

    def describe(self) -> str:
        first = self.ranks[0]
        if not any(self.ranks):
            return "memlayout backend: no graph compiled in this run"
        deciders = sorted({g[2] for g in first if g[2] is not None})
        who = (f"decided by rank {', '.join(map(str, deciders))}" if deciders
               else "decided in this process")
        text = (f"memlayout backend: {len(first)} graph{'s' if len(first) != 1 else ''}, "
                f"{who} ({sum(g[3] for g in first)} costs timed there")
        if len(self.ranks) == 1:
            return text + ")"
        text += f", {sum(g[3] for r in self.ranks[1:] for g in r)} on the other ranks)"
        if self.agree:
            return text + "; every rank runs the same plan for each graph"
        if any(len(r) != len(first) for r in self.ranks):
            return text + ("; the ranks compiled different graphs "
                           "(memlayout.backend_report() on each rank names them)")
        differ = sorted({a[0] for r in self.ranks[1:] for a, b in zip(first, r, strict=True)
                         if a[1] != b[1]})
        return (text + f"; the ranks run different plans for graph {', '.join(differ)} "
                "(memlayout.backend_report() on each rank says why)")


def compiled_plans(since: int, info: DistInfo) -> CompiledPlans:
    """The backend's graphs compiled after the first ``since`` of this process, gathered from
    every rank (a collective under torchrun)."""
    from memlayout.plan.compilers.backend_report import backend_report

    mine = tuple((g.graph, g.digest, g.decided_by, g.measured)
                 for g in backend_report().graphs[since:])
    if not info.distributed:
        return CompiledPlans((mine,))
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, mine)
    return CompiledPlans(tuple(tuple(tuple(g) for g in r) for r in gathered))


__all__ = ["COMPILES", "CompiledPlans", "compile_blocks", "compile_model", "compiled_plans",
           "graphs_so_far"]
