"""memlayout.optimize(train=True): trains like the original (torch itself, step by step, with
BatchNorm and Dropout), gradients in their parameters' strides, planning leaves the state and
the RNG alone, forward + backward costs cached under their own keys, the guard times training
steps, and a rewrite that is wrong only in the backward is caught and named."""

from __future__ import annotations

import copy
import json
import sqlite3

import pytest
import torch
from torch import nn

from memlayout import Format, format_of
from memlayout.errors import LayoutVerificationError
from memlayout.plan.check import guard as g
from memlayout.plan.pipeline import optimize
from tests.support.planted import corrupt_the_plan_at


class Net(nn.Module):
    """Convs, BatchNorm, a residual add, a pool and a Dropout head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1))
        self.gn = nn.GroupNorm(2, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = self.gn(x + self.body(x))
        return self.head(self.drop(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)))


def _x(n: int = 2, size: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-4) -> bool:
    scale = max(a.detach().abs().max().item(), 1e-3)
    return bool((a.detach() - b.detach()).abs().max() <= rtol * scale)


def test_trains_like_the_original_step_by_step(db) -> None:
    model = Net()
    reference = copy.deepcopy(model).train()
    opt = optimize(model, _x(), train=True, measure=False, cache=db)
    assert opt.training and opt.plan.train and opt.plan.verification.train
    # the analytical model puts dense convolutions channels-last: the test is not trivial
    assert format_of(opt.stem.weight) is Format.CHANNELS_LAST
    assert all(isinstance(p, nn.Parameter) for p in opt.parameters())
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1, momentum=0.9)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = _x()
        torch.manual_seed(step)
        got = opt(x)
        torch.manual_seed(step)
        want = reference(x)
        assert _close(want, got)
        got.square().mean().backward()
        want.square().mean().backward()
        params = dict(opt.named_parameters())
        for name, p in reference.named_parameters():
            q = params[name]
            assert _close(p.grad, q.grad), name
            assert q.grad.stride() == q.stride(), name  # what DDP's gradient buckets expect
        sgd.step()
        ref_sgd.step()
        sgd.zero_grad()
        ref_sgd.zero_grad()
    state, ref_state = opt.state_dict(), reference.state_dict()
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():  # BatchNorm's running statistics moved as the original's
        assert _close(v.float(), state[k].float()), k


def test_planning_leaves_state_and_rng_alone(db) -> None:
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = _x()
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    opt = optimize(model, x, train=True, measure=False, cache=db)
    assert torch.equal(torch.rand(4), expected)  # planning ran Dropout, yet the RNG is as it was
    for k, v in opt.state_dict().items():  # BatchNorm ran in train mode while planning
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in opt.parameters())


def test_train_costs_are_cached_under_their_own_keys(db) -> None:
    model = Net()
    first = optimize(model, _x(), train=True, cache=db, rounds=1, guard=False)
    assert first.plan.measured > 0
    again = optimize(model, _x(), train=True, cache=db, rounds=1, guard=False, reuse=False)
    assert (again.plan.measured, again.plan.cached > 0) == (0, True)
    with sqlite3.connect(db) as con:
        keys = [json.loads(k) for (k,) in con.execute("SELECT key FROM entries")]
    timed = [n.name for n in first.plan.nodes if n.timed]
    node_keys = [k for k in keys if k[0] == "node"]
    assert timed and node_keys and all("train" in k for k in node_keys)
    # inference is another question: its nodes are measured again, the conversions are shared
    infer = optimize(model, _x(), cache=db, rounds=1, guard=False)
    assert infer.plan.measured > 0 and infer.plan.cached > 0


def test_guard_times_training_steps(db, monkeypatch) -> None:
    seen: list[bool] = []
    real = g.time_candidates

    def recording(*args, **kwargs):
        seen.append(kwargs.get("train", False))
        return real(*args, **{**kwargs, "rounds": 1})

    monkeypatch.setattr(g, "time_candidates", recording)
    opt = optimize(Net(), _x(), train=True, measure=True, cache=db, rounds=1, guard_rounds=1)
    if opt.plan.guard.source == "none":
        pytest.skip("the plan is one format end to end here: nothing for the guard to time")
    # the guard runs once more where the cost table disagrees with it (one noisy round can)
    assert seen and all(seen)
    assert opt.plan.guard.kept in ("planned", *g.UNIFORM)
    assert all(p.grad is None for p in opt.parameters())  # the timed steps left no gradients
    trained = len(seen)
    optimize(Net(), _x(), train=False, measure=True, cache=db, rounds=1, guard_rounds=1)
    # an inference plan does not read the training measurement: it times inference
    assert len(seen) > trained and not any(seen[trained:])


class _DoubleGrad(torch.autograd.Function):
    """Identity forward, gradient doubled: a conversion that is wrong only in the backward."""

    @staticmethod
    def forward(ctx, t):  # noqa: ANN001, ANN205
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return 2 * grad


def test_a_plan_wrong_only_in_the_backward_is_caught(db, monkeypatch) -> None:
    model = Net()
    # forward-only verification would not see it: the values are right
    corrupt_the_plan_at(monkeypatch, "body", _DoubleGrad.apply)
    with pytest.raises(LayoutVerificationError, match="gradient") as err:
        optimize(model, _x(), train=True, measure=False, cache=db, fallback=False)
    assert err.value.cause  # a few words a note reads, never the message parsed
    # by default: the model trained in one format instead, its training step verified
    with pytest.warns(UserWarning, match="failed verification"):
        kept = optimize(model, _x(), train=True, measure=False, cache=db)
    assert kept.plan.verification.ok and kept.plan.verification.train
    assert kept.plan.guard.kept in ("all_channels_last", "all_contiguous")
    optimize(model, _x(), train=False, measure=False, cache=db)  # inference: values are right


@pytest.mark.isa  # how far NHWC and NCHW kernels round apart differs per ISA
def test_a_rounding_level_mismatch_passes_through_float64(db, monkeypatch) -> None:
    """Below rounding: with a float32 tolerance of 1e-9 every float32 comparison of a
    channels-last plan fails, yet the same models agree in float64 (a layout changes no
    value): verified, and the record says by how much in float64."""
    from memlayout.plan import compare as v

    monkeypatch.setitem(v.TOLERANCE, torch.float32, (1e-9, 1e-12))
    opt = optimize(Net(), _x(), train=True, measure=False, cache=db)
    record = opt.plan.verification
    assert record.max_error > 1e-9  # float32 missed it ...
    assert record.float64_error is not None and record.float64_error <= 1e-9  # ... float64 not
    assert record.check == "float64 re-check" and "float64 re-check" in record.describe()


@pytest.mark.isa  # how far NHWC and NCHW kernels round apart differs per ISA
def test_an_inference_plan_passes_a_rounding_level_mismatch_through_float64_too(db, monkeypatch) -> None:
    """The same for one forward: a deep bf16 network's NHWC and NCHW kernels can round
    apart by more than bf16's tolerance; equal in float64, the plan is verified, and says so.
    A wrong rewrite differs in float64 as well: it is not passed (the fallback keeps a model
    run in one format instead)."""
    from memlayout.plan import compare as v

    monkeypatch.setitem(v.TOLERANCE, torch.float32, (1e-9, 1e-12))
    opt = optimize(Net().eval(), _x(), measure=False, cache=db, output_format=None)
    record = opt.plan.verification
    assert opt.plan.guard is None and record.max_error > 1e-9
    assert record.float64_error is not None and record.float64_error <= 1e-9
    assert record.check == "float64 re-check" and "float64 re-check" in record.describe()
    corrupt_the_plan_at(monkeypatch, "body", lambda out: out * 1.5)
    with pytest.raises(LayoutVerificationError, match="first module whose output differs: body"):
        optimize(Net().eval(), _x(), measure=False, cache=db, output_format=None, fallback=False)


@pytest.mark.isa  # how far NHWC and NCHW kernels round apart differs per ISA
def test_bf16_training_plan_is_verified_and_trains(db) -> None:
    model = Net()
    reference = copy.deepcopy(model).train()
    opt = optimize(model, _x(), train=True, dtype="bf16", measure=False, cache=db)
    assert opt.plan.dtype == "bfloat16" and opt.plan.verification.train
    x = _x()
    torch.manual_seed(0)
    got = opt(x)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert _close(want.float(), got.float(), rtol=5e-2)
    got.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.stride() == p.stride()
               for p in opt.parameters() if p.requires_grad)


def test_ddp_trains_the_optimized_module_across_shapes(db, tmp_path) -> None:
    """DDP builds its gradient buckets from the parameters' strides at wrap time: every
    gradient must come back in those strides, also from a shape planned after wrapping (its
    plan must use the very parameters DDP holds, or the reducer fails the next step)."""
    import warnings

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    from torch.nn.parallel import DistributedDataParallel

    model = Net()
    opt = optimize(model, _x(), train=True, measure=False, cache=db)
    assert any(format_of(p) is Format.CHANNELS_LAST for p in opt.parameters())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        ddp = DistributedDataParallel(opt)
        sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (2, 3, 2, 3):
                ddp(_x(n)).square().mean().backward()
                assert all(p.grad.stride() == p.stride() for p in opt.parameters())
                sgd.step()
                sgd.zero_grad()
        assert not [w for w in caught if "strides do not match" in str(w.message)]
        assert opt.memlayout.replans == 1
    finally:
        dist.destroy_process_group()


def test_optimize_command_train_verifies_a_step_and_times_training_steps(tmp_path,
                                                                         monkeypatch) -> None:
    from typer.testing import CliRunner

    from memlayout.cli import app
    from memlayout.plan.report.plan import Plan

    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["optimize", "torchvision:resnet18", "--train",
                                      "--batch", "2", "--image-size", "32", "--rounds", "1",
                                      "--no-measure", "--save", str(out)])
    assert result.exit_code == 0, result.output
    assert "training step" in result.output
    assert "equal to the original over one training step" in result.output
    assert "per training step" in result.output and "optimized vs eager_nhwc" in result.output
    plan = Plan.from_json(out.read_text())
    assert plan.train and plan.verification.train and plan.input_shapes == [[2, 3, 32, 32]]


class _DropoutHead(nn.Module):
    """squeezenet1_0's classifier shape: Dropout on a 4-D activation, then a 1x1 convolution;
    and an SE-style 1x1 convolution on an (N, C, 1, 1) map, whose weight's strides are
    ambiguous (size-1 kernel dims)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.se = nn.Conv2d(16, 16, 1)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        y = y * torch.sigmoid(self.se(y.mean((2, 3), keepdim=True)))
        return self.head(self.drop(y)).mean((2, 3))


class _FunctionalDropout(nn.Module):
    """Dropout called as a function inside forward, on a 4-D activation: no module to find."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.dropout(torch.relu(self.conv(x)), 0.5, self.training)
        return self.head(torch.dropout(y, 0.2, self.training)).mean((2, 3))


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_verified_dropout_draws_its_mask_in_logical_order(p) -> None:
    from memlayout.plan.check.training import _LayoutFreeDropout

    x = torch.randn(4, 8, 6, 6) + 3  # no zeros of its own
    cl = x.contiguous(memory_format=torch.channels_last)
    for drop in (lambda t: nn.functional.dropout(t, p, True), lambda t: torch.dropout(t, p, True),
                 nn.Dropout(p), lambda t: nn.functional.dropout(t.clone(), p, True, True)):
        with _LayoutFreeDropout():
            torch.manual_seed(3)
            a = drop(x)
            torch.manual_seed(3)
            b = drop(cl)
        assert torch.equal(a, b) and b.is_contiguous(memory_format=torch.channels_last)
        kept = a != 0
        torch.testing.assert_close(a, x * kept / (1 - p))  # dropout's definition
        assert abs(1 - kept.float().mean().item() - p) < 0.06  # 1152 draws
    # alpha dropout keeps a SELU network's activations at mean 0, variance 1 (as torch's does)
    big = torch.randn(400_000)
    with _LayoutFreeDropout():
        y = nn.functional.alpha_dropout(big, p, True)
    ref = nn.functional.alpha_dropout(big, p, True)
    assert abs(y.mean().item() - ref.mean().item()) < 0.02
    assert abs(y.std().item() - ref.std().item()) < 0.02
    dropped = y.unique(return_counts=True)[1].max().item() / y.numel()  # all one value
    assert dropped == pytest.approx(p, abs=0.01)
    with _LayoutFreeDropout():  # each one's own default: alpha_dropout's is eval
        assert torch.equal(nn.functional.alpha_dropout(big, p), big)
        assert not torch.equal(nn.functional.dropout(big, p), big)


def test_a_functional_dropout_model_plans_and_verifies_for_training(db) -> None:
    model = _FunctionalDropout().train()
    # the original runs NCHW, the plan channels-last (analytic costs): the masks must agree
    opt = optimize(model, torch.randn(4, 3, 12, 12), train=True, measure=False, cache=db)
    assert opt.plan.verification.ok
    assert {n.format for n in opt.plan.nodes if n.op == "Conv2d"} == {"channels_last"}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_dropout_on_channels_last_and_ambiguous_1x1_weights_verify(db, dtype) -> None:
    # Dropout draws its mask in memory order: on a channels-last activation the same seed drops
    # other elements than on NCHW (a real difference of the step, not of the layout), so the
    # verified step draws masks in logical order; the module's own mode is untouched.
    model = _DropoutHead().train()
    x = torch.randn(4, 3, 12, 12)
    opt = optimize(model, x, train=True, measure=False, cache=db, dtype=dtype)
    assert opt.plan.verification.ok and opt.plan.counts["channels_last"] > 0
    assert model.drop.training and all(m.training for m in opt.modules())
    torch.manual_seed(0)
    a = opt(x)
    torch.manual_seed(0)
    b = opt(x)
    assert torch.equal(a, b) and not torch.equal(a, model.eval()(x))  # dropout still drops
    model.train()
    # the SE weight's gradient agrees with its strides on every dim of size > 1
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = opt(x).float().square().mean()
    loss.backward()
    from memlayout.layout import strides_agree

    for name, p in opt.named_parameters():
        assert strides_agree(tuple(p.shape), tuple(p.stride()), tuple(p.grad.stride())), name


def test_gradient_strides_are_compared_on_dims_of_size_above_one() -> None:
    # a 1x1 convolution's weight (8, 8, 1, 1) is laid out the same with strides (8, 1, 1, 1)
    # and (8, 1, 8, 8); a gradient that comes back in the other one (bf16 autocast did, on
    # efficientnet_b0's squeeze-excitation weights) is not a mismatch, as autograd's gradient
    # layout contract and memlayout.train's DDP check say
    from memlayout.plan.check.training import verify_training

    reference = nn.Sequential(nn.Conv2d(8, 8, 1))
    planned = copy.deepcopy(reference)
    w = planned[0].weight
    w.register_hook(lambda g: g.contiguous().as_strided(g.shape, (8, 1, 8, 8)))
    result = verify_training(reference, planned, (torch.randn(2, 8, 4, 4),))
    assert result.ok
    planned.zero_grad(set_to_none=True)
    planned(torch.randn(2, 8, 4, 4)).sum().backward()
    assert w.grad.stride() == (8, 1, 8, 8) and w.stride() == (8, 1, 1, 1)  # the case is real


def test_a_gradient_the_original_does_not_give_is_a_difference() -> None:
    """Which parameters receive a gradient is compared, not only the values: a planned model
    that hands an unused parameter a zero gradient (an optimizer with weight decay would
    move it) differs from one that hands it none."""
    from memlayout.plan.check.training import verify_training

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.spare = nn.Parameter(torch.randn(4, 4, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    class Touches(Unused):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) + 0 * self.spare.sum()

    reference = Unused()
    planned = Touches()
    planned.load_state_dict(reference.state_dict())
    with pytest.raises(LayoutVerificationError, match="gradient of spare"):
        verify_training(reference, planned, (torch.randn(2, 3, 6, 6),))


def test_a_training_plan_keeps_tied_weights_one_parameter(db) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 3, 3, padding=1)
            self.b = nn.Conv2d(3, 3, 3, padding=1)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    model = Tied()
    reference = copy.deepcopy(model)
    opt = optimize(model, _x(), train=True, measure=False, cache=db, input_format="channels_last")
    assert opt.a.weight is opt.b.weight
    assert len(list(opt.parameters())) == len(list(reference.parameters())) == 3
    sgd, ref_sgd = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (opt, reference))
    for _ in range(2):
        x = _x()
        opt(x).square().mean().backward()
        reference(x).square().mean().backward()
        sgd.step()
        ref_sgd.step()
        sgd.zero_grad()
        ref_sgd.zero_grad()
    assert _close(opt.a.weight, reference.a.weight)
