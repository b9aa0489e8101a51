"""Capture of what really runs: grad-mode regions, containers, attribute reads, keyword inputs,
attention tensors, and the coverage a plan states (checked against the original model and
against convolution calls counted where Python makes them)."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
from torch import nn

import memlayout
from memlayout.plan.report.plan import Plan
from tests.support.counting import conv_calls


def grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient (by state-dict name) after ``model(x).sum().backward()``."""
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return {k: v.grad for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, nn.Parameter)}


class Frozen(nn.Module):
    """A stem run under ``torch.no_grad()`` inside forward: it must never get a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.stem(x)
        return self.head(torch.relu(x))


def test_an_inference_plan_put_in_train_mode_keeps_the_no_grad_region() -> None:
    model, x = Frozen().eval(), torch.randn(2, 3, 12, 12)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    opt.train()
    got = grads(opt, x)
    want = grads(model.train(), x)
    assert want["stem.weight"] is None and want["head.weight"] is not None
    assert got.keys() == want.keys()
    for name, g in want.items():
        assert (got[name] is None) == (g is None), name
        if g is not None:
            torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5)


def test_a_training_plan_keeps_the_no_grad_region() -> None:
    model, x = Frozen().train(), torch.randn(2, 3, 12, 12)
    opt = memlayout.optimize(model, x, measure=False, cache=False, train=True)
    assert opt.plan.verification.train and opt.plan.verification.ok
    assert grads(opt, x)["stem.weight"] is None


class Autocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = self.a(x)
        return self.b(x.float())


def test_an_autocast_region_inside_forward_is_kept() -> None:
    model, x = Autocast().eval(), torch.randn(1, 3, 12, 12)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=0, atol=0)
    assert opt.plan.coverage.planned == opt.plan.coverage.total == conv_calls(model, x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)])
        self.output_stride = 1

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = []
        for block in self.blocks:
            x = torch.relu(block(x))
            feats.append(x)
        return feats

    def channels(self) -> int:
        return self.blocks[-1].out_channels


class DataDependent(nn.Module):
    """Control flow on a tensor's value at the top (neither fx nor export takes it whole), a
    container of heads never called itself, and an attribute of a submodule read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.heads = nn.ModuleDict({"a": nn.Conv2d(8, 2, 1), "b": nn.Conv2d(8, 2, 1)})

    @property
    def stride(self) -> int:
        return self.encoder.output_stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.encoder(x)
        head = self.heads["a"] if x.sum() > 0 else self.heads["b"]
        return head(feats[-1]) * self.encoder.output_stride


def test_a_model_not_captured_whole_plans_its_parts_inside_containers() -> None:
    model, x = DataDependent().eval(), torch.rand(2, 3, 12, 12)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    plan = opt.plan
    assert plan.uncaptured[0][0] == "" and "torch.export" in plan.uncaptured[0][1]
    assert "encoder" in plan.regions and "heads.a" in plan.regions  # inside the ModuleDict
    assert plan.coverage.total == conv_calls(model, x)
    assert plan.coverage.planned == plan.coverage.total
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)
    text = plan.summary()
    assert "planned 3 of 3 convolution calls (100 %)" in text and "not captured whole" in text


def test_the_planned_model_is_a_drop_in() -> None:
    model, x = DataDependent().eval(), torch.rand(2, 3, 12, 12)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    assert opt.encoder.output_stride == 1 and opt.stride == 1 and opt.encoder.channels() == 8
    assert isinstance(opt.encoder, Encoder) and isinstance(opt.heads, nn.ModuleDict)
    assert list(opt.state_dict()) == list(model.state_dict())
    other = DataDependent().eval()
    opt.load_state_dict(other.state_dict())
    model.load_state_dict(opt.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(opt(x), other(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model(x), other(x), rtol=0, atol=0)


class Scale(nn.Module):
    """Multiplies by a tensor it makes in forward: ``torch.export`` lifts it as a constant of
    the graph (``ExportedProgram.constants``), named at this module's depth."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([0.5, 2.0]).view(1, 2, 1, 1)


class ListHead(nn.Module):
    """Called with a list of feature maps, as torchvision's RPN head (an exported graph takes
    them as separate placeholders), with a branch on a shape that torch.fx cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.scale = nn.Conv2d(8, 2, 1), Scale()

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        if feats[0].shape[-1] > 1:
            feats = [self.conv(f) for f in feats]
        return [self.scale(f) for f in feats]


class Pyramid(nn.Module):
    """Two feature maps into a :class:`ListHead`; ``gate``: a branch on a value at the top
    (only the parts are captured: the head alone, exported), else exported whole."""

    def __init__(self, gate: bool) -> None:
        super().__init__()
        self.gate = gate
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = ListHead()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        a = self.stem(x)
        outs = self.head([a, self.down(a)])
        if self.gate and x.sum() > 0:
            outs = [o + 1 for o in outs]
        return outs


@pytest.mark.parametrize("gate", [False, True])
def test_lifted_constants_and_a_part_called_with_a_list(gate: bool) -> None:
    model, x = Pyramid(gate).eval(), torch.rand(2, 3, 8, 8)
    opt = memlayout.optimize(model, x, measure=False, cache=False, memory=False)
    plan = opt.plan
    assert plan.regions == (["stem", "down", "head"] if gate else [""]), plan.regions
    assert "torch.export" in plan.coverage.methods and plan.verification.ok
    assert plan.coverage.planned == plan.coverage.total == conv_calls(model, x)
    # the constant stays on the graph analysis traced: the planned model gains nothing
    assert not any(k.startswith("lifted_tensor") for m in opt.modules() for k in vars(m))
    assert list(opt.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        for xs in (x, torch.rand(2, 3, 8, 8), -torch.rand(3, 3, 8, 8)):
            for got, want in zip(opt(xs), model(xs), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class Gate(nn.Module):
    """A branch on a tensor's value: neither torch.fx nor torch.export takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) if x.mean() > 0 else self.conv(x) * 2


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.gate, self.head = nn.Conv2d(3, 8, 3, padding=1), Gate(), \
            nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.stem(x)))


def test_a_part_not_captured_is_one_line_and_torchs_whole_text_goes_to_the_debug_log(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    model, x = Gated().eval(), torch.randn(2, 3, 8, 8)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(Exception) as torch_says:
        torch.export.export(model.gate, (torch.randn(2, 8, 8, 8),), strict=False)
    whole = str(torch_says.value).strip()
    assert len(whole.splitlines()) > 1  # torch's message runs on, and it prints the graph
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG, logger="memlayout"):
        plan = memlayout.optimize(model, x, measure=False, cache=False, memory=False).plan
    printed = capfd.readouterr()
    assert not printed.out and not printed.err
    assert [path for path, _ in plan.uncaptured] == ["", "gate"]  # its convolution is planned
    assert plan.coverage.planned == plan.coverage.total == conv_calls(model, x)
    # the whole model and its gate fail for the same reason: one line for both
    lines = [line for line in plan.summary().splitlines() if line.startswith("not captured")]
    assert len(lines) == 1 and "(whole model), gate: torch.fx: TraceError:" in lines[0]
    assert not any(line in lines[0] for line in whole.splitlines()[1:] if line.strip())
    assert "\n" not in plan.coverage.text()
    assert f"Gate not captured by torch.export: {type(torch_says.value).__name__}: {whole}" \
        in caplog.text


class Attention(nn.Module):
    """Convolutions around a self-attention whose scores are rank 4 (batch, heads, tokens,
    tokens): the scores are no image."""

    def __init__(self, c: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.stem, self.qkv, self.out = nn.Conv2d(3, c, 3, padding=1), nn.Linear(c, 3 * c), \
            nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        q, k, v = self.qkv(tokens).reshape(b, h * w, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        y = (scores @ v).transpose(1, 2).reshape(b, h * w, c).transpose(1, 2).reshape(b, c, h, w)
        return self.out(y + x)


def test_attention_tensors_are_not_layout_nodes() -> None:
    model, x = Attention().eval(), torch.randn(2, 3, 8, 8)
    opt = memlayout.optimize(model, x, measure=False, cache=False)
    ops = {n.op for n in opt.plan.nodes}
    assert not any(word in op for op in ops for word in ("matmul", "softmax", "permute")), ops
    assert any("Conv2d" in op for op in ops)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-5)


class Skip(nn.Module):
    """A skip input joined only when it is a tensor (MONAI's ``UpCat``): torch.fx sees a
    Proxy and records the other branch, whose graph fails on the example (``cat``: the last
    convolution expects the skip's channels too) or computes other values (``add``)."""

    def __init__(self, join: str) -> None:
        super().__init__()
        self.join = join
        self.up = nn.Conv2d(4, 4, 3, padding=1)
        self.out = nn.Conv2d(8 if join == "cat" else 4, 2, 1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
        y = self.up(x)
        if isinstance(skip, torch.Tensor):
            y = torch.cat([skip, y], 1) if self.join == "cat" else y + skip
        return self.out(y)


@pytest.mark.parametrize("join", ["cat", "add"])
def test_a_torch_fx_graph_that_is_not_forward_gives_way_to_torch_export(join: str) -> None:
    model, args = Skip(join).eval(), (torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8))
    opt = memlayout.optimize(model, args, measure=False, cache=False, memory=False)
    plan = opt.plan
    assert plan.regions == [""] and plan.coverage.methods == ("torch.export",)
    assert plan.coverage.planned == plan.coverage.total == conv_calls(model, *args)
    assert plan.verification.ok
    with torch.no_grad():
        torch.testing.assert_close(opt(*args), model(*args), rtol=1e-4, atol=1e-5)


class Keyed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.conv(x) * scale + shift


def test_keyword_inputs() -> None:
    model, x, shift = Keyed().eval(), torch.randn(2, 3, 8, 8), torch.randn(1, 4, 1, 1)
    opt = memlayout.optimize(model, x, kwargs={"shift": shift, "scale": 2.0}, measure=False,
                             cache=False)
    assert opt.plan.model == "Keyed"
    with torch.no_grad():
        torch.testing.assert_close(opt(x, shift=shift, scale=2.0),
                                   model(x, shift=shift, scale=2.0), rtol=1e-4, atol=1e-5)
        # the model's own forward runs: other keywords do what they do in the original
        torch.testing.assert_close(opt(x, shift=shift, scale=3.0),
                                   model(x, shift=shift, scale=3.0), rtol=1e-4, atol=1e-5)
        for missing in ({}, {"scale": 2.0}):
            with pytest.raises(TypeError) as want:
                model(x, **missing)
            with pytest.raises(TypeError) as got:
                opt(x, **missing)
            assert str(got.value) == str(want.value)
    assert list(opt.state_dict()) == list(model.state_dict())


class Conditioned(nn.Module):
    """A keyword input that is a dict of tensors (diffusers' ``added_cond_kwargs``): the
    exported graph takes its leaves, one placeholder each."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, *, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.conv(x) * cond["scale"][:, :, None, None] + cond["shift"]


def test_a_keyword_input_holding_a_dict_of_tensors() -> None:
    model, x = Conditioned().eval(), torch.randn(2, 3, 8, 8)
    cond = {"scale": torch.randn(2, 4), "shift": torch.randn(2, 4, 1, 1)}
    opt = memlayout.optimize(model, x, kwargs={"cond": cond}, measure=False, cache=False,
                             memory=False)
    assert opt.plan.verification.ok and opt.plan.regions == [""]
    assert opt.plan.coverage.planned == opt.plan.coverage.total == conv_calls(model, x, cond=cond)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, cond=cond), model(x, cond=cond), rtol=1e-4, atol=1e-5)


def test_coverage_goes_through_json() -> None:
    model, x = DataDependent().eval(), torch.rand(2, 3, 12, 12)
    plan = memlayout.optimize(model, x, measure=False, cache=False).plan
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.coverage == plan.coverage
    assert back.coverage.text() == plan.coverage.text()


class Counting(nn.Module):
    """Updates a buffer in place in forward, as timm's BatchNormAct2d updates
    num_batches_tracked: torch.fx would run that once while tracing, not record it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
        return nn.functional.dropout(self.bn(self.conv(x)), 0.5, self.training)


def test_a_buffer_updated_in_forward_and_dropout_train_as_the_original() -> None:
    torch.manual_seed(0)
    model, x = Counting().train(), torch.randn(2, 3, 8, 8)
    opt = memlayout.optimize(model, x, measure=False, cache=False, train=True)
    assert opt.plan.verification.ok and opt.plan.coverage.methods == ("torch.export",)
    before = int(opt.state_dict()["calls"])
    opt(x)
    assert int(opt.state_dict()["calls"]) == before + 1


def test_a_planned_module_saves_loads_and_copies() -> None:
    import copy
    import io

    model, x = Frozen().eval(), torch.randn(2, 3, 12, 12)  # exported: a kept no_grad region
    planned = memlayout.optimize(model, x, measure=False, cache=False)
    buf = io.BytesIO()
    torch.save(planned, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for other in (loaded, copy.deepcopy(planned)):
            assert type(other) is Frozen and type(other) is type(planned)
            torch.testing.assert_close(other(x), model(x), rtol=1e-4, atol=1e-5)
            # the plan and its steering came along
            assert other.plan == planned.plan and other.memlayout.plan == planned.plan
            steered = {p for p, m in other.named_modules() if "forward" in m.__dict__}
            assert steered == {p for p, m in planned.named_modules() if "forward" in m.__dict__}
