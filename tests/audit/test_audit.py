"""The layout audit: recorder, attribution, strict mode, report.

Expectations come from torch at test time, never from a list of ops: each leaf module is
replayed on its own (its real input and incoming gradient, captured by hooks in an unaudited
run) and the replay's result and gradient strides say whether it drops channels-last.
"""

from __future__ import annotations

import copy
import html
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn

from memlayout import AuditMode, AuditReport, Format, LayoutDropError, audit, strict, to_format
from memlayout.audit import recorder
from memlayout.audit.recorder import NOT_RECORDED
from memlayout.audit.render import render_html
from memlayout.coverage import CoverageConfig, explain, run_coverage, save_to_cache
from memlayout.layout import formats_of
from memlayout.tensors import convert_module, iter_tensors

CL = Format.CHANNELS_LAST


# -- the second method: replay each leaf module alone -------------------------------------------
def _formats(t: torch.Tensor) -> frozenset[Format]:
    return formats_of(tuple(t.shape), tuple(t.stride()))


def _unambiguous(t: torch.Tensor, fmt: Format) -> bool:
    return t.dim() == fmt.rank and _formats(t) == {fmt}


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _out_of_format(t: torch.Tensor, fmt: Format) -> bool:
    return t.dim() == fmt.rank and fmt not in _formats(t)


def replay_drops(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor | None,
                 fmt: Format = CL) -> set[str]:
    """Phases in which ``module`` alone drops ``fmt``, judged only from torch's strides.

    Forward: its input is unambiguously in ``fmt`` and its result, not a view of the input, is
    of the format's rank but not in it, or is a reshaped copy of the input (a copy of a
    channels-last tensor into another rank goes through NCHW order). Backward: the incoming
    gradient or a tensor autograd saved is unambiguously in ``fmt``, and a gradient it returns
    (input or parameter), not a view of the incoming one, is of the rank but not in ``fmt``.
    """
    module = copy.deepcopy(module)
    leaf = x.detach().clone().requires_grad_(x.requires_grad)
    x = leaf.clone()  # same strides; lets in-place modules (ReLU(inplace=True)) run
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x)
    phases = set()
    if _unambiguous(x, fmt) and not _shares(y, x) and (
            _out_of_format(y, fmt) or (y.dim() != x.dim() and y.numel() == x.numel())):
        phases.add("forward")
    wrt = [t for t in [leaf, *module.parameters()] if t.requires_grad]
    if grad_out is not None and wrt:
        grads = torch.autograd.grad(y, wrt, grad_out, allow_unused=True)
        fed_in_format = _unambiguous(grad_out, fmt) or any(_unambiguous(s, fmt) for s in saved)
        if fed_in_format and any(g is not None and _out_of_format(g, fmt) and not _shares(g, grad_out)
                                 for g in grads):
            phases.add("backward")
    return phases


def expected_drops(model: nn.Module, inputs: torch.Tensor, fmt: Format = CL) -> set[tuple[str, str]]:
    """(module path, phase) of every drop, by replaying each leaf module of an unaudited run."""
    model = convert_module(copy.deepcopy(model), fmt)
    seen: dict[str, list] = {}
    handles = []
    for name, m in model.named_modules():
        if next(m.children(), None) is not None:
            continue

        def pre(mod, args, name=name):
            seen[name] = [args[0].detach().clone().requires_grad_(args[0].requires_grad), None]

        def post(mod, args, out, name=name):
            if out.requires_grad:
                out.register_hook(lambda g: seen[name].__setitem__(1, g.detach().clone()))

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    x = to_format(inputs, fmt)
    sum(t.sum() for t in iter_tensors(model(x))).backward()
    for h in handles:
        h.remove()
    mods = dict(model.named_modules())
    return {(name, phase) for name, (x_in, g) in seen.items()
            for phase in replay_drops(mods[name], x_in, g, fmt)}


# -- small models from single ops ---------------------------------------------------------------
class CatMixed(nn.Module):
    """cat of a channels-last tensor with a freshly made contiguous one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones(x.shape, dtype=x.dtype)], dim=1)


OPS = {
    "reflection_pad": lambda: nn.ReflectionPad2d(1),
    "replication_pad": lambda: nn.ReplicationPad2d(1),
    "group_norm": lambda: nn.GroupNorm(2, 8),
    "instance_norm": lambda: nn.InstanceNorm2d(8, affine=True),
    "interpolate_nearest": lambda: nn.Upsample(scale_factor=2, mode="nearest"),
    "interpolate_bilinear": lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
    "conv_transpose": lambda: nn.ConvTranspose2d(8, 8, 3, stride=2),
    "pixel_shuffle": lambda: nn.PixelShuffle(2),
    "cat_mixed": CatMixed,
    "flatten": nn.Flatten,
    "adaptive_pool_1x1": lambda: nn.AdaptiveAvgPool2d(1),
}


def op_net(op: nn.Module) -> nn.Sequential:
    """conv -> op -> (conv, or flatten + linear when the op leaves rank 4)."""
    probe = op(torch.randn(2, 8, 6, 6))
    if probe.dim() == 4:
        post: nn.Module = nn.Conv2d(probe.shape[1], 4, 1)
    else:
        post = nn.Sequential(nn.Flatten(), nn.Linear(probe[0].numel(), 3))
    return nn.Sequential(OrderedDict(pre=nn.Conv2d(4, 8, 1), op=op, post=post))


@pytest.mark.parametrize("name", sorted(OPS))
def test_single_op_drops_match_direct_check(name):
    model = op_net(OPS[name]())
    x = torch.randn(2, 4, 6, 6)
    truth = expected_drops(model, x)
    report = audit(model, x, train=True)
    found = {(r.module, r.phase) for r in report.drops}
    assert found == truth, f"{name}: audit {sorted(found)} vs direct check {sorted(truth)}"
    mods = dict(model.named_modules())
    for r in report.drops:
        assert r.module_type == type(mods[r.module]).__name__


def test_direct_check_sees_both_outcomes():
    # the op table is only a test if, on this build, it holds drops and non-drops alike
    results = [expected_drops(op_net(make()), torch.randn(2, 4, 6, 6)) for make in OPS.values()]
    assert any(results) and not all(results)


def test_resnet18_drops_match_replay_forward_and_backward():
    model = torchvision.models.resnet18(num_classes=10).train()
    x = torch.randn(2, 3, 32, 32)
    truth = expected_drops(model, x)
    report = audit(model, x, train=True)
    found = {(r.module, r.phase) for r in report.drops}
    assert found == truth
    assert report.summary.ops["forward"] > 0 and report.summary.ops["backward"] > 0
    # every module call that ran an op is a real module of the model, types included
    mods = dict(model.named_modules())
    for r in report.records:
        if r.module is not None:
            assert type(mods[r.module]).__name__ == r.module_type
            assert report.calls[r.call].module == r.module


def test_resnet18_conversions_match_profiler():
    """Second method for conversions: the profiler's copy-kind aten calls made from Python or
    by the autograd engine (the level a dispatch mode sees; copies inside kernels are not)."""
    model = convert_module(torchvision.models.resnet18(num_classes=10).train(), CL)
    x = to_format(torch.randn(2, 3, 32, 32), CL)
    copy_kinds = {"aten::clone", "aten::copy_", "aten::_to_copy"}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    copies = sum(1 for e in prof.events() if e.name in copy_kinds
                 and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    model.zero_grad(set_to_none=True)
    with AuditMode(model) as rec:
        model(x).sum().backward()
    recorded = [r for r in rec.report.records if r.op.split(".")[1] in {"clone", "copy_", "_to_copy"}]
    assert len(recorded) == copies
    assert rec.report.summary.conversions <= copies
    for r in rec.report.conversions:  # a conversion keeps shape and dtype and changes strides
        src = r.inputs[-1] if r.op.startswith("aten.copy_") else r.inputs[0]
        assert src.shape == r.outputs[0].shape and src.dtype == r.outputs[0].dtype
        assert src.strides != r.outputs[0].strides


def test_flatten_copy_is_a_conversion_with_its_bytes():
    x = to_format(torch.randn(2, 8, 5, 5), CL)
    copied = not _shares(x.flatten(1), x)  # torch decides whether flatten copies
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Flatten())
    report = audit(model, x)
    conv = [(r.module, r.phase, r.bytes) for r in report.conversions]
    assert conv == ([("1", "forward", x.numel() * x.element_size())] if copied else [])
    assert report.summary.conversion_bytes == sum(b for *_, b in conv)


def test_backward_ops_are_attributed_to_their_forward_module():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)
    x = to_format(torch.randn(2, 3, 10, 10), CL)
    with AuditMode(model) as rec:
        model(x).sum().backward()
    report = rec.report
    conv_bw = [r for r in report.records if r.op == "aten.convolution_backward.default"]
    relu_bw = [r for r in report.records if r.phase == "backward" and "threshold_backward" in r.op]
    assert sorted(r.module for r in conv_bw) == ["0", "2"]
    assert [r.module for r in relu_bw] == ["1"] and relu_bw[0].module_type == "ReLU"
    for r in conv_bw + relu_bw:  # attributed to the very call whose forward made the node
        fw = [f for f in report.records if f.phase == "forward" and f.call == r.call]
        assert fw and fw[0].module == r.module


def test_optimizer_phase():
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with AuditMode(model) as rec:
        model(torch.randn(1, 3, 6, 6)).sum().backward()
        opt.step()
    phases = [r.phase for r in rec.report.records]
    assert "optimizer" in phases and "backward" in phases
    # the optimizer phase starts after backward and nothing else follows it
    first_opt = phases.index("optimizer")
    assert set(phases[first_opt:]) == {"optimizer"} and "backward" not in phases[first_opt:]


def test_metadata_queries_are_not_recorded():
    x = to_format(torch.randn(2, 3, 4, 4), CL)
    with AuditMode() as rec:
        x.stride(), x.size(), x.is_contiguous(memory_format=torch.channels_last), x.dim()
        x.detach()
    assert rec.report.records == ()
    assert all(r.op.split(".")[1] not in {p.__name__ for p in NOT_RECORDED}
               for r in audit(op_net(nn.GroupNorm(2, 8)), torch.randn(2, 4, 6, 6), train=True).records)


@pytest.mark.parametrize("make", [lambda: torchvision.models.resnet18(num_classes=10).train(),
                                  lambda: op_net(nn.InstanceNorm2d(8, affine=True))])
def test_audited_run_equals_unaudited(make):
    model = convert_module(make(), CL)
    twin = copy.deepcopy(model)
    x = to_format(torch.randn(2, 3 if isinstance(model, torchvision.models.ResNet) else 4, 32, 32), CL)
    out_plain = twin(x)
    out_plain.sum().backward()
    with AuditMode(model):
        out = model(x)
        out.sum().backward()
    assert torch.equal(out, out_plain)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_audit_leaves_caller_objects_alone():
    model = nn.Sequential(nn.Conv2d(3, 4, 3))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    weight_strides = model[0].weight.stride()
    audit(model, x, train=True)
    assert x.grad is None and x.stride() == (192, 64, 8, 1)
    assert model[0].weight.stride() == weight_strides and model[0].weight.grad is None


# -- strict -------------------------------------------------------------------------------------
def test_strict_raises_at_first_drop_with_op_and_module():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 2))
    x = torch.randn(2, 3, 8, 8)
    first = sorted(expected_drops(model, x))  # from the replay, not from the audit
    assert first, "on this build flattening a channels-last activation should copy"
    record = audit(model, x).drops[0]
    net, xc = convert_module(copy.deepcopy(model), CL), to_format(x, CL)
    with pytest.raises(LayoutDropError) as err, strict(CL, model=net):
        net(xc)
    message = str(err.value)
    assert first[0][0] == record.module
    assert record.op in message and f"{record.module} ({record.module_type})" in message
    assert "forward" in message and "strides" in message and "float32" in message


class _DropsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class BackwardDropper(nn.Module):
    def forward(self, x):
        return _DropsInBackward.apply(x)


def test_strict_raises_in_backward():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), BackwardDropper(), nn.Conv2d(8, 4, 1))
    x = torch.randn(2, 3, 5, 5)
    assert expected_drops(model, x) == {("1", "backward")}
    net, xc = convert_module(model, CL), to_format(x, CL)
    with strict(CL, model=net):
        out = net(xc)  # forward is clean
    with pytest.raises(LayoutDropError, match=r"backward at 1 \(BackwardDropper\)"), strict(CL, model=net):
        net(xc).sum().backward()
    assert out.shape == (2, 4, 5, 5)


def test_strict_is_silent_without_drops():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    x = torch.randn(2, 3, 10, 10)
    assert expected_drops(model, x) == set()
    net = convert_module(copy.deepcopy(model), CL)
    with strict(CL, model=net):
        net(to_format(x, CL)).sum().backward()


# -- the report as data ---------------------------------------------------------------------------
def test_report_summary_and_json_round_trip():
    report = audit(op_net(CatMixed()), torch.randn(2, 4, 6, 6), train=True)
    s = report.summary
    assert s.drops == len(report.drops) == sum(s.drops_by_phase.values())
    assert s.conversions == len(report.conversions)
    assert s.conversion_bytes == sum(r.bytes for r in report.conversions)
    assert sum(g.total_drops for g in s.groups) == s.drops
    # bytes moved: each call once, a conversion's bytes else its results written out of format
    moved = sum(r.bytes if r.conversion else sum(
        o.nbytes for o in r.outputs if o.rank == 4 and not o.format.startswith(("channels_last", "ambiguous(channels_last")))
        for r in report.records if r.dropped or r.conversion)
    assert sum(g.bytes for g in s.groups) == moved
    assert 0 < s.activation_share <= 1
    assert AuditReport.from_dict(report.to_dict()) == report
    assert set(report.to_dict()) == {"schema", "format", "meta", "summary", "calls", "records"}


def test_ambiguous_outputs_are_shown_and_not_drops():
    report = audit(op_net(nn.AdaptiveAvgPool2d(1)), torch.randn(2, 4, 6, 6))
    pool = [r for r in report.records if r.module == "op"]
    assert pool and all(not r.dropped for r in pool)
    assert any(o.format.startswith("ambiguous(") for r in pool for o in r.outputs)


def test_segmentation_model_under_bf16_autocast():
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3)
    report = audit(model.eval(), torch.randn(1, 3, 32, 32), dtype="bf16")
    assert report.meta["dtype"] == "bfloat16"
    assert any(o.dtype == "bfloat16" for r in report.records for o in r.outputs)
    assert {r.module for r in report.records if r.op == "aten.convolution.default"} <= {
        n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def test_video_models_in_channels_last_3d():
    small = nn.Sequential(nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(),
                          nn.MaxPool3d(2), nn.Conv3d(8, 8, 3, padding=1), nn.Upsample(scale_factor=2),
                          nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 2))
    x = torch.randn(2, 3, 4, 8, 8)
    report = audit(small, x, train=True, fmt=Format.CHANNELS_LAST_3D)
    assert report.fmt == "channels_last_3d" and report.summary.activation_share is not None
    assert {(r.module, r.phase) for r in report.drops} == expected_drops(small, x, Format.CHANNELS_LAST_3D)
    r3d = audit(torchvision.models.video.r3d_18(num_classes=4).eval(), torch.randn(1, 3, 2, 16, 16),
                fmt=Format.CHANNELS_LAST_3D)
    assert any(o.format == "channels_last_3d" for r in r3d.records for o in r.outputs)
    # without a format, a rank-5 input is audited in channels_last_3d: the same report
    default = audit(small, x, train=True)
    assert default.fmt == "channels_last_3d"
    assert [(r.op, r.module, r.phase) for r in default.drops] == \
        [(r.op, r.module, r.phase) for r in report.drops]


def test_a_call_that_cannot_be_recorded_does_not_break_the_run(monkeypatch):
    def broken(shape, strides):
        raise RuntimeError("boom")

    monkeypatch.setattr(recorder, "_formats", broken)
    model = nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 3, 6, 6)
    with AuditMode(model) as rec:
        out = model(x)
    assert torch.equal(out, model(x))
    assert rec.report.meta["unrecorded"] >= 1 and "boom" in rec.report.meta["first_unrecorded"]


def test_drops_are_explained_from_the_coverage_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path))
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8), nn.CircularPad2d(1))
    x = torch.randn(2, 3, 10, 10)
    before = audit(model, x)
    dropped = {r.op for r in before.drops}
    assert dropped, "this model is expected to drop channels-last somewhere on any build"
    assert "coverage" not in before.meta  # nothing cached: nothing claimed
    for rep in run_coverage(CoverageConfig(ops="nn.functional.instance_norm,nn.functional.pad.circular", jobs=0)):
        save_to_cache(rep)
    after = audit(model, x)
    notes = after.meta.get("coverage", {})
    # Every note is exactly what the cache says about that op; every dropped op the cache
    # knows about gets one.
    expected = {op: explain(op, "cpu", "float32", CL) for op in dropped}
    assert notes == {op: s for op, s in expected.items() if s}
    assert notes, "the coverage runs of the ops that dropped must know their aten calls"
    page = render_html(after)
    assert all(html.escape(n) in page for n in notes.values())  # and the page shows them
