"""memlayout.data against the standard torchvision pipeline, on real image files written here."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, default_collate
from torchvision import transforms as T
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F
from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ChannelsLastCollate,
    CopyCounter,
    DataPipelineError,
    MixedImageSizeError,
    channels_last_loader,
    collate_channels_last,
    collate_images,
    to_model_input,
)
from memlayout.data.bench import synthetic_jpeg_folder
from memlayout.data.normalize import _affine_into
from memlayout.errors import MemlayoutError
from memlayout.layout import Format
from memlayout.tensors import format_of, in_format

H, W = 12, 16
# torchvision 0.29 deprecates its decoders in favour of TorchCodec; they still return what the
# data pipeline has to handle (CHW views over HWC memory).
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def torch_cl_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return torch.empty(shape, memory_format=torch.channels_last).stride()


def _photo(rng: np.random.Generator, h: int, w: int, c: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    base = (xx * 255 // max(w - 1, 1) + yy * 7)[:, :, None] + rng.integers(0, 60, size=(h, w, c))
    return np.clip(base, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Real files: RGB and grayscale JPEGs, RGBA PNGs, and RGB JPEGs of another size."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    out: dict[str, list[Path]] = {"rgb": [], "gray": [], "rgba": [], "small": []}
    for i in range(5):
        for kind, (h, w, c, ext, mode) in {
            "rgb": (H, W, 3, "jpg", "RGB"), "gray": (H, W, 1, "jpg", "L"),
            "rgba": (H, W, 4, "png", "RGBA"), "small": (H - 2, W - 2, 3, "jpg", "RGB"),
        }.items():
            arr = _photo(rng, h, w, c)
            img = Image.fromarray(arr[:, :, 0] if c == 1 else arr, mode)
            path = root / f"{kind}_{i}.{ext}"
            img.save(path)
            out[kind].append(path)
    return out


def decode(path: Path) -> torch.Tensor:
    """torchvision.io's decode: a (C, H, W) uint8 tensor over HWC memory."""
    try:
        from torchvision.io import decode_image, read_file
    except ImportError:  # torchvision releases after the TorchCodec move may drop them
        pytest.skip("torchvision.io has no image decoders")
    return decode_image(read_file(str(path)))


def pil(path: Path) -> Image.Image:
    with Image.open(path) as img:
        img.load()
        return img.copy()


def standard_uint8(chw: list[torch.Tensor]) -> torch.Tensor:
    return default_collate(chw).contiguous(memory_format=torch.channels_last)


# (name, sample from path, the standard CHW tensor of that sample)
SOURCES = {
    "pil": (pil, lambda p: T.PILToTensor()(pil(p))),
    "numpy_hwc": (lambda p: np.asarray(pil(p)).reshape(H, W, -1), lambda p: T.PILToTensor()(pil(p))),
    "decode_image": (decode, lambda p: decode(p).contiguous()),
    "contiguous_chw": (lambda p: T.PILToTensor()(pil(p)).contiguous(), lambda p: T.PILToTensor()(pil(p))),
    "tv_image": (lambda p: tv_tensors.Image(decode(p)), decode),
}


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("kind", ["rgb", "gray", "rgba"])
def test_uint8_batch_equals_standard_with_canonical_strides(files, source, kind):
    load, reference = SOURCES[source]
    paths = files[kind]
    x, y = collate_channels_last([(load(p), i) for i, p in enumerate(paths)])
    expected = standard_uint8([reference(p) for p in paths])
    assert x.dtype == torch.uint8
    assert torch.equal(x, expected)
    assert x.stride() == torch_cl_strides(tuple(x.shape))
    assert torch.equal(y, default_collate(list(range(len(paths)))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["rgb", "gray"])
def test_normalized_equals_to_tensor_normalize(files, dtype, kind):
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if kind == "rgb" else ((0.45,), (0.27,))
    imgs = [pil(p) for p in files[kind]]
    tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
    expected = default_collate([tf(img) for img in imgs]).to(memory_format=torch.channels_last)
    got = to_model_input(collate_channels_last(imgs), mean, std, dtype)
    assert got.dtype == dtype
    assert got.stride() == torch_cl_strides(tuple(got.shape))
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected)
    else:  # computed in float32 and rounded once: within one unit in the last place
        torch.testing.assert_close(got.float(), expected.to(dtype).float(),
                                   rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_grayscale_batch_is_ambiguous_but_canonical(files):
    x = collate_channels_last([pil(p) for p in files["gray"]])
    assert x.shape[1] == 1
    assert in_format(format_of(x), Format.CHANNELS_LAST) and in_format(format_of(x), Format.CONTIGUOUS)
    assert x.stride() == torch_cl_strides(tuple(x.shape))
    # an NCHW-contiguous grayscale batch (C == 1: channels-last by the rules, other strides)
    nchw = torch.empty(x.shape, dtype=x.dtype).copy_(x)
    assert nchw.stride() == (H * W, H * W, W, 1) != x.stride()
    out = to_model_input(nchw, 0.5, 0.5)
    assert out.stride() == torch_cl_strides(tuple(out.shape))
    torch.testing.assert_close(out, (nchw.float() / 255 - 0.5) / 0.5)


def test_mixed_sizes_raise_naming_samples_and_sizes(files):
    paths = [files["rgb"][0], files["small"][0], files["rgb"][1]]
    with pytest.raises(MixedImageSizeError) as info:
        collate_channels_last([(pil(p), 0) for p in paths])
    err = info.value
    assert isinstance(err, MemlayoutError)
    msg = str(err)
    assert f"(3, {H}, {W}) for samples 0, 2" in msg
    assert f"(3, {H - 2}, {W - 2}) for sample 1" in msg
    assert "fit='resize'" in msg
    assert err.sizes == {(3, H, W): [0, 2], (3, H - 2, W - 2): [1]}
    with pytest.raises(MixedImageSizeError, match="img.convert"):
        collate_images([pil(files["rgb"][0]), pil(files["gray"][0])], fit="resize")


@pytest.mark.parametrize("fit", ["resize", "center_crop"])
def test_fit_resizes_or_crops_like_torchvision(files, fit):
    size = (H - 4, W - 4)
    imgs = [pil(files["rgb"][0]), pil(files["small"][0]), decode(files["small"][1])]
    x = collate_images(imgs, fit=fit, size=size)
    op = v2.Resize(size, antialias=True) if fit == "resize" else v2.CenterCrop(size)
    expected = standard_uint8([F.pil_to_tensor(op(i)) if isinstance(i, Image.Image) else op(i) for i in imgs])
    assert torch.equal(x, expected)
    assert x.stride() == torch_cl_strides(tuple(x.shape))


def test_other_fields_collate_like_default_collate(files):
    samples = [{"image": pil(p), "label": i, "name": p.name, "box": torch.tensor([i, 2.0]),
                "meta": (float(i), np.float32(1.5))} for i, p in enumerate(files["rgb"][:3])]
    got = collate_channels_last(samples)
    ref = default_collate([{k: v for k, v in s.items() if k != "image"} for s in samples])
    assert set(got) == set(samples[0])
    for key in ("label", "box"):
        assert torch.equal(got[key], ref[key])
    assert got["name"] == ref["name"]
    assert all(torch.equal(a, b) for a, b in zip(got["meta"], ref["meta"], strict=True))
    assert got["image"].stride() == torch_cl_strides(tuple(got["image"].shape))
    with pytest.raises(DataPipelineError, match="sample 1 is a str"):
        collate_channels_last([pil(files["rgb"][0]), "not an image"])


class Files(torch.utils.data.Dataset):
    def __init__(self, paths, transform=None):
        self.paths, self.transform = paths, transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = pil(self.paths[i]).convert("RGB")
        return (self.transform(img) if self.transform else img), i


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_matches_standard_loader(files, workers):
    paths = files["rgb"]
    ours = list(channels_last_loader(Files(paths), batch_size=2, num_workers=workers))
    std = list(DataLoader(Files(paths, T.PILToTensor()), batch_size=2))
    assert len(ours) == len(std) == 3
    for (x, y), (xs, ys) in zip(ours, std, strict=True):
        assert torch.equal(x, xs)
        assert torch.equal(y, ys)
        assert x.stride() == torch_cl_strides(tuple(x.shape))
    if workers:
        assert all(x.is_shared() for x, _ in ours)  # built in shared memory by the worker


def test_loader_rejects_a_second_collate_fn(files):
    with pytest.raises(DataPipelineError, match="collate_fn"):
        channels_last_loader(Files(files["rgb"]), collate_fn=default_collate)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_keep_channels_last(files, workers):
    for x, _ in channels_last_loader(Files(files["rgb"]), batch_size=2, num_workers=workers, pin_memory=True):
        assert x.is_pinned()
        assert x.stride() == torch_cl_strides(tuple(x.shape))


def test_collate_writes_each_image_once_without_permute(files):
    paths = files["rgb"]
    n, nbytes = len(paths), len(paths) * 3 * H * W
    for load in (pil, decode):
        samples = [load(p) for p in paths]
        with CopyCounter() as c:
            collate_images(samples)
        assert dict(c.calls) == {"numpy.copyto": n}
        assert c.copy_bytes == nbytes
        assert c.layout_copies == 0 and c.arithmetic_bytes == 0
    # the same counter sees the standard path's permutes (so the check above can fail)
    imgs = [pil(p) for p in paths]
    with CopyCounter() as c:
        default_collate([T.PILToTensor()(i) for i in imgs]).contiguous(memory_format=torch.channels_last)
    assert c.layout_copies >= 1 and c.layout_copy_bytes >= nbytes


def test_v2_pipeline_output_is_written_once_and_equal(files):
    tf = v2.Compose([v2.RandomResizedCrop((8, 8), antialias=True), v2.RandomHorizontalFlip(0.5),
                     v2.ColorJitter(brightness=0.3)])
    torch.manual_seed(1)
    samples = [tf(decode(p)) for p in files["rgb"]]
    with CopyCounter() as c:
        x = collate_images(samples)
    assert torch.equal(x, standard_uint8(samples))
    assert x.stride() == torch_cl_strides(tuple(x.shape))
    assert dict(c.calls) == {"numpy.copyto": len(samples)}  # no per-sample contiguous() or clone
    # transforms that keep HWC memory (resize of a whole image, flips, center crops): plain copies
    keep = v2.Compose([v2.Resize((10, 12), antialias=True), v2.RandomHorizontalFlip(1.0), v2.CenterCrop(8)])
    samples = [keep(decode(p)) for p in files["rgb"]]
    with CopyCounter() as c:
        x = collate_images(samples)
    assert torch.equal(x, standard_uint8(samples))
    assert c.layout_copies == 0


def test_to_model_input_errors():
    x = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    with pytest.raises(DataPipelineError, match="uint8"):
        to_model_input(x.float(), IMAGENET_MEAN, IMAGENET_STD)
    with pytest.raises(DataPipelineError, match="mean has 2 values for a batch of 3 channels"):
        to_model_input(x, (0.5, 0.5), IMAGENET_STD)
    with pytest.raises(DataPipelineError, match="not a floating dtype"):
        to_model_input(x, IMAGENET_MEAN, IMAGENET_STD, torch.int32)
    with pytest.raises(DataPipelineError, match="zero"):
        to_model_input(x, IMAGENET_MEAN, (1.0, 0.0, 1.0))


def test_non_8bit_pil_mode_is_refused():
    with pytest.raises(DataPipelineError, match="I;16"):
        collate_images([Image.new("I;16", (4, 4))])


def test_copy_counter_classifies_against_known_ops():
    x = torch.randn(2, 3, 4, 5)
    nbytes = x.numel() * 4
    with CopyCounter() as c:
        x.permute(0, 2, 3, 1)  # a view: writes nothing
        x.clone()  # copy, same layout
        x.contiguous(memory_format=torch.channels_last)  # layout copy
        torch.empty_like(x).copy_(x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))  # 2 layout copies
        x.mul(2)  # arithmetic
        x.to(torch.float16)  # dtype copy, same layout
    assert c.layout_copies == 3 and c.layout_copy_bytes == 3 * nbytes
    assert c.copy_bytes == 4 * nbytes + nbytes // 2
    assert c.arithmetic_bytes == nbytes


def test_synthetic_folder_is_made_once(tmp_path):
    paths = synthetic_jpeg_folder(3, 16, tmp_path)
    stamps = [p.stat().st_mtime_ns for p in paths]
    again = synthetic_jpeg_folder(4, 16, tmp_path)
    assert again[:3] == paths and [p.stat().st_mtime_ns for p in paths] == stamps
    assert Image.open(again[3]).size == (16, 16)
    assert np.asarray(pil(paths[0])).std() > 5  # not a flat image


def test_bench_data_command(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench-data", "--images", "4", "--size", "16", "--batch", "2",
                                   "--rounds", "1", "--cache-dir", str(tmp_path), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "median per-round ratio" in res.output
    record = json.loads(out.read_text())
    assert record["max_abs_diff"] < 1e-5
    ml, tv = record["pipelines"]["memlayout"], record["pipelines"]["torchvision"]
    assert ml["strides"] == tv["strides"] == list(torch_cl_strides((2, 3, 16, 16)))
    assert ml["layout_copy_bytes"] == 0 < tv["layout_copy_bytes"]
    values = 2 * 3 * 16 * 16
    # into the batch: one uint8 write per image; to_model_input on CPU: a cast copy + a multiply-add
    assert ml["copy_bytes"] == values + 4 * values
    assert ml["arithmetic_bytes"] == 4 * values


def test_collate_object_in_a_users_dataloader_fits_mixed_sizes(files):
    collate = pickle.loads(pickle.dumps(ChannelsLastCollate(fit="resize", size=(H, W))))  # spawn workers pickle it
    paths = [files["rgb"][0], files["small"][0], files["rgb"][1]]
    (x, y), = list(DataLoader(Files(paths), batch_size=3, collate_fn=collate))
    resize = v2.Resize((H, W), antialias=True)
    assert torch.equal(x, standard_uint8([F.pil_to_tensor(resize(pil(p).convert("RGB"))) for p in paths]))
    assert torch.equal(y, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(("cast_first", "dtype"), [(True, torch.float32), (False, torch.float32),
                                                    (False, torch.bfloat16)])
def test_both_normalize_paths_agree_with_the_formula(cast_first, dtype):
    # cast_first: the CPU float32 path; one addcmul: the accelerator path (run on CPU here)
    x = torch.randint(0, 256, (3, 5, 6, 3), dtype=torch.uint8).permute(0, 3, 1, 2)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    out = torch.empty(x.shape, dtype=dtype, memory_format=torch.channels_last)
    _affine_into(out, x, 1 / (255 * std), -mean / std, cast_first=cast_first)
    expected = ((x.float() / 255 - mean) / std).to(dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=1e-6)
    assert out.stride() == torch_cl_strides(tuple(out.shape))


def test_to_model_input_on_the_meta_device_keeps_channels_last():
    # the accelerator branch's shapes, dtypes and strides, without an accelerator
    x = torch.zeros(2, 3, 4, 5, dtype=torch.uint8)
    out = to_model_input(x, IMAGENET_MEAN, IMAGENET_STD, torch.float16, device="meta")
    assert out.device.type == "meta" and out.dtype == torch.float16
    assert out.stride() == torch_cl_strides((2, 3, 4, 5))


def test_device_tensors_are_collated_on_their_device():
    # non-CPU images go through torch's copy_ on their device (meta stands in for an accelerator)
    imgs = [torch.empty(3, 4, 5, dtype=torch.uint8, device="meta").permute(0, 1, 2)] * 2
    x = collate_images(imgs)
    assert x.device.type == "meta" and x.stride() == torch_cl_strides((2, 3, 4, 5))
    with pytest.raises(DataPipelineError, match="several devices"):
        collate_images([imgs[0], torch.zeros(3, 4, 5, dtype=torch.uint8)])
