"""L1 bridge: format_of / to_format / convert_module / convert_batch against torch."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from torch import nn

from memlayout import Format, LayoutError, convert_batch, convert_module, format_of, to_format
from memlayout.layout import channels_last_for_rank, formats_for_rank, strides_for
from memlayout.plan.compilers import backend_plan
from memlayout.plan.steer import boundary
from memlayout.tensors import to_dense
from tests.support.formats import TORCH_FORMATS, torch_formats
from tests.support.strategies import strided_tensors


@settings(max_examples=300, deadline=None)
@given(strided_tensors())
def test_format_of_agrees_with_is_contiguous(t):
    answer = format_of(t)
    expected = torch_formats(t)
    if not expected:
        assert answer is None
    elif len(expected) == 1:
        assert answer == next(iter(expected))
    else:
        assert answer == expected
    for fmt, mf in TORCH_FORMATS.items():
        if fmt.rank in (None, t.dim()):
            found = answer is fmt or (isinstance(answer, frozenset) and fmt in answer)
            assert found == t.is_contiguous(memory_format=mf)


@settings(max_examples=300, deadline=None)
@given(strided_tensors(min_rank=3))
def test_to_format_keeps_values_and_gives_canonical_strides(t):
    for fmt in formats_for_rank(t.dim()):
        y = to_format(t, fmt)
        assert torch.equal(y, t)
        assert y.stride() == strides_for(t.shape, fmt)
        if t.stride() == strides_for(t.shape, fmt):
            assert y is t


def test_to_format_fixes_ambiguous_strides_that_contiguous_keeps():
    # The tutorial's trap: .contiguous(memory_format=channels_last) is a no-op on C == 1.
    x = torch.randn(4, 1, 4, 4)
    assert x.contiguous(memory_format=torch.channels_last).stride() == x.stride()
    y = to_format(x, Format.CHANNELS_LAST)
    assert y.stride() == torch.empty(4, 1, 4, 4, memory_format=torch.channels_last).stride()
    assert y.data_ptr() == x.data_ptr()  # restrided, not copied
    assert torch.equal(y, x)


def test_to_format_is_differentiable():
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    y = to_format(x, Format.CHANNELS_LAST)
    (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
    assert torch.equal(x.grad, torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape))


@pytest.mark.parametrize("shape", [(1, 4, 6, 6), (1, 4, 6, 6, 6), (2, 3, 5, 5), (1, 4, 6)])
def test_a_conversions_gradient_comes_back_in_the_sources_format(shape):
    """The op before a conversion runs its backward with its tensors in one format, as in
    the model never converted: an instance norm at batch size 1 (a torch CPU kernel that
    mishandles a channels-last gradient for a contiguous input) gets the gradient the
    unconverted model gets."""
    fmt = channels_last_for_rank(len(shape))
    x, upstream = torch.randn(shape), torch.randn(shape)
    seen = []
    # the plan's conversion, the steering's at module boundaries, the backend's in a graph
    converters = {"to_format": lambda t: to_format(t, fmt),
                  "to_dense": lambda t: to_dense(t, fmt),
                  "boundary": lambda t: boundary.to_label(t, 1),
                  "backend": lambda t: backend_plan.to_label(t, 1, (len(shape),))}

    def grad(convert=None) -> torch.Tensor:
        leaf = x.clone().requires_grad_(True)
        y = nn.functional.instance_norm(leaf, eps=1e-5)
        y.register_hook(lambda g: seen.append(g.stride()))
        if convert is not None:
            y = convert(y)
        (out,) = torch.autograd.grad(torch.relu(y), leaf, upstream)
        return out

    want = grad()
    for convert in converters.values():
        torch.testing.assert_close(grad(convert), want, rtol=1e-5, atol=1e-6)
        assert seen[-1] == strides_for(shape, Format.CONTIGUOUS)  # the source's own strides
    # from a channels-last source, back in channels-last
    source = to_format(torch.randn(shape), fmt).requires_grad_(True)
    source.register_hook(lambda g: seen.append(g.stride()))  # before AccumulateGrad restrides
    to_format(source, Format.CONTIGUOUS).backward(torch.ones(shape))
    assert seen[-1] == strides_for(shape, fmt)


def test_a_jit_trace_of_a_conversion_in_grad_mode_records_torchs_own_ops():
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    for convert in (lambda t: to_format(t, Format.CHANNELS_LAST),
                    lambda t: to_dense(t, Format.CHANNELS_LAST),
                    lambda t: to_dense(t[..., 0], Format.CHANNELS_LAST_1D)):
        traced = torch.jit.trace(convert, (x,), check_trace=False)
        assert "PythonOp" not in str(traced.graph)  # no Python autograd function in it
        replayed, direct = traced(x), convert(x)
        assert torch.equal(replayed, direct) and replayed.stride() == direct.stride()


def test_to_format_rank_error_names_shape_and_allowed():
    with pytest.raises(LayoutError) as info:
        to_format(torch.empty(2, 3, 4), Format.CHANNELS_LAST)
    assert "rank 3" in str(info.value) and "CHANNELS_LAST_1D" in str(info.value)


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3)
        self.c2 = nn.Conv2d(3, 4, 3)
        self.c3 = nn.Conv3d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)
        self.tokens = nn.Parameter(torch.randn(1, 5, 4))  # rank 3 but no conv kernel

    def forward(self, x1, x2, x3):
        a = self.c1(x1).mean((2,))
        b = self.bn(self.c2(x2)).mean((2, 3))
        c = self.c3(x3).mean((2, 3, 4))
        return self.fc(a + b + c + self.tokens.mean((0, 1)))


def _inputs():
    return torch.randn(2, 3, 9), torch.randn(2, 3, 9, 9), torch.randn(2, 3, 5, 5, 5)


@pytest.mark.parametrize("fmt", [Format.CHANNELS_LAST, Format.CHANNELS_LAST_3D, Format.CHANNELS_LAST_1D])
def test_convert_module_converts_matching_ranks_only(fmt):
    model = Mixed().eval()
    inputs = _inputs()
    with torch.no_grad():
        expected = model(*inputs)
    before = {n: (p, p.stride()) for n, p in model.named_parameters()}
    model.c2.weight.grad = torch.randn_like(model.c2.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert convert_module(model, fmt) is model
    for name, p in model.named_parameters():
        old, old_stride = before[name]
        assert p is old, f"{name} lost its identity"
        assert p.requires_grad
        converts = (p.dim() == fmt.rank) and (fmt is not Format.CHANNELS_LAST_1D or name == "c1.weight")
        if converts:
            assert p.stride() == strides_for(p.shape, fmt), name
        else:
            assert p.stride() == old_stride, name
    if fmt is Format.CHANNELS_LAST:
        assert model.c2.weight.grad.stride() == strides_for(model.c2.weight.shape, fmt)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters(), strict=True))
    with torch.no_grad():
        torch.testing.assert_close(model(*convert_batch(inputs, fmt)), expected)


def test_convert_module_back_to_contiguous():
    model = convert_module(nn.Conv2d(3, 4, 3), Format.CHANNELS_LAST)
    convert_module(model, Format.CONTIGUOUS)
    assert model.weight.is_contiguous()


Pair = collections.namedtuple("Pair", "image label")


@dataclasses.dataclass(frozen=True)
class Sample:
    video: torch.Tensor
    name: str


def test_convert_batch_walks_nested_structures():
    x2, x3, x4, x5 = torch.randn(2, 3), torch.randn(2, 3, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 2, 4, 4)
    batch = {
        "pair": Pair(x4, 7),
        "list": [x2, x3, (x4, "text")],
        "sample": Sample(x5, "clip"),
        "ordered": collections.OrderedDict(a=x4, b=None),
    }
    out = convert_batch(batch, Format.CHANNELS_LAST)
    assert isinstance(out["pair"], Pair) and out["pair"].label == 7
    assert out["pair"].image.stride() == strides_for(x4.shape, Format.CHANNELS_LAST)
    assert out["list"][0] is x2 and out["list"][1] is x3 and out["list"][2][1] == "text"
    assert out["list"][2][0].is_contiguous(memory_format=torch.channels_last)
    assert out["sample"].video is x5 and out["sample"].name == "clip"
    assert isinstance(out["ordered"], collections.OrderedDict) and out["ordered"]["b"] is None
    assert batch["pair"].image is x4  # the input structure is not mutated
    out3 = convert_batch(batch, Format.CHANNELS_LAST_3D)
    assert out3["sample"].video.is_contiguous(memory_format=torch.channels_last_3d)
    assert out3["pair"].image is x4
    assert convert_batch(5, Format.CHANNELS_LAST) == 5


@dataclasses.dataclass
class ModelOutput(collections.OrderedDict):
    """diffusers' ``BaseOutput`` in small: a dataclass and an OrderedDict of its fields that
    refuses ``update``."""

    sample: torch.Tensor
    extra: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                super().__setitem__(f.name, getattr(self, f.name))

    def update(self, *args, **kwargs):
        raise Exception(f"You cannot use ``update`` on a {type(self).__name__} instance.")


def test_convert_batch_remakes_a_model_output_that_is_a_dataclass_and_a_dict():
    x = torch.randn(2, 3, 4, 4)
    outputs = [ModelOutput(x)]
    try:  # and the real one, where diffusers is installed
        from diffusers.models.unets.unet_2d import UNet2DOutput
    except ImportError:
        UNet2DOutput = None
    if UNet2DOutput is not None:
        outputs.append(UNet2DOutput(sample=x))
    for out in outputs:
        got = convert_batch(out, Format.CHANNELS_LAST)
        assert type(got) is type(out) and got is not out
        assert got.sample.is_contiguous(memory_format=torch.channels_last)
        assert got["sample"] is got.sample and list(got) == ["sample"]  # the dict follows
        assert out.sample is x  # the original is not touched
