"""Changing shapes: an OptimizedModule plans a new input shape on first sight, once, on the
live weights (one set of parameters trains for every shape), caches the plan (LRU, bounded),
and a replan of a shape the cost cache knows measures nothing. Checked against the original
model trained side by side (torch itself) and by counting the measurements."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memlayout.plan.pipeline as pipeline
from memlayout.plan.check import verification
from memlayout.plan.costs import regions as cost_regions
from memlayout.plan.pipeline import optimize
from memlayout.plan.steer.state import shape_signature


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.a(x)))
        x = x + self.b(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _x(n: int, size: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


@pytest.fixture
def measurements(monkeypatch):
    """Every ``measure_costs`` call the planner makes: (input shape, timings taken)."""
    calls: list[tuple[tuple[int, ...], int]] = []
    real = cost_regions.measure_costs

    def counting(gm, inputs, **kwargs):  # noqa: ANN001, ANN202
        table = real(gm, inputs, **kwargs)
        calls.append((tuple(inputs[0].shape), table.measured))
        return table

    monkeypatch.setattr(cost_regions, "measure_costs", counting)
    return calls


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(a.detach().abs().max().item(), 1e-3)
    return bool((a.detach() - b.detach()).abs().max() <= 1e-4 * scale)


def test_alternating_batch_sizes_plan_once_per_shape_and_train_as_the_original(
        db, measurements) -> None:
    model = Small()
    reference = copy.deepcopy(model).train()
    opt = optimize(model, _x(8), train=True, cache=db, rounds=1, guard=False)
    sgd = torch.optim.SGD(opt.parameters(), lr=0.05, momentum=0.9)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(20):
        x = _x(8 if step % 2 == 0 else 5)
        got, want = opt(x), reference(x)
        assert got.shape == want.shape and _close(want, got), step
        got.square().mean().backward()
        want.square().mean().backward()
        sgd.step()
        ref_sgd.step()
        sgd.zero_grad()
        ref_sgd.zero_grad()
    # one plan per shape: the example's at optimize, batch 5's at its first call, none after
    assert opt.memlayout.replans == 1
    assert [p.input_shapes for p in opt.memlayout.plans.values()] == [[[8, 3, 8, 8]], [[5, 3, 8, 8]]]
    assert [shape[0] for shape, _ in measurements] == [8, 5]
    assert all(taken > 0 for _, taken in measurements)  # a fresh cache: both were measured
    assert opt.plan is opt.memlayout.plans[shape_signature((_x(8),))]  # .plan stays the example's
    new = opt.memlayout.plans[shape_signature((_x(5),))]
    assert new.train and new.weight_formats_kept and new.verification.train
    # the weights trained on both shapes are one set: equal to the reference's at the end
    params = dict(opt.named_parameters())
    for name, p in reference.named_parameters():
        assert _close(p, params[name]), name


def test_lru_bound_and_a_replan_of_a_shape_seen_before_rebuilds_its_stored_plan(db, measurements) -> None:
    opt = optimize(Small(), _x(4), train=True, cache=db, rounds=1, guard=False, max_plans=2)
    with torch.no_grad():
        for n in (3, 2, 3, 2, 2):
            opt(_x(n))
    # max_plans=2: the example's and one more; 3 and 2 evict each other, 2 twice is a hit
    assert opt.memlayout.replans == 4 and len(opt.memlayout.plans) == 2
    # seen before, 3 and 2 are their stored plans rebuilt: nothing captured or measured
    assert [shape[0] for shape, _ in measurements] == [4, 3, 2]
    taken = [t for _, t in measurements]
    assert taken[1] > 0 and taken[2] > 0  # first sight of 3 and of 2
    last = list(opt.memlayout.plans.values())[-1]
    assert (last.input_shapes, last.measured) == ([[2, 3, 8, 8]], 0)
    assert last.notes[-1].startswith("the plan stored")


def test_a_new_shape_in_eval_mode_is_planned_for_inference(db) -> None:
    model = Small()
    opt = optimize(model, _x(4), train=True, measure=False, cache=db)
    reference = copy.deepcopy(model).eval()
    opt.eval()
    x = _x(3, size=10)  # another batch size and another image size
    with torch.no_grad():
        got = opt(x)
    assert _close(reference(x), got)
    plan = opt.memlayout.plans[(*shape_signature((x,)), ((), "eval", "mode", ""))]
    assert not plan.train and plan.input_shapes == [[3, 3, 10, 10]]
    assert all(not m.training for m in opt.modules())


def test_state_dict_loads_into_every_shape_s_plan(db) -> None:
    model = Small()
    opt = optimize(model, _x(4), train=True, measure=False, cache=db)
    opt(_x(2)).sum().backward()  # plans batch 2, and BatchNorm counts one more batch
    assert opt.state_dict().keys() == model.state_dict().keys()
    assert opt.state_dict()["bn.num_batches_tracked"] == 1
    opt.load_state_dict(model.state_dict())  # in place, into the tensors every plan shares
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in opt.state_dict().items())
    opt.eval()
    model.eval()
    x = _x(2)
    with torch.no_grad():  # batch 2 in eval mode: planned for inference on the loaded tensors
        assert _close(model(x), opt(x))
    assert opt.memlayout.replans == 2


def test_a_shape_whose_plan_fails_runs_the_original_computation(db, monkeypatch) -> None:
    from memlayout.errors import LayoutVerificationError

    model = Small().eval()  # an inference plan comes back in the caller's mode
    opt = optimize(model, _x(4), measure=False, cache=db)

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise LayoutVerificationError("a planted mismatch")

    monkeypatch.setattr(pipeline, "verify", failing)  # the plan and every fallback fail
    monkeypatch.setattr(verification, "verify", failing)
    x = _x(3)
    with pytest.warns(UserWarning, match="a planted mismatch"), torch.no_grad():
        got = opt(x)
    with torch.no_grad():
        assert _close(model.eval()(x), got)
        opt(_x(3))  # not planned again
    assert opt.memlayout.replans == 1 and len(opt.memlayout.plans) == 1


def test_max_plans_below_one_is_a_clear_error(db) -> None:
    from memlayout.errors import PlanError

    model = Small()
    with pytest.raises(PlanError, match="max_plans"):
        optimize(model, _x(2), measure=False, cache=db, max_plans=0)
