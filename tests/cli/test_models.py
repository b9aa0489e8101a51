"""Model specs and the CLI skeleton."""

from __future__ import annotations

import textwrap

import pytest
import torch
from typer.testing import CliRunner

from memlayout import Format, ModelSpecError
from memlayout.cli import app
from memlayout.inspection import inspect_model
from memlayout.models import load_model
from memlayout.tensors import format_name, format_of


def test_torchvision_classification_spec():
    spec = load_model("torchvision:resnet18", batch=2, image_size=32)
    assert spec.kind == "classification" and spec.fmt is Format.CHANNELS_LAST
    assert spec.module(spec.example_input).shape == (2, 1000)


def test_inception_v3_runs_at_its_own_299_pixels_and_trains_there():
    spec = load_model("torchvision:inception_v3", batch=2)
    assert tuple(spec.example_input.shape) == (2, 3, 299, 299)
    out = spec.module.train()(spec.example_input)  # the auxiliary head runs in training
    assert out.logits.shape == out.aux_logits.shape == (2, 1000)
    assert load_model("torchvision:inception_v3", batch=1, image_size=224).example_input.shape[-1] == 224


def test_video_spec_is_rank_5():
    spec = load_model("torchvision:r3d_18", batch=1, image_size=32)
    assert spec.example_input.dim() == 5 and spec.fmt is Format.CHANNELS_LAST_3D


def test_segmentation_and_detection_build_without_downloads():
    seg = load_model("torchvision:fcn_resnet50", batch=1, image_size=32)
    assert seg.kind == "segmentation"
    det = load_model("torchvision:fasterrcnn_mobilenet_v3_large_fpn", batch=1, image_size=64)
    with torch.no_grad():
        feats = det.module(det.example_input)
    assert det.kind == "detection" and all(v.dim() == 4 for v in feats.values())


def test_bad_spec_lists_close_matches():
    with pytest.raises(ModelSpecError, match="torchvision:resnet18"):
        load_model("torchvision:resnet81")
    with pytest.raises(ModelSpecError, match="SOURCE:NAME"):
        load_model("resnet18")
    with pytest.raises(ModelSpecError, match="does not exist"):
        load_model("nope.py:make")


def test_file_spec(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        def make():
            return nn.Sequential(nn.Conv2d(1, 2, 3)), torch.randn(3, 1, 8, 8)
        def bad():
            return 5
    """))
    spec = load_model(f"{path}:make")
    assert tuple(spec.example_input.shape) == (3, 1, 8, 8) and spec.kind == "custom"
    with pytest.raises(ModelSpecError, match="returned int"):
        load_model(f"{path}:bad")
    with pytest.raises(ModelSpecError, match="make"):
        load_model(f"{path}:mkae")


def test_inspect_reports_what_hooks_see():
    spec = load_model("torchvision:resnet18", batch=2, image_size=32)
    report = inspect_model(spec.module, spec.example_input, Format.CHANNELS_LAST)
    by_path = {o.path: o for o in report.outputs}
    # Second method: run the converted model by hand and check the module outputs directly.
    assert by_path["layer1.0.conv1"].formats == ("channels_last",)
    pooled = spec.module.avgpool(torch.randn(2, 512, 1, 1).to(memory_format=torch.channels_last))
    assert by_path["avgpool"].formats == (format_name(format_of(pooled)),)
    assert by_path["fc"].formats == ("contiguous",)
    rank4 = next(g for g in report.params if g.rank == 4)
    one_by_one = sum(1 for p in spec.module.parameters() if p.dim() == 4 and p.shape[2:] == (1, 1))
    assert one_by_one > 0
    assert dict(rank4.formats) == {"channels_last": rank4.tensors - one_by_one,
                                   "ambiguous(channels_last|contiguous)": one_by_one}
    assert spec.example_input.is_contiguous()  # caller's tensor untouched


def test_cli_inspect_runs_and_prints_formats():
    result = CliRunner().invoke(app, ["inspect", "torchvision:resnet18", "--batch", "1", "--image-size", "32"])
    assert result.exit_code == 0, result.output
    assert "channels_last" in result.output and "layer4.1.conv2" in result.output


def test_cli_bad_spec_is_a_clean_error():
    result = CliRunner().invoke(app, ["inspect", "torchvision:resnet81"])
    assert result.exit_code == 2 and "did you mean" in result.output


def test_cli_help():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "inspect" in result.output


FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x, *, shift):
            return self.conv(x) + shift

    def keyed():
        return Shifted(), (torch.randn(2, 3, 8, 8),), {"shift": torch.randn(1, 4, 1, 1)}

    def broken():
        raise RuntimeError("weights file missing")

    def volume():
        return nn.Sequential(nn.Conv3d(1, 4, 3))

    def image():
        return nn.Sequential(nn.Conv2d(3, 4, 3))
""")


def test_a_factory_may_return_keyword_inputs_and_the_cli_plans_them(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(FACTORIES)
    spec = load_model(f"{path}:keyed", batch=4, image_size=16)
    assert set(spec.example_kwargs) == {"shift"} and "do not apply" in spec.note
    result = CliRunner().invoke(app, ["optimize", f"{path}:keyed", "--no-measure", "--no-cache",
                                      "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "planned 1 of 1 convolution calls" in result.output
    assert "--batch and --image-size do not apply" in result.output


def test_audit_and_inspect_run_a_factory_with_keyword_inputs(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(FACTORIES)
    spec = load_model(f"{path}:keyed")
    for verb in ("audit", "inspect"):
        result = CliRunner().invoke(app, [verb, f"{path}:keyed"])
        assert result.exit_code == 0, (verb, result.output)
        assert "do not apply" in result.output, verb
    # the keyword input reaches the model: inspect sees the output it makes, the audit the
    # same drops as the call made by hand with the keyword bound
    report = inspect_model(spec.module, spec.example_input, kwargs=spec.example_kwargs)
    assert [o.shapes for o in report.outputs if o.path == ""] == [((2, 4, 8, 8),)]
    from memlayout.audit.recorder import audit

    model, x, shift = _Flat(), torch.randn(2, 3, 8, 8), torch.randn(1, 4, 1, 1)
    drops = audit(model, x, kwargs={"shift": shift}, train=True).drops
    by_hand = audit(_Bound(model, shift), x, train=True).drops
    assert drops and [(r.op, r.phase) for r in drops] == [(r.op, r.phase) for r in by_hand]


class _Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.flat = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten()

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.flat(self.conv(x) + shift)  # Flatten copies a channels-last map: a drop


class _Bound(torch.nn.Module):
    """A model with its keyword input bound: the call the keyword path must equal."""

    def __init__(self, model: torch.nn.Module, shift: torch.Tensor) -> None:
        super().__init__()
        self.model, self.shift = model, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, shift=self.shift)


def test_a_factory_that_raises_is_one_message_naming_file_factory_and_exception(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(FACTORIES)
    with pytest.raises(ModelSpecError, match=r"broken\(\) in .*nets.py.* raised RuntimeError: "
                                             "weights file missing"):
        load_model(f"{path}:broken")
    plain = CliRunner().invoke(app, ["optimize", f"{path}:broken"])
    assert plain.exit_code == 2 and "weights file missing" in plain.output
    assert "Traceback" not in plain.output
    debug = CliRunner().invoke(app, ["optimize", f"{path}:broken", "--debug"])
    assert debug.exit_code == 2 and "Traceback" in debug.output and "nets.py" in debug.output


def test_only_a_2d_image_model_gets_an_invented_input(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text(FACTORIES)
    with pytest.raises(ModelSpecError, match="Conv3d.*no input can be assumed"):
        load_model(f"{path}:volume")
    spec = load_model(f"{path}:image", batch=2, image_size=16)
    assert tuple(spec.example_input.shape) == (2, 3, 16, 16) and "invented" in spec.note
