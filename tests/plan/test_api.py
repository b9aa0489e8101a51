"""memlayout.optimize on tiny models: same results, state dicts interchangeable, the caller's
model untouched, the cache used, conversions only where planned, errors that say what."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlayout
from memlayout import Format, format_of
from memlayout.errors import CaptureError, LayoutVerificationError, PlanError
from memlayout.plan.capture.regions import capture
from memlayout.plan.costs.measure import CostCache, measure_costs
from memlayout.plan.graph import Label, Request
from tests.support.counting import conv_inputs
from tests.support.models import Branchy, Features
from tests.support.planted import corrupt_the_plan_at


class Untraceable(nn.Module):
    """Data-dependent control flow at the top; traceable children."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Features()
        self.other = nn.Sequential(nn.Conv2d(3, 8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.net(x)
        return self.other(x)


def _x(n: int = 2, size: int = 12) -> torch.Tensor:
    return torch.randn(n, 3, size, size)


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    return {k: (v.clone(), tuple(v.stride())) for k, v in model.state_dict().items()}


def _same(snap: dict, model: nn.Module) -> bool:
    now = model.state_dict()
    return snap.keys() == now.keys() and all(
        torch.equal(v, now[k]) and s == tuple(now[k].stride()) for k, (v, s) in snap.items())


@pytest.fixture
def db(tmp_path):
    return tmp_path / "costs.sqlite"


def test_optimized_equals_original_and_leaves_it_unchanged(db) -> None:
    model, x = Branchy().eval(), _x()
    snap = _snapshot(model)
    opt = memlayout.optimize(model, x, cache=db, rounds=1)
    assert _same(snap, model)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert opt.plan.verification.ok
    assert opt.plan.measured > 0


def test_state_dicts_load_both_ways(db) -> None:
    model = Branchy().eval()
    opt = memlayout.optimize(model, _x(), cache=db, rounds=1)
    assert list(opt.state_dict()) == list(model.state_dict())
    other = Branchy().eval()
    opt.load_state_dict(other.state_dict())  # strict
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), other(x), rtol=1e-4, atol=1e-5)
    fresh = Branchy()
    fresh.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                  other.state_dict().values(), strict=True))


def test_second_plan_measures_nothing(db) -> None:
    model = Branchy().eval()
    first = memlayout.optimize(model, _x(), cache=db, rounds=1)
    second = memlayout.optimize(model, _x(), cache=db, rounds=1, reuse=False)
    assert first.plan.measured > 0
    assert second.plan.measured == 0 and second.plan.cached >= first.plan.measured
    third = memlayout.optimize(model, _x(), cache=db, rounds=1)  # the stored plan, rebuilt
    assert third.plan.measured == 0 and third.plan.notes[-1].startswith("the plan stored")
    assert [n.format for n in third.plan.nodes] == [n.format for n in first.plan.nodes]


def test_default_cache_dir_follows_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "c"))
    memlayout.optimize(Features().eval(), _x(1, 8), rounds=1)
    assert (tmp_path / "c" / "costs.sqlite").is_file()


def test_mlp_is_a_noop_measuring_nothing(db) -> None:
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    opt = memlayout.optimize(mlp, torch.randn(4, 16), cache=db)
    assert opt.plan.nodes == [] and opt.plan.conversions == []
    assert opt.plan.measured == 0 and opt.plan.cached == 0


def test_conversions_only_where_planned_and_weights_follow_their_node(db) -> None:
    # guard=False: the plan itself (measured costs may mix formats)
    opt = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1, guard=False)
    chosen = {n.name: n.format for n in opt.plan.nodes}
    convs = {name: m for name, m in opt.named_modules() if isinstance(m, nn.Conv2d)}
    for name, conv in convs.items():  # fx names a module call by its path, dots as _
        assert Format.parse(chosen[name.replace(".", "_")]) in _formats(conv.weight), name
    # what each convolution really receives, counted where it runs (a second method): its
    # input in the format the plan gave its node
    seen = conv_inputs(opt, _x())
    for name, fmt in seen:
        assert Format.parse(chosen[name.replace(".", "_")]) in _formats_of(fmt), name
    # every conversion is at a module boundary, and only where the plan says
    steered = {path for path, m in opt.named_modules() if "forward" in m.__dict__}
    assert {c.module for c in opt.plan.conversions} <= steered
    assert len(opt.plan.conversions) == sum(
        len(b.inputs) + len(b.outputs) for m in opt.modules() if "forward" in m.__dict__
        for b in m.forward.boundaries.values())


def _formats_of(answer) -> set[Format]:
    return set(answer) if isinstance(answer, frozenset) else {answer}


def _formats(t: torch.Tensor) -> set[Format]:
    f = format_of(t)
    return set(f) if isinstance(f, frozenset) else {f}


def test_output_format_is_kept_unless_released(db) -> None:
    model, x = Features().eval(), _x()
    with torch.no_grad():
        want = format_of(model(x))
    opt = memlayout.optimize(model, x, cache=db, rounds=1)
    with torch.no_grad():
        assert format_of(opt(x)) == want
    cl = memlayout.optimize(model, x, cache=db, output_format="channels_last", rounds=1)
    with torch.no_grad():
        assert format_of(cl(x)) == Format.CHANNELS_LAST


def test_channels_last_input_needs_no_input_conversion(db) -> None:
    model = Features().eval()
    x = memlayout.to_format(_x(), Format.CHANNELS_LAST)
    opt = memlayout.optimize(model, x, cache=db, input_format="channels_last",
                             output_format=None, measure=False)
    # analytical costs favour channels-last convolutions: nothing to convert at all
    assert {n.format for n in opt.plan.nodes if n.op == "Conv2d"} == {"channels_last"}
    assert [c.value for c in opt.plan.conversions if c.value == "x"] == []


@pytest.mark.parametrize("model_cls", [Branchy, Features])
def test_auto_input_format_is_the_better_of_the_two_pinned_ones(db, model_cls) -> None:
    # the input's format as one more variable: the optimum is the best over both pinnings
    # (a second method: two solves with the input fixed), and that format is what it asks for.
    # The output format is fixed: "keep" would follow the example's format, which differs.
    model, x = model_cls().eval(), _x()
    kw = dict(cache=db, measure=False, output_format="contiguous")
    pinned = {fmt: memlayout.optimize(model, x, input_format=fmt, **kw).plan
              for fmt in ("contiguous", "channels_last")}
    auto = memlayout.optimize(model, x, input_format="auto", **kw)
    best = min(pinned.values(), key=lambda p: p.predicted["planned"])
    assert auto.plan.predicted["planned"] == pytest.approx(best.predicted["planned"], rel=1e-6)
    assert auto.plan.input_format in pinned
    assert auto.plan.predicted["planned"] == pytest.approx(
        pinned[auto.plan.input_format].predicted["planned"], rel=1e-6)
    assert not any(c.value == "x" for c in auto.plan.conversions)  # arrives as it should
    assert any("input_format='auto'" in n for n in auto.plan.notes)
    seen = []  # what the first module receives: the input converted on entry
    next(auto.children()).register_forward_pre_hook(lambda m, args: seen.append(format_of(args[0])))
    with torch.no_grad():  # an NCHW batch is converted on entry; the result is the same
        torch.testing.assert_close(auto(x), model(x), rtol=1e-4, atol=1e-5)
    assert seen == [Format.parse(auto.plan.input_format)]
    (ready,) = memlayout.prepare_inputs(auto, x)  # converted once, before a loop
    assert format_of(ready) == Format.parse(auto.plan.input_format)
    assert memlayout.prepare_inputs(auto, ready)[0] is ready


def test_auto_inputs_pinned_once_chosen_hold_in_later_solves() -> None:
    # after the guard, a memory budget's candidate plans are solved again (conversion bytes
    # weighed more): the inputs' format is settled by then and they must keep it
    from memlayout.plan.check.memory import PENALTIES, _labels_weighing_bytes
    from memlayout.plan.solve.formulate import formulate
    from memlayout.plan.solve.mincut import solve_min_cut
    from memlayout.plan.solve.regions import RegionSolution

    x = _x()
    region = capture(Branchy().eval(), (x,)).regions[0]
    table = measure_costs(region.gm, (x,), measure=False)
    form = formulate(region.gm, table, input_label=Request.AUTO, output_label=Request.KEEP)
    labels = solve_min_cut(form.integer).labels
    assert labels["x"] == 1  # analytic costs: channels-last convolutions, the input with them
    for label in (0, 1):
        pinned_solution = RegionSolution(region, table, form, labels).pin_inputs(label)
        pinned, relabelled = pinned_solution.form, pinned_solution.labels
        assert relabelled["x"] == label and pinned.integer.pins["x"] == label
        assert all(_labels_weighing_bytes(pinned, table, p)["x"] == label for p in PENALTIES)
        if label == 0:  # solved again: the labels of a plan whose input was pinned from the start
            assert relabelled == solve_min_cut(formulate(
                region.gm, table, input_label=Label.CONTIGUOUS, output_label=Request.KEEP).integer).labels | {"x": 0}


def test_inputs_already_in_the_plans_format_pass_untouched() -> None:
    from memlayout.plan.steer.state import _call_signature, shape_signature

    opt = memlayout.optimize(Features().eval(), _x(), measure=False, input_format="channels_last")
    arrive = opt.memlayout.arrive
    cl = memlayout.to_format(torch.randn(2, 3, 8, 8), Format.CHANNELS_LAST)
    args = (cl, 3)
    assert arrive(args, {})[0][0] is cl  # one stride check, no copy
    nchw = (cl.contiguous(), torch.randn(2, 3, 4, 8, 8), [torch.randn(2, 3, 8, 8)])
    moved, _ = arrive(nchw, {})
    assert format_of(moved[0]) is Format.CHANNELS_LAST
    assert format_of(moved[1]) is Format.CHANNELS_LAST_3D
    assert format_of(moved[2][0]) is Format.CHANNELS_LAST  # nested: the full walk
    for a, kw in ((args, {}), (nchw, {}), ((cl,), {"mask": cl})):
        assert _call_signature(a, kw) == shape_signature((a, kw))


def test_plan_json_round_trip(db) -> None:
    plan = memlayout.optimize(Branchy().eval(), _x(), cache=db, rounds=1).plan
    again = memlayout.Plan.from_json(plan.to_json())
    assert again == plan


def test_groupnorm_is_modelled_as_what_it_does(db) -> None:
    gm = capture(Branchy().eval(), (_x(),)).regions[0].gm
    table = measure_costs(gm, (_x(),), cache=CostCache(db), rounds=1)
    gn = nn.GroupNorm(2, 8)
    for label, fmt in ((0, Format.CONTIGUOUS), (1, Format.CHANNELS_LAST)):
        out = format_of(gn(memlayout.to_format(torch.randn(2, 8, 12, 12), fmt)))
        expected = 0 if out is Format.CONTIGUOUS else 1 if out is Format.CHANNELS_LAST else out
        assert table.nodes["gn"].out[label] == expected


def test_fallback_to_traceable_submodules_says_so(db) -> None:
    model, x = Untraceable().eval(), _x().abs()
    snap = _snapshot(model)
    opt = memlayout.optimize(model, x, cache=db, rounds=1)
    assert opt.plan.uncaptured and opt.plan.uncaptured[0][0] == ""
    assert "net" in opt.plan.regions and "other" not in opt.plan.regions  # never called
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    assert _same(snap, model)


@pytest.mark.parametrize("bad", [
    dict(example_inputs=torch.randn(2, 5, 12, 12), error=CaptureError, names="stem"),
    dict(example_inputs=torch.randn(2, 3, 12, 12), dtype="int8", error=PlanError, names="int8"),
    dict(example_inputs=torch.randn(2, 3, 12, 12), input_format="nlc", error=PlanError,
         names="input_format"),
    dict(example_inputs="a picture", error=PlanError, names="str"),
])
def test_bad_input_is_a_clear_error_and_model_unchanged(db, bad) -> None:
    model = Branchy().eval()
    snap = _snapshot(model)
    kwargs = {k: v for k, v in bad.items() if k in ("dtype", "input_format")}
    with pytest.raises(bad["error"], match=bad["names"]):
        memlayout.optimize(model, bad["example_inputs"], cache=db, **kwargs)
    assert _same(snap, model)


@pytest.mark.isa  # how far NHWC and NCHW kernels round apart differs per ISA
def test_bf16_plan_runs_under_autocast(db) -> None:
    model, x = Features().eval(), _x()
    opt = memlayout.optimize(model, x, dtype="bf16", cache=db, rounds=1)
    assert opt.plan.dtype == "bfloat16"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
    with torch.no_grad():
        got = opt(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


class Viewing(nn.Module):
    """``.view`` of a conv output: fails on a channels-last tensor, so it must be fed NCHW."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 10 * 10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.fc(y.view(y.size(0), -1))


def test_an_op_failing_in_one_format_is_pinned_to_the_other(db) -> None:
    model, x = Viewing().eval(), _x()
    cl = memlayout.to_format(torch.randn(2, 4, 10, 10), Format.CHANNELS_LAST)
    with pytest.raises(RuntimeError):  # what torch itself says: a view cannot do it
        cl.view(2, -1)
    opt = memlayout.optimize(model, x, cache=db, rounds=1)
    view = next(n for n in opt.plan.nodes if n.op == ".view")
    assert view.format == "contiguous" and view.seconds["channels_last"] is None
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


class Opaque(nn.Module):
    """Data-dependent control flow and no submodules: nothing torch.fx can capture."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, self.w) if x.sum() > 0 else x


def test_an_uncapturable_model_is_a_capture_error(db) -> None:
    model = Opaque()
    snap = _snapshot(model)
    with pytest.raises(CaptureError, match="no part of Opaque could be traced"):
        memlayout.optimize(model, _x(), cache=db)
    assert _same(snap, model)


class PermuteBlock(nn.Module):
    """ConvNeXt's pattern: conv, permute to NHWC shape, LayerNorm over C, permute back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(x).permute(0, 2, 3, 1))
        return y.permute(0, 3, 1, 2)


def test_permute_runs_where_its_output_has_a_format(db) -> None:
    model, x = PermuteBlock().eval(), _x()
    y = torch.randn(2, 8, 12, 12)
    from_cl = memlayout.to_format(y, Format.CHANNELS_LAST).permute(0, 2, 3, 1)
    assert format_of(from_cl) is Format.CONTIGUOUS  # torch: NHWC memory, NHWC shape: dense
    assert format_of(y.permute(0, 2, 3, 1)) is None  # NCHW memory: a strided view
    # the analytical costs: a measured plan (and its whole-model guard) would make the label
    # depend on this machine's timings, and a test must not
    opt = memlayout.optimize(model, x, measure=False)
    first = next(n for n in opt.plan.nodes if n.op == ".permute")
    assert first.format == "channels_last"
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_wrong_plan_is_never_returned(db, monkeypatch) -> None:
    corrupt_the_plan_at(monkeypatch, "a", lambda out: out * 1.5)
    model, x = Features().eval(), _x()
    snap = _snapshot(model)
    with pytest.raises(LayoutVerificationError, match=r"first module whose output differs: a \(Conv2d\)"):
        memlayout.optimize(model, x, measure=False, output_format=None, fallback=False)
    assert _same(snap, model)
    # by default the plan gives way to the model run in one format, verified, and says why
    with pytest.warns(UserWarning, match=r"outputs differ at a \(Conv2d\).*kept all_"):
        opt = memlayout.optimize(model, x, measure=False, output_format=None)
    assert _same(snap, model)
    kept = opt.plan.guard.kept
    assert kept in ("all_channels_last", "all_contiguous") and opt.plan.verification.ok
    assert any("failed verification" in n and f"kept {kept}" in n for n in opt.plan.notes)
    assert f"kept {kept}" in opt.plan.summary()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_a_wrong_plan_of_a_submodule_is_named_and_never_returned(db, monkeypatch) -> None:
    corrupt_the_plan_at(monkeypatch, "net.0", lambda out: out * 1.5)
    model, x = Untraceable().eval(), _x().abs()
    model.net = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Conv2d(64, 64, 3))  # wide: worth NHWC
    snap = _snapshot(model)
    # planned at its traceable child "net" only; the whole model is compared, the module named
    with pytest.raises(LayoutVerificationError, match=r"differs: net.0 \(Conv2d\)"):
        memlayout.optimize(model, x, measure=False, fallback=False)
    assert _same(snap, model)
