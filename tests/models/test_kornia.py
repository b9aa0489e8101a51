"""kornia's filters and augmentations in front of a network, and its KeyNet detector, with
random weights: their kernels are made in ``forward`` (a Gaussian from its sigma, drawn at
random in ``RandomGaussianBlur``; the Sobel kernel of ``SpatialGradient``) and convolved with
``F.conv2d``. Planned whole, verified, a drop-in (a random augmentation draws the same
parameters in both models from one seed). Needs kornia (``models`` extra)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.support.real import Inputs, assert_a_planned_drop_in, calibrated, installed


def kornia():  # noqa: ANN201 - the module, or the test skipped
    return installed("kornia", "the models extra: pip install kornia")


def network(in_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2)]


def gaussian_blur() -> nn.Module:
    k = kornia()
    return nn.Sequential(k.filters.GaussianBlur2d((5, 5), (1.5, 1.5)), *network(3))


def random_gaussian_blur() -> nn.Module:
    k = kornia()
    return nn.Sequential(k.augmentation.RandomGaussianBlur((5, 5), (0.1, 2.0), p=1.0),
                         *network(3))


def spatial_gradient() -> nn.Module:
    k = kornia()
    return nn.Sequential(*network(3)[:2], k.filters.SpatialGradient(), nn.Flatten(1, 2),
                         nn.Conv2d(16, 4, 1))


def keynet() -> nn.Module:
    """Random weights (no download), its batch norms calibrated: uncalibrated, the final ReLU
    zeroes its whole response map, and any two random KeyNets compute the same."""
    return calibrated(kornia().feature.KeyNet(pretrained=False), images(1)(2))


def images(channels: int) -> Inputs:
    return lambda batch: (torch.rand(batch, channels, 32, 32),)


MODELS: dict[str, tuple[Callable[[], nn.Module], Inputs]] = {
    "gaussian_blur": (gaussian_blur, images(3)),
    "random_gaussian_blur": (random_gaussian_blur, images(3)),
    "spatial_gradient": (spatial_gradient, images(3)),
    "keynet": (keynet, images(1)),
}


#: torch.export before 2.11 stops at a data-dependent guard in the random augmentation's
#: parameter sampling (``Eq(u0, 1)``), so the model is planned at its submodules, not whole
OLD_EXPORT = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.11",
    reason="needs torch >= 2.11: older torch.export cannot capture kornia's random "
           "augmentation whole (a data-dependent guard)")


@pytest.mark.parametrize("name", [pytest.param(n, marks=OLD_EXPORT) if n.startswith("random")
                                  else n for n in MODELS])
def test_a_kornia_model_is_planned_whole_verified_and_a_drop_in(name: str) -> None:
    build, inputs = MODELS[name]
    assert_a_planned_drop_in(build, inputs)
