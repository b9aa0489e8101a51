"""The memlayout ``torch.compile`` backend under DDP: DDP's optimizer splits Dynamo's graph at
the gradient buckets, and every split graph is planned, compiled with the plan standing and
verified, with no warning; gradients come out in their parameters' strides (DDP's "Grad
strides do not match bucket view strides" never fires), and three SGD steps leave the
parameters that the same job compiled without memlayout leaves.

The model holds about 2.4 MB of weights: DDP's smallest bucket is 1 MB, so its optimizer
makes two split graphs. A 1x1 convolution fed a channels-last batch is the case DDP warns
about: its weight gradient comes out strided ``(C, 1, C, C)`` for a parameter strided
``(C, 1, 1, 1)``, which the eager job shows (the control). That gradient is oneDNN's, which
torch's CPU convolution takes with more than one thread: the jobs run with two.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import memlayout
from memlayout.plan.compilers.backend import BackendWarning
from memlayout.plan.runners import Runner
from tests.support.torchrun import LAYOUT_WARNINGS, run_worker

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Net(nn.Module):
    """Convolutions wide enough for two DDP buckets, on 8x8 images; ``widen`` is 1x1."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.widen = nn.Conv2d(32, 128, 1)
        self.body = nn.Sequential(*[m for _ in range(3)
                                    for m in (nn.Conv2d(128, 128, 3, padding=1), nn.ReLU())])
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(torch.relu(self.widen(self.stem(x))))
        return self.head(x.mean((2, 3)))


def job(backend: Any) -> dict[str, Any]:
    """Three SGD steps of ``Net`` in DDP (this process's group, a batch of its own per rank)
    compiled with ``backend``: the state after them, the warnings, and every parameter whose
    gradient was not in its own strides after a backward."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _steps(backend)
    finally:
        torch.set_num_threads(threads)


def _steps(backend: Any) -> dict[str, Any]:
    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    torch.manual_seed(0)
    model = Net()
    fast = torch.compile(DistributedDataParallel(model, bucket_cap_mb=1), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    mismatched: set[str] = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, 3, 8, 8, generator=data).contiguous(
                memory_format=torch.channels_last)
            y = torch.randint(0, 10, (4,), generator=data)
            nn.functional.cross_entropy(fast(x), y).backward()
            mismatched |= {name for name, p in model.named_parameters()
                           if p.grad is not None and p.grad.stride() != p.stride()}
            opt.step()
            opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "warnings": [(w.category, str(w.message)) for w in caught],
            "mismatched": sorted(mismatched)}


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


def test_every_ddp_split_graph_is_planned_compiled_and_trains_as_without_memlayout(
        one_member_group):
    # memlayout's job first: torch warns about bucket strides once per process
    planned = job(memlayout.backend(inner="inductor", measure=False, guard=False, cache=False))
    records = memlayout.backend_report().graphs
    reference = job("eager")

    assert [m for c, m in planned["warnings"] if issubclass(c, BackendWarning)] == []
    assert len(records) >= 2  # DDP's optimizer split the graph
    for r in records:
        assert r.planned and r.ran == Runner.PLAN_COMPILED and not r.fallback, r
        # a group of one: this process decides, and shares with nobody but itself
        assert (r.rank, r.decided_by) == (0, 0) and r.digest
        assert r.verification.startswith("the plan compiled vs the graph eagerly, gradients")
    # the 1x1 convolution runs channels-last: its weight gradient is the one DDP warns about
    assert ("widen", "channels_last") in {(c.where, c.planned) for r in records
                                         for c in r.convolutions}
    assert "widen.weight" in reference["mismatched"]  # the control
    assert planned["mismatched"] == []
    # torch warns once per process (an earlier test may have had it): the strides above are
    # the check that always holds
    assert not [m for _, m in planned["warnings"] if any(t in m for t in LAYOUT_WARNINGS)]

    start = _initial()
    assert any(not torch.equal(v, start[k]) for k, v in planned["state"].items())  # it trained
    for key, value in reference["state"].items():
        # channels-last and contiguous kernels differ in summation order only
        torch.testing.assert_close(planned["state"][key], value, rtol=1e-4, atol=1e-5)


WORKER = '''
import torch, torch.distributed as dist
import memlayout
from memlayout.plan.compilers.backend import BackendWarning
from tests.support.torchrun import LAYOUT_WARNINGS, finish_rank
from tests.train.test_backend_ddp import job

dist.init_process_group("gloo")
planned = job(memlayout.backend(inner="eager", measure=False, guard=False, cache=False))
records = memlayout.backend_report().graphs
reference = job("eager")
# channels-last and contiguous kernels differ in summation order only
close = all(torch.allclose(planned["state"][k], v, rtol=1e-4, atol=1e-5)
            for k, v in reference["state"].items())
layout = [[m for _, m in j["warnings"] if any(t in m for t in LAYOUT_WARNINGS)]
          for j in (planned, reference)]
out = {"backend_warnings": [m for c, m in planned["warnings"] if issubclass(c, BackendWarning)],
       "layout_warnings": layout[0], "control": layout[1], "mismatched": planned["mismatched"],
       "graphs": [[r.planned, r.ran, r.verification] for r in records], "close": close}
finish_rank(out)
'''


def test_two_ranks_plan_every_split_graph_without_layout_warnings(tmp_path):
    _, results = run_worker(WORKER, tmp_path)
    for r in results:
        assert r["backend_warnings"] == [] and r["layout_warnings"] == []
        assert len(r["graphs"]) >= 2
        assert all(planned and ran == Runner.PLAN_EAGER and how.startswith("the plan vs the graph")
                   for planned, ran, how in r["graphs"]), r["graphs"]
        # the control: torch warns once per process, and the job without memlayout, second,
        # is the one that warns
        assert any("Grad strides do not match" in m for m in r["control"])
        assert r["mismatched"] == []
        assert r["close"]  # gradients averaged over both ranks, in both jobs


SHARED = '''
import torch, torch.distributed as dist
import memlayout
from memlayout.plan.compilers.backend import BackendWarning
from tests.support.torchrun import finish_rank, graph_record
from tests.train.test_backend_ddp import job

dist.init_process_group("gloo")
# measured (no cache: every cost timed), on rank 0 alone
planned = job(memlayout.backend(inner="eager", rounds=1, guard=False, cache=False))
records = memlayout.backend_report().graphs
report = str(memlayout.backend_report())
reference = job("eager")
close = all(torch.allclose(planned["state"][k], v, rtol=1e-4, atol=1e-5)
            for k, v in reference["state"].items())
out = {"backend_warnings": [m for c, m in planned["warnings"] if issubclass(c, BackendWarning)],
       "graphs": [graph_record(r) for r in records], "report": report, "close": close}
finish_rank(out)
'''


def test_two_ranks_run_one_plan_measured_by_rank_0(tmp_path):
    _, (zero, one) = run_worker(SHARED, tmp_path)
    assert zero["backend_warnings"] == one["backend_warnings"] == []
    assert len(zero["graphs"]) == len(one["graphs"]) >= 2  # DDP's optimizer split the graph
    for g0, g1 in zip(zero["graphs"], one["graphs"], strict=True):
        assert (g0["rank"], g0["decided_by"], g1["rank"], g1["decided_by"]) == (0, 0, 1, 0)
        assert g0["planned"] and g0["ran"] == g1["ran"] == Runner.PLAN_EAGER
        assert g0["digest"] == g1["digest"] != ""  # one program on both ranks
        assert g0["convolutions"] == g1["convolutions"]
        assert g0["measured"] > 0  # rank 0 timed the costs ...
        assert g1["measured"] == g1["cached"] == 0  # ... rank 1 took them from the exchange
        assert f"rank 1: plan {g1['digest']}, decided by rank 0" in one["report"]
        assert f"rank 0: plan {g0['digest']}, decided here" in zero["report"]
    assert zero["close"] and one["close"]  # trains as the job without memlayout
