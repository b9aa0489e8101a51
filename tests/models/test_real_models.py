"""Real third-party models (diffusers, segmentation_models_pytorch, timm hybrids, MONAI), tiny
configurations with random weights, planned whole: coverage against the convolution calls
counted where Python makes them, outputs against the original model's, the drop-in attributes.

Needs the ``models`` extra (``pip install -e '.[models]'``); each library is skipped where
missing. Nothing is downloaded: every configuration is built in code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import memlayout
from memlayout.tensors import iter_tensors
from tests.support.counting import conv_calls

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def unet2d() -> Example:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8)
    return model, (torch.randn(1, 3, 16, 16), torch.tensor([10])), {}


def autoencoder_kl() -> Example:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16)
    return model, (torch.randn(1, 3, 16, 16),), {}


#: a UNet2DConditionModel with cross-attention, at test size
SMALL_CONDITIONED = dict(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
    norm_num_groups=8, attention_head_dim=8)


def unet2d_condition() -> Example:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DConditionModel(**SMALL_CONDITIONED)
    return model, (torch.randn(1, 4, 8, 8), torch.tensor([10])), \
        {"encoder_hidden_states": torch.randn(1, 3, 16)}


def unet2d_text_time() -> Example:
    """SDXL's conditioning: ``added_cond_kwargs``, a keyword input that is a dict of tensors."""
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DConditionModel(
        **SMALL_CONDITIONED, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=16 + 6 * 8)
    added = {"text_embeds": torch.randn(1, 16), "time_ids": torch.randn(1, 6)}
    return model, (torch.randn(1, 4, 8, 8), torch.tensor([10])), \
        {"encoder_hidden_states": torch.randn(1, 3, 16), "added_cond_kwargs": added}


def unet1d() -> Example:
    """Rank-3 (1-d convolutions), and resampling by ``F.conv1d`` with a fixed kernel in
    forward: convolution calls that are no module's."""
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet1DModel(
        sample_size=32, in_channels=2, out_channels=2, extra_in_channels=64,
        block_out_channels=(32, 32, 32), norm_num_groups=8, time_embedding_type="fourier",
        use_timestep_embedding=False, flip_sin_to_cos=True)
    return model, (torch.randn(1, 2, 32), torch.tensor([10])), {}


def smp_unet() -> Example:
    smp = pytest.importorskip("segmentation_models_pytorch")
    model = smp.Unet("resnet18", encoder_weights=None, classes=2, encoder_depth=3,
                     decoder_channels=(32, 16, 8))
    return model, (torch.randn(1, 3, 32, 32),), {}


def smp_deeplabv3plus() -> Example:
    smp = pytest.importorskip("segmentation_models_pytorch")
    model = smp.DeepLabV3Plus("resnet18", encoder_weights=None, classes=2)
    return model, (torch.randn(2, 3, 32, 32),), {}


def timm_mobilevitv2() -> Example:
    timm = pytest.importorskip("timm")
    return timm.create_model("mobilevitv2_050", pretrained=False, num_classes=4), \
        (torch.randn(1, 3, 64, 64),), {}


def timm_coatnet() -> Example:
    timm = pytest.importorskip("timm")
    return timm.create_model("coatnet_nano_rw_224", pretrained=False, num_classes=4,
                             img_size=64), (torch.randn(1, 3, 64, 64),), {}


def monai_unet3d() -> Example:
    nets = pytest.importorskip("monai.networks.nets")
    model = nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32),
                      strides=(2, 2), num_res_units=1)
    return model, (torch.randn(1, 1, 16, 16, 16),), {}


def monai_basic_unet3d() -> Example:
    """``UpCat`` joins its skip input only when ``torch.jit.isinstance(x_e, torch.Tensor)``:
    torch.fx's graph takes the other branch and fails on the example; export takes it."""
    nets = pytest.importorskip("monai.networks.nets")
    model = nets.BasicUNet(spatial_dims=3, in_channels=1, out_channels=2,
                           features=(4, 4, 8, 16, 32, 4))
    return model, (torch.randn(1, 1, 32, 32, 32),), {}


MODELS: dict[str, Callable[[], Example]] = {f.__name__: f for f in (
    unet2d, autoencoder_kl, unet2d_condition, unet2d_text_time, unet1d, smp_unet,
    smp_deeplabv3plus, timm_mobilevitv2, timm_coatnet, monai_unet3d, monai_basic_unet3d)}


def assert_same_outputs(got: Any, want: Any) -> None:
    got, want = list(iter_tensors(got)), list(iter_tensors(want))
    assert len(got) == len(want) and got
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


def smp_attributes(model: nn.Module, opt: nn.Module, args: tuple[Any, ...]) -> None:
    """What smp's forward and its callers read: the encoder's attributes."""
    assert opt.encoder.output_stride == model.encoder.output_stride
    assert opt.encoder.out_channels == model.encoder.out_channels
    assert isinstance(opt.encoder, type(model.encoder))
    assert type(opt) is type(model)  # the planned model is the model's own class


def diffusers_attributes(model: nn.Module, opt: nn.Module, args: tuple[Any, ...]) -> None:
    """A diffusers model's config, dtype and device; its state dict loads both ways."""
    assert opt.config == model.config and opt.dtype == model.dtype
    assert opt.device == model.device
    fresh = type(model).from_config(model.config).eval()
    opt.load_state_dict(fresh.state_dict())
    model.load_state_dict(opt.state_dict())
    with torch.no_grad():
        assert_same_outputs(opt(*args), fresh(*args))
        assert_same_outputs(model(*args), fresh(*args))


DROP_IN = {"smp_deeplabv3plus": smp_attributes, "unet2d": diffusers_attributes}


@pytest.mark.parametrize("name", list(MODELS))
def test_a_real_model_is_planned_whole_verified_and_a_drop_in(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.eval()
    opt = memlayout.optimize(model, args, kwargs=kwargs, measure=False, cache=False,
                             memory=False)
    coverage = opt.plan.coverage
    assert coverage.total == conv_calls(model, *args, **kwargs) > 0
    assert coverage.planned >= 0.95 * coverage.total, coverage.text()
    assert opt.plan.verification.ok
    with torch.no_grad():
        assert_same_outputs(opt(*args, **kwargs), model(*args, **kwargs))
    assert list(opt.state_dict()) == list(model.state_dict())
    if name in DROP_IN:
        DROP_IN[name](model, opt, args)


@pytest.mark.parametrize("name", ["unet2d", "autoencoder_kl", "unet2d_condition"])
def test_an_exported_model_is_planned_under_bf16_autocast(name: str) -> None:
    """Export traces in fp32 and checks dtypes where forward converts a tensor; a bf16 plan
    runs that graph under autocast (a diffusers UNet casts its time embedding to the sample's
    dtype, bf16 there): planned whole and verified all the same."""
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    model.eval()
    opt = memlayout.optimize(model, args, kwargs=kwargs, dtype="bf16", measure=False,
                             cache=False, memory=False)
    assert opt.plan.verification.ok
    assert opt.plan.coverage.planned == opt.plan.coverage.total > 0
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(*args, **kwargs)
    with torch.no_grad():
        got = opt(*args, **kwargs)
    for g, w in zip(iter_tensors(got), iter_tensors(want), strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["unet2d", "unet2d_text_time", "monai_unet3d"])
def test_a_training_step_is_planned_and_verified(name: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name]()
    opt = memlayout.optimize(model.train(), args, kwargs=kwargs, measure=False, cache=False,
                             memory=False, train=True)
    plan = opt.plan
    assert plan.verification.ok and plan.verification.train
    if plan.guard is not None and plan.guard.kept != "planned":
        # a plan that failed verification (a 3-d norm's CPU backward is wrong for a
        # channels-last gradient in some torch builds) gave way, and said so
        assert any("failed verification" in n for n in plan.notes)
    else:
        assert plan.coverage.planned >= 0.95 * plan.coverage.total
    out = opt(*args, **kwargs)
    sum(t.square().mean() for t in iter_tensors(out)).backward()
    assert all(p.grad is not None for p in opt.parameters() if p.requires_grad)


def test_a_diffusers_model_through_the_measured_guard_with_its_input_format_chosen() -> None:
    """The path the benchmark takes: measured costs, the guard's whole-model candidates
    (outputs converted back to the original's format: a diffusers output is a dataclass and
    a dict that refuses ``update``), the input format chosen by the plan."""
    torch.manual_seed(0)
    model, args, _ = unet2d()
    model.eval()
    opt = memlayout.optimize(model, args, input_format="auto", cache=False, rounds=1,
                             guard_rounds=1, memory=False, padding=False)
    assert opt.plan.guard is not None and opt.plan.guard.source == "measured"
    with torch.no_grad():
        want, got = model(*args), opt(*memlayout.prepare_inputs(opt, *args))
    assert type(got) is type(want)
    assert_same_outputs(got, want)
