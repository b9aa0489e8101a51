"""Bad input ends in one ``error:`` line with exit code 2 through the CLI, and in a
``MemlayoutError`` in Python, never in a raw traceback: a factory that builds on the meta
device, a plan file that is not text."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import memlayout
from memlayout.cli import app
from memlayout.errors import MemlayoutError, ModelSpecError, PlanError
from memlayout.models import load_model
from tests.support.faults import write_models

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("errors"))


def one_error_line(res) -> str:
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.output.lstrip().startswith("error:")
    return " ".join(res.output.split())


def test_a_factory_on_the_meta_device_is_one_error_in_every_verb(models):
    spec = f"{models}:on_meta"
    # what torch itself does with such a model: it cannot be moved or run
    with torch.device("meta"):
        net = torch.nn.Conv2d(3, 8, 3)
    with pytest.raises(NotImplementedError):
        net.to("cpu")
    for verb in (["optimize", spec, "--no-measure", "--rounds", "0"], ["audit", spec],
                 ["inspect", spec]):
        text = one_error_line(CliRunner().invoke(app, verb))
        assert "meta device" in text and "on_meta()" in text and "to_empty" in text
    with pytest.raises(ModelSpecError, match="meta device"):
        load_model(spec)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", bytes(range(256))])
def test_a_binary_plan_file_is_one_error(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(UnicodeDecodeError):
        path.read_text(encoding="utf-8")  # what reading it as text does
    text = one_error_line(CliRunner().invoke(app, ["optimize", "torchvision:resnet18",
                                                   "--plan", str(path)]))
    assert str(path) in text and "not text" in text and "--save" in text
    with pytest.raises(PlanError, match="not text") as info:
        memlayout.apply(torch.nn.Conv2d(3, 3, 1), path)
    assert isinstance(info.value, MemlayoutError)
