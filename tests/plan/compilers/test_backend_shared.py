"""One plan per job, in one process: the deciding rank's decisions, handed to a rank that
takes them (``Job(1, 0)``), build the same program there without a measurement; a rank that
cannot take one (its graph differs, the rebuilt plan differs, the exchange fails) warns,
naming itself and the graph, and runs the graph as given, never a plan of its own.

The exchange is the one seam replaced here (``backend.exchange``: what the deciding rank
sent, played back in order); ``tests/train/test_backend_ddp.py`` runs it between two ranks
under torchrun, and with the real collectives of a one-member group.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import memlayout
from memlayout.plan.compilers import backend as b
from memlayout.plan.compilers import backend_plan
from memlayout.plan.compilers.backend import BackendWarning
from memlayout.plan.compilers.backend_shared import Decision, ExchangeFailed, Job, plan_digest
from memlayout.plan.runners import Runner

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OPTIONS = {"inner": "eager", "rounds": 1, "cache": False, "guard": False, "shared_plan": True}


class Broken(nn.Module):
    """Two convolution blocks with a graph break between them: two graphs, two exchanges."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if x.amax() > -1e9:  # always true; Dynamo cannot know: a graph break
            x = self.body(x)
        return self.head(x.mean((2, 3)))


class Plain(nn.Sequential):
    """Two convolutions and no graph break: one graph."""

    def __init__(self) -> None:
        super().__init__(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 1),
                         nn.ReLU())


def _step(make: Callable[[], nn.Module] = Broken,
          **options: Any) -> tuple[list[torch.Tensor], list[Any], list[tuple[type, str]]]:
    """One training step of ``make()`` compiled with the backend: the gradients, the
    backend's records and the warnings."""
    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    torch.manual_seed(0)
    model = make()
    fast = torch.compile(model, backend=memlayout.backend(**{**OPTIONS, **options}))
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast(x).square().mean().backward()
    return ([p.grad.clone() for p in model.parameters()], list(memlayout.backend_report().graphs),
            [(w.category, str(w.message)) for w in caught])


def _as(monkeypatch: pytest.MonkeyPatch, job: Job,
        exchange: Callable[[Job, Decision | None], Decision]) -> None:
    monkeypatch.setattr(b, "job_of", lambda device: job)
    monkeypatch.setattr(b, "exchange", exchange)


def _decided(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Decision], Any]:
    """The step on the deciding rank (rank 0), and the decisions it sent."""
    sent: list[Decision] = []
    _as(monkeypatch, Job(0, 0), lambda job, d: sent.append(d) or d)
    return sent, _step()


def _playing(decisions: list[Decision]) -> Callable[[Job, Decision | None], Decision]:
    received = iter(decisions)

    def exchange(job: Job, decision: Decision | None) -> Decision:
        assert decision is None  # a rank that takes a plan sends nothing
        return next(received)
    return exchange


def _no_measuring(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a rank that takes a shared plan measured")


def test_a_rank_takes_the_deciding_ranks_plan_and_measures_nothing(monkeypatch):
    sent, (grads0, records0, warned0) = _decided(monkeypatch)
    _as(monkeypatch, Job(1, 0), _playing(sent))
    monkeypatch.setattr(backend_plan, "measure_costs", _no_measuring)
    grads1, records1, warned1 = _step()

    assert warned0 == warned1 == []
    assert len(sent) == len(records0) == len(records1) >= 2  # the graph break
    planned = [(r0, r1) for r0, r1 in zip(records0, records1, strict=True) if r0.convolutions]
    assert planned
    for r0, r1 in planned:
        assert r0.planned and r0.ran == r1.ran == Runner.PLAN_EAGER
        assert (r0.rank, r0.decided_by, r1.rank, r1.decided_by) == (0, 0, 1, 0)
        assert r0.measured > 0 and r1.measured == r1.cached == 0
        assert r1.digest == r0.digest != ""
        assert r1.convolutions == r0.convolutions and r1.verification == r0.verification
    for g0, g1 in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)  # the same program, the same data
    text = str(memlayout.backend_report())
    assert f"rank 1: plan {planned[0][1].digest}, decided by rank 0" in text


def test_a_compiled_plan_is_compiled_alike_on_the_rank_that_takes_it(monkeypatch):
    inductor = {"inner": "inductor", "measure": False}  # one graph, one Inductor compile each
    sent: list[Decision] = []
    _as(monkeypatch, Job(0, 0), lambda job, d: sent.append(d) or d)
    grads0, records0, _ = _step(Plain, **inductor)
    _as(monkeypatch, Job(1, 0), _playing(sent))
    grads1, records1, warned = _step(Plain, **inductor)
    assert warned == []
    assert [r.ran for r in records0] == [r.ran for r in records1] == [Runner.PLAN_COMPILED]
    assert records0[0].digest == records1[0].digest
    assert records1[0].decided_by == 0 and records1[0].rank == 1
    for g0, g1 in zip(grads0, grads1, strict=True):
        torch.testing.assert_close(g0, g1, rtol=1e-5, atol=1e-6)


def _tampered(change: Callable[[Decision], Decision]) -> Callable[[Decision], Decision]:
    """``change`` applied to the decisions of planned graphs (those with costs)."""
    return lambda d: change(d) if d.table is not None else d


@pytest.mark.parametrize("tamper,why", [
    (_tampered(lambda d: dataclasses.replace(d, signature="another graph")),
     "the graph differs"),
    (_tampered(lambda d: dataclasses.replace(d, planned_signature="another plan")),
     "the plan rebuilt here differs"),
    (_tampered(lambda d: dataclasses.replace(d, compiled_as="inductor mode=default")),
     "the backend's options differ"),
])
def test_a_rank_that_cannot_take_the_plan_says_so_and_runs_the_graph_as_given(
        monkeypatch, tamper, why):
    sent, (grads0, _, _) = _decided(monkeypatch)
    _as(monkeypatch, Job(1, 0), _playing([tamper(d) for d in sent]))
    monkeypatch.setattr(backend_plan, "measure_costs", _no_measuring)  # never a plan of its own
    grads1, records, warned = _step()

    refused = [r for r in records if r.decided_by is None]
    assert refused and all(not r.planned and r.ran == Runner.ORIGINAL_EAGER and r.rank == 1
                           for r in refused)
    assert [c for c, _ in warned] == [BackendWarning] * len(refused)
    for (_, message), r in zip(warned, refused, strict=True):
        assert f"rank 1, graph {r.graph}:" in message and why in message
        assert "Inductor's own layouts" in message
        assert r.digest == plan_digest(sent[records.index(r)].signature, {}, Runner.ORIGINAL_EAGER)
    for g0, g1 in zip(grads0, grads1, strict=True):  # the model computes what it did
        torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-5)


def test_a_failed_exchange_leaves_every_rank_on_the_graph_as_given(monkeypatch):
    def failing(job: Job, decision: Decision | None) -> Decision:
        raise ExchangeFailed("the exchange of decisions failed (RuntimeError: peer gone)",
                             job.rank)

    for job in (Job(0, 0), Job(1, 0)):
        _as(monkeypatch, job, failing)
        _, records, warned = _step()
        assert records and all(r.ran == Runner.ORIGINAL_EAGER and r.decided_by is None
                               for r in records)
        assert len(warned) == len(records)
        assert all(f"rank {job.rank}, graph" in m and "peer gone" in m for _, m in warned)


def test_the_deciding_ranks_failure_stops_the_others_with_it(monkeypatch):
    sent, _ = _decided(monkeypatch)
    _as(monkeypatch, Job(1, 0), _playing([dataclasses.replace(sent[0], record=None)]))
    with pytest.raises(Exception, match="rank 0 failed to compile graph"):
        _step()


def test_a_decision_crosses_a_process_as_data(monkeypatch):
    sent, _ = _decided(monkeypatch)
    assert any(d.table is not None and d.labels for d in sent)
    for d in sent:  # what all_gather_object does to it
        assert pickle.loads(pickle.dumps(d)) == d


def test_by_default_only_ddps_split_graphs_are_shared(monkeypatch, one_member_group):
    """A graph compiled outside DDP's optimizer may be compiled on some ranks only (an
    evaluation on rank 0): by default it is planned alone, with no collective to wait on."""
    def no_collective(device):
        raise AssertionError("a collective for a graph that is not one of DDP's splits")

    monkeypatch.setattr(b, "job_of", no_collective)
    model, x = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).eval(), torch.randn(2, 3, 8, 8)
    options = {k: v for k, v in OPTIONS.items() if k != "shared_plan"}
    fast = torch.compile(model, backend=memlayout.backend(**options))
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert all(g.decided_by in (None, 0) for g in memlayout.backend_report().graphs)
