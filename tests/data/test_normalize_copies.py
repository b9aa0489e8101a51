"""``to_model_input`` copies its constants to the device once, not once per batch (the meta
device stands in for a GPU: a copy to it is a host-to-device copy the dispatcher sees)."""

from __future__ import annotations

from typing import Any

import torch

from memlayout.data import to_model_input
from memlayout.data.normalize import affine_constants
from memlayout.dispatch import ObservingMode


class HostToDevice(ObservingMode):
    """The floating tensors copied from the CPU to another device (a batch is uint8)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[str] = []

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = func.overloadpacket.__name__
        if name not in ("_to_copy", "copy_", "_copy_from", "lift_fresh_copy"):
            return
        source = args[1] if name == "copy_" else args[0]
        target = args[0] if name == "copy_" else out
        if (isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor)
                and source.device.type == "cpu" and target.device.type != "cpu"
                and source.dtype.is_floating_point):
            self.copies.append(f"{name} {source.dtype} {tuple(source.shape)}")


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)


def test_a_batch_after_the_first_copies_no_constant_to_the_device():
    mean, std = (0.41, 0.42, 0.43), (0.21, 0.22, 0.23)
    to_model_input(_batch(), mean, std, device="meta")  # the constants reach the device
    with HostToDevice() as watch:
        for dtype in (torch.float32, torch.bfloat16, torch.float32):
            y = to_model_input(_batch(), mean, std, dtype, device="meta")
            assert y.device.type == "meta" and y.dtype == dtype
    assert watch.copies == []


def test_the_watch_sees_a_constant_copied_per_batch():
    # what each batch did before its constants were kept on the device: the watch sees it
    with HostToDevice() as watch:
        torch.tensor([1.0, 2.0, 3.0]).view(-1, 1, 1).to("meta")
    assert len(watch.copies) == 1


def test_the_kept_constants_are_the_computed_ones_per_dtype_and_device():
    a32 = affine_constants((2.0, 4.0), (-1.0, 0.5), torch.float32, torch.device("cpu"))
    a64 = affine_constants((2.0, 4.0), (-1.0, 0.5), torch.float64, torch.device("cpu"))
    meta = affine_constants((2.0, 4.0), (-1.0, 0.5), torch.float32, torch.device("meta"))
    assert a32[0].dtype == torch.float32 and a64[0].dtype == torch.float64
    assert meta[0].device.type == "meta" and meta[0] is not a32[0]
    torch.testing.assert_close(a32[0].flatten(), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(a64[1].flatten(), torch.tensor([-1.0, 0.5], dtype=torch.float64))
    assert affine_constants((2.0, 4.0), (-1.0, 0.5), torch.float32, torch.device("cpu"))[1] is a32[1]
