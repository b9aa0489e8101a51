"""A plan stored for the model it was made for: a later ``optimize`` of the same model is the
stored plan rebuilt and verified again, nothing captured or measured; anything the plan could
depend on that changed (code, structure, parameters' shapes or formats, hooks, mode, inputs,
options) is planned anew; a stored plan that no longer verifies is dropped, with a note."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.plan import pipeline, reuse
from memlayout.plan.costs.cache import CacheWarning, CostCache
from memlayout.plan.graph import Label
from memlayout.plan.steer.boundary import Boundary, Leaf
from memlayout.plan.steer.steering import Steering
from tests.support.models import Branchy

FAST = dict(rounds=1, guard_rounds=2, padding=False)


def _x(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 12, 12)


@pytest.fixture
def captures(monkeypatch) -> list[int]:
    """One entry per capture the planner runs."""
    seen: list[int] = []
    real = pipeline.capture

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "capture", counting)
    return seen


def test_the_same_model_again_is_its_stored_plan_rebuilt_and_verified(tmp_path,
                                                                       captures) -> None:
    db, model, x = tmp_path / "c.sqlite", Branchy().eval(), _x()
    first = memlayout.optimize(model, x, cache=db, **FAST)
    again = memlayout.optimize(copy.deepcopy(model), x, cache=db, **FAST)
    assert len(captures) == 1  # the second call captured nothing
    assert again.plan.notes[-1] == reuse.REUSED and again.plan.measured == 0
    assert again.plan.verification.ok and again.plan.price.verify > 0
    assert [n.format for n in again.plan.nodes] == [n.format for n in first.plan.nodes]
    assert again.plan.guard.source == "cache" and again.plan.guard.kept == first.plan.guard.kept
    y = _x(2)
    with torch.no_grad():
        want, got = model(y), again(y)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.stride() == want.stride()
    assert [k for k, _ in again.named_parameters()] == [k for k, _ in model.named_parameters()]
    # reuse=False: planned again from the cached costs
    memlayout.optimize(model, x, cache=db, reuse=False, **FAST)
    assert len(captures) == 2


def _changed_code(m: nn.Module) -> None:
    # a forward of the same name, computing the same, in other code
    def forward(self: Branchy, x: torch.Tensor) -> torch.Tensor:
        return Branchy.forward(self, x) + 0.0
    m.__class__ = type("Branchy", (Branchy,), {"forward": forward})


CHANGES: dict[str, Callable[[nn.Module], Any]] = {
    "forward code": _changed_code,
    "a module attribute": lambda m: setattr(m.tail, "padding", (1, 1)),
    "a parameter's shape": lambda m: setattr(m, "head", nn.Linear(4, 6)),
    "a weight's format": lambda m: m.stem.to(memory_format=torch.channels_last),
    "requires_grad": lambda m: m.stem.weight.requires_grad_(False),
    "a hook": lambda m: m.body.register_forward_hook(lambda *a: None),
    "train mode": lambda m: m.train(),
    "dtype": lambda m: m.double(),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_changed_model_has_another_fingerprint(change: Callable[[nn.Module], Any]) -> None:
    model = Branchy().eval()
    x = _x()
    base = reuse.fingerprint(model, (x,), "options")
    assert reuse.fingerprint(copy.deepcopy(model), (x,), "options") == base
    changed = copy.deepcopy(model)
    change(changed)
    assert reuse.fingerprint(changed, (x,), "options") != base


def test_inputs_options_and_tied_weights_are_in_the_fingerprint() -> None:
    model, x = Branchy().eval(), _x()
    base = reuse.fingerprint(model, (x,), "options")
    assert reuse.fingerprint(model, (_x(3),), "options") != base
    assert reuse.fingerprint(model, (x.contiguous(memory_format=torch.channels_last),),
                             "options") != base
    assert reuse.fingerprint(model, (x,), "other options") != base
    a, b = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4),
                                                                          nn.Linear(4, 4))
    b[1].weight = b[0].weight  # tied: the same shapes, one tensor
    assert reuse.fingerprint(a, (torch.zeros(1, 4),), "o") != reuse.fingerprint(
        b, (torch.zeros(1, 4),), "o")


def test_a_changed_model_is_planned_anew(tmp_path, captures) -> None:
    db, model, x = tmp_path / "c.sqlite", Branchy().eval(), _x()
    memlayout.optimize(model, x, cache=db, **FAST)
    wider = copy.deepcopy(model)
    wider.head = nn.Linear(4, 6)
    again = memlayout.optimize(wider, x, cache=db, **FAST)
    assert len(captures) == 2 and reuse.REUSED not in again.plan.notes
    with torch.no_grad():
        torch.testing.assert_close(again(x), wider(x), rtol=1e-4, atol=1e-5)


def test_a_stored_plan_that_no_longer_verifies_is_dropped_and_the_model_planned_again(
        tmp_path, monkeypatch, captures) -> None:
    db, model, x = tmp_path / "c.sqlite", Branchy().eval(), _x()
    memlayout.optimize(model, x, cache=db, **FAST)

    class Corrupting(Boundary):  # as code the fingerprint cannot read would change it
        def exit(self, output: Any) -> Any:
            return super().exit(output) * 1.5

    real = reuse.Stored.from_value

    def planted(cls: type, value: Any) -> reuse.Stored:
        s = real(value)
        return dataclasses.replace(s, steering=Steering(
            s.steering.parameters, (*s.steering.boundaries, ("body", Corrupting()))))

    monkeypatch.setattr(reuse.Stored, "from_value", classmethod(planted))
    again = memlayout.optimize(model, x, cache=db, **FAST)
    assert len(captures) == 2  # planned again from the start
    assert again.plan.verification.ok and reuse.REUSED not in again.plan.notes
    assert any(n.startswith("the plan stored for this model no longer verified (outputs differ)")
               for n in again.plan.notes)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_stored_plan_this_model_cannot_take_is_dropped_with_a_note(tmp_path, monkeypatch,
                                                                      captures) -> None:
    db, model, x = tmp_path / "c.sqlite", Branchy().eval(), _x()
    memlayout.optimize(model, x, cache=db, **FAST)
    real = reuse.Stored.from_value

    def elsewhere(cls: type, value: Any) -> reuse.Stored:  # a module the model lacks
        s = real(value)
        return dataclasses.replace(s, steering=Steering(
            s.steering.parameters, (*s.steering.boundaries, ("nowhere", Boundary()))))

    monkeypatch.setattr(reuse.Stored, "from_value", classmethod(elsewhere))
    again = memlayout.optimize(model, x, cache=db, **FAST)
    assert len(captures) == 2 and again.plan.verification.ok
    assert any(n.startswith("the plan stored for this model no longer verified (it does not "
                            "steer: AttributeError") for n in again.plan.notes)


class ReadsItsLayout(nn.Module):
    """A forward whose own code reads its activation's layout: its plans warn."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * 2 if y.is_contiguous() else y * 2.0


def test_a_plan_that_warned_is_not_stored_so_its_warning_comes_back(tmp_path,
                                                                     captures) -> None:
    db, model, x = tmp_path / "c.sqlite", ReadsItsLayout().eval(), _x()
    for _ in range(2):
        with pytest.warns(UserWarning, match="reads layouts|layout read"):
            opt = memlayout.optimize(model, x, cache=db, **FAST)
        assert reuse.REUSED not in opt.plan.notes
    assert len(captures) == 2  # planned, and warned, each time


def test_a_stored_record_reads_back_as_written(tmp_path) -> None:
    model = memlayout.optimize(Branchy().eval(), _x(), cache=tmp_path / "c.sqlite", **FAST)
    state = model.memlayout
    cl = Label.CHANNELS_LAST
    steering = Steering((("stem.weight", cl),), (
        ("body", Boundary(inputs=(Leaf(0, cl, 4),), outputs=(Leaf(0, Label.CONTIGUOUS, 4),),
                          weight_label=cl, padding=(8, 16))),))
    stored = reuse.Stored(model.plan, steering, cl, state.outputs[state.example], None,
                          ("mul_ on input x",), '["guard", "key"]')
    assert reuse.Stored.from_value(stored.to_value()) == stored


def test_a_stored_record_that_does_not_read_back_is_a_miss_said_once(tmp_path,
                                                                     captures) -> None:
    db, model, x = tmp_path / "c.sqlite", Branchy().eval(), _x()
    memlayout.optimize(model, x, cache=db, **FAST)
    store = CostCache(db)
    [(key, value)] = store.records(reuse.KIND)
    value["input_label"] = 7  # a label no format has
    store.put(key, value)
    store.close()
    with pytest.warns(CacheWarning) as said:
        again = memlayout.optimize(model, x, cache=db, **FAST)
    assert [re.search(r"unexpected shape .* \(plan\)", str(w.message)) is not None
            for w in said] == [True]
    assert len(captures) == 2 and again.plan.verification.ok
    assert reuse.REUSED not in again.plan.notes
