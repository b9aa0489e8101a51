"""The planned model is the user's model: its own class and tree, its own forward, planned
layouts. What a user does with a model (hooks, attributes, replaced heads, names, grad-mode
regions, modes, outputs, tracers, wrappers) behaves on the planned model as on the original.

Every check compares with the original model itself (a second copy, run the same way), never
with a figure. ``measure=False``: the analytical costs put convolutions channels-last, so the
plans below really change layouts (checked where it matters)."""

from __future__ import annotations

import copy
import dataclasses
import io
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout import Format, format_of
from memlayout.errors import PlanError


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x))) + x


class Net(nn.Module):
    """A stem, two non-leaf blocks, a head, a Python attribute and a flag read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.block = Block(16)
        self.block2 = Block(16)
        self.head = nn.Linear(16, 5)
        self.scale = 1.0
        self.features = False

    def use_features(self, on: bool = True) -> None:
        self.features = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block(self.stem(x)))
        if self.features:
            return x
        return self.head(x.mean((2, 3))) * self.scale


def _x(n: int = 2, size: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _plan(model: nn.Module, x: Any = None, **kw: Any) -> nn.Module:
    return memlayout.optimize(model, _x() if x is None else x, measure=False, cache=False,
                              **kw)


def _same(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_it_is_the_models_own_class_names_and_tree() -> None:
    model = Net().eval()
    opt = _plan(model)
    assert type(opt) is Net and type(opt.block) is Block  # no subclass, no wrapper
    assert [n for n, _ in opt.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in opt.named_modules()] == [n for n, _ in model.named_modules()]
    assert list(opt.state_dict()) == list(model.state_dict())
    assert repr(opt) == repr(model)
    assert format_of(opt.stem.weight) is Format.CHANNELS_LAST  # the plan is real
    # memlayout's mechanism is not among the user's hooks
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in opt.modules())
    # a name-based parameter group (no weight decay on biases) matches as on the original
    no_decay = {n for n, _ in model.named_parameters() if n.endswith("bias")}
    assert {n for n, _ in opt.named_parameters() if n in no_decay} == no_decay


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_on_a_block_fires_and_sees_what_the_original_sees(when: str) -> None:
    model, x = Net().eval(), _x()
    seen: list[torch.Tensor] = []

    def hook(_m: nn.Module, _args: Any, out: torch.Tensor) -> None:
        seen.append(out.detach().clone())

    if when == "before":
        model.block.register_forward_hook(hook)
    opt = _plan(model)
    if when == "after":
        opt.block.register_forward_hook(hook)
        model.block.register_forward_hook(hook)
    seen.clear()
    with torch.no_grad():
        model(x)
        opt(x)
    assert len(seen) == 2
    _same(seen[1], seen[0])


def test_a_hook_on_a_leaf_of_an_exported_model_fires() -> None:
    class Flow(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # a grad-mode region: torch.export
            with torch.no_grad():
                x = self.stem(x)
            return self.head(self.block(x).mean((2, 3)))

    model, x = Flow().eval(), _x()
    opt = _plan(model)
    assert opt.plan.coverage.methods == ("torch.export",)
    calls: list[int] = []
    opt.block.conv.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        _same(opt(x), model(x))
    assert calls == [1]


def test_an_output_changing_hook_removed_after_planning_is_gone() -> None:
    model, x = Net().eval(), _x()
    handle = model.block.register_forward_hook(lambda _m, _a, out: out * 0)
    opt = _plan(model)
    opt.block._forward_hooks.clear()
    handle.remove()
    with torch.no_grad():
        _same(opt(x), model(x))
        assert opt(x).abs().sum() > 0


def test_attributes_flags_and_methods_set_after_planning_are_used() -> None:
    model, x = Net().eval(), _x()
    opt = _plan(model)
    for target in (model, opt):
        target.scale = 3.0
    with torch.no_grad():
        _same(opt(x), model(x))
    for target in (model, opt):
        target.use_features()
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert got.shape == want.shape == (2, 16, 8, 8)
    _same(got, want)
    assert format_of(got) == format_of(want)  # a result handed back as the original's


def test_a_replaced_head_is_the_one_that_runs_and_trains() -> None:
    model, x = Net().train(), _x()
    opt = _plan(model, train=True)
    torch.manual_seed(1)
    opt.head = nn.Linear(16, 3)
    torch.manual_seed(1)
    model.head = nn.Linear(16, 3)
    assert [n for n, _ in opt.named_parameters()] == [n for n, _ in model.named_parameters()]
    out, want = opt(x), model(x)
    assert out.shape == want.shape == (2, 3)
    _same(out, want)
    out.sum().backward()
    want.sum().backward()
    assert opt.head.weight.grad is not None
    _same(opt.head.weight.grad, model.head.weight.grad)


def test_a_grad_mode_region_inside_forward_is_kept() -> None:
    class Frozen(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                x = self.stem(x)
            x = x.clone()  # out of inference mode (as users write it)
            return self.head(self.block(x).mean((2, 3)))

    model, x = Frozen().train(), _x()
    opt = _plan(model, train=True)
    coverage = opt.plan.coverage
    assert coverage.planned <= coverage.total  # never "2 of 1 (200 %)"
    opt(x).sum().backward()
    assert opt.stem.weight.grad is None  # as the original: the stem gets no gradient
    assert opt.block.conv.weight.grad is not None


Pair = namedtuple("Pair", ["features", "logits"])


@dataclasses.dataclass
class Output:
    features: torch.Tensor
    logits: torch.Tensor


@pytest.mark.parametrize("kind", [Pair, Output, dict, list])
def test_structured_outputs_come_back_in_the_originals_strides(kind: Any) -> None:
    class Structured(Net):
        def forward(self, x: torch.Tensor) -> Any:
            f = self.block(self.stem(x))
            logits = self.head(f.mean((2, 3)))
            if kind is dict:
                return {"features": f, "logits": logits}
            if kind is list:
                return [f, logits]
            return kind(f, logits)

    model, x = Structured().eval(), _x()
    opt = _plan(model)
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert type(got) is type(want)
    f_got = got["features"] if kind is dict else got[0] if kind is list else got.features
    f_want = want["features"] if kind is dict else want[0] if kind is list else want.features
    assert f_got.stride() == f_want.stride()
    f_got.view(2, -1)  # what a user does with it: works as on the original


def test_a_view_of_the_input_stays_a_view() -> None:
    class Sliced(Net):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.head(self.block(self.stem(x)).mean((2, 3))), x[:, :1]

    model, x = Sliced().eval(), _x()
    opt = _plan(model)
    with torch.no_grad():
        _, view = opt(x)
    assert view.data_ptr() == x.data_ptr() and view.stride() == x[:, :1].stride()


def test_tracers_of_the_planned_model_compute_what_it_does() -> None:
    model, x = Net().eval(), _x()
    opt = _plan(model)
    other = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want, want_other = model(x), model(other)
        traced = torch.jit.trace(opt, (x,), check_trace=False)
        _same(traced(x), want)
        _same(traced(other), want_other)  # replayed on another layout: the real strides
        exported = torch.export.export(opt, (x,)).module()
        _same(exported(x), want)
        _same(exported(other), want_other)
        compiled = torch.compile(opt, backend="eager")
        _same(compiled(x), want)


def test_modes_of_submodules_are_kept() -> None:
    model = nn.Sequential(Net().eval())  # an eval network inside a wrapper left in train mode
    x = _x()
    opt = _plan(model)
    assert opt.training and not opt[0].training and not opt[0].block.bn.training
    stats = opt[0].block.bn.running_mean.clone()
    with torch.no_grad():
        _same(opt(x), model(x))
    assert torch.equal(opt[0].block.bn.running_mean, stats)  # running statistics used


def test_fine_tuning_with_frozen_batchnorm_keeps_it_frozen() -> None:
    model, x = Net().train(), _x()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    reference = copy.deepcopy(model)
    opt = _plan(model, train=True)
    assert not opt.block.bn.training and opt.training
    out, want = opt(x), reference(x)
    _same(out, want)
    out.sum().backward()
    want.sum().backward()
    _same(opt.stem.weight.grad, reference.stem.weight.grad)
    assert torch.equal(opt.block.bn.running_mean, reference.block.bn.running_mean)


def test_apply_keeps_the_callers_mode_or_refuses_clearly() -> None:
    model, x = Net().train(), _x()
    plan = _plan(model, train=True).plan
    with pytest.raises(PlanError, match="train mode.*eval mode"):
        memlayout.apply(Net().eval(), plan, x)
    applied = memlayout.apply(Net().train(), plan, x)
    assert applied.training and applied.plan.train


def test_contiguous_weights_are_applied_as_planned() -> None:
    model, x = Net().train(), _x()
    planned = _plan(model, train=True, weights="contiguous")
    applied = memlayout.apply(Net().train(), planned.plan, x)
    assert all(p.is_contiguous() for p in applied.parameters())


def test_the_steering_survives_copies_pickles_and_state_dicts() -> None:
    model, x = Net().eval(), _x()
    opt = _plan(model)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = _plan(Net().eval())
    fresh.load_state_dict(opt.state_dict())
    with torch.no_grad():
        want = model(x)
        for other in (copy.deepcopy(opt), loaded, fresh):
            assert format_of(other.stem.weight) is Format.CHANNELS_LAST
            _same(other(x), want)
        for other in (copy.deepcopy(opt), loaded):
            assert other.memlayout.plan == opt.plan and other.plan == opt.plan


def test_inplace_plans_the_callers_object() -> None:
    model, x = Net().eval(), _x()
    reference = copy.deepcopy(model)
    params = [id(p) for p in model.parameters()]
    opt = _plan(model, inplace=True)
    assert opt is model and [id(p) for p in opt.parameters()] == params  # the same tensors
    assert format_of(model.stem.weight) is Format.CHANNELS_LAST
    with torch.no_grad():
        _same(opt(x), reference(x))


def test_an_ema_copy_updated_in_place_follows() -> None:
    """An EMA of the weights, updated in place into the planned model's parameters."""
    model, x = Net().eval(), _x()
    opt = _plan(model)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p_opt, p_model in zip(opt.parameters(), ema.parameters(), strict=True):
            p_model.mul_(0.5)
            p_opt.mul_(0.5)
        _same(opt(x), ema(x))
    averaged = torch.optim.swa_utils.AveragedModel(opt)
    with torch.no_grad():
        _same(averaged(x), ema(x))


def test_a_parametrized_weight_is_planned_and_equal() -> None:
    from torch.nn.utils import parametrize

    class Half(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    model, x = Net().eval(), _x()
    parametrize.register_parametrization(model.block.conv, "weight", Half())
    opt = _plan(model)
    with torch.no_grad():
        _same(opt(x), model(x))
    assert list(opt.state_dict()) == list(model.state_dict())


def test_activation_checkpointing_in_forward_trains_as_the_original() -> None:
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = checkpoint(self.block, self.stem(x), use_reentrant=False)
            return self.head(x.mean((2, 3)))

    model, x = Checkpointed().train(), _x()
    reference = copy.deepcopy(model)
    opt = _plan(model, train=True)
    out, want = opt(x), reference(x)
    _same(out, want)
    out.sum().backward()
    want.sum().backward()
    _same(opt.block.conv.weight.grad, reference.block.conv.weight.grad)


def test_a_frozen_backbone_gets_no_gradients() -> None:
    model, x = Net().train(), _x()
    for p in [*model.stem.parameters(), *model.block.parameters()]:
        p.requires_grad_(False)
    opt = _plan(model, train=True)
    opt(x).sum().backward()
    assert opt.stem.weight.grad is None and opt.block.conv.weight.grad is None
    assert opt.block2.conv.weight.grad is not None
    assert [p.requires_grad for p in opt.parameters()] == \
        [p.requires_grad for p in model.parameters()]
