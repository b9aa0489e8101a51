"""Nothing lost, nothing silently misconfigured around ``memlayout train``: a checkpoint is
never replaced unasked, a setting given on resume wins over the checkpoint's (and every
difference is named), non-finite settings are refused before any work, a diverging run
stops before it checkpoints, and an unreadable image is named in one error line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.errors import CheckpointError, TrainError
from memlayout.train import load_checkpoint, make_synthetic, train
from memlayout.train.checkpoint import LATEST
from memlayout.train.loop import Trainer
from tests.support.train import IMAGE, config, write_models

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("safeguards")
    write_models(folder)
    make_synthetic(folder / "data", 16, classes=4, size=IMAGE)
    return folder


def cli(work: Path, *flags: str, model: str = "plain", data: Path | None = None):
    return CliRunner().invoke(app, ["train", f"{work / 'tiny_models.py'}:{model}", "--data",
                                    str(data or work / "data"), "--image-size", str(IMAGE),
                                    "--batch", "4", "--log-every", "2", "--plan-costs",
                                    "analytic", *flags])


def one_error_line(res, *, before_work: bool = True) -> str:
    """The output's one ``error:`` line (exit code 2, no traceback), joined; ``before_work``:
    nothing else came before it."""
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert text.count("error:") == 1 and "Traceback" not in text
    assert text.startswith("error:") if before_work else "Epoch" not in text.split("error:")[1]
    return text.split("error:")[1]


def params(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


# ---------------------------------------------------------------------------------------
# A checkpoint is continued or replaced on request only

def test_a_run_without_resume_refuses_a_folder_that_holds_a_checkpoint(work, tmp_path):
    folder = tmp_path / "ckpt"
    assert cli(work, "--checkpoint", str(folder), "--max-steps", "3").exit_code == 0
    latest = folder / LATEST
    before, step = latest.read_bytes(), load_checkpoint(latest)["step"]
    text = one_error_line(cli(work, "--checkpoint", str(folder), "--max-steps", "1"))
    assert str(folder) in text and f"latest.pt (step {step})" in text
    assert "--resume" in text and "--overwrite" in text
    assert latest.read_bytes() == before
    one_error_line(cli(work, "--checkpoint", str(folder), "--resume", "--overwrite"))
    res = cli(work, "--checkpoint", str(folder), "--max-steps", "1", "--overwrite")
    assert res.exit_code == 0, res.output
    assert load_checkpoint(latest)["step"] == 1


def test_the_library_refuses_it_too(work, tmp_path):
    folder = tmp_path / "ckpt"
    train(config(work, checkpoint=str(folder), max_steps=2))
    with pytest.raises(CheckpointError, match=r"latest.pt \(step 2\).*--resume.*--overwrite"):
        train(config(work, checkpoint=str(folder), max_steps=1))
    assert train(config(work, checkpoint=str(folder), max_steps=1, overwrite=True)).step == 1


# ---------------------------------------------------------------------------------------
# On resume, the settings given win; every difference is named

def test_on_resume_the_given_lr_is_used_and_every_difference_named(work, tmp_path):
    plain = f"{work / 'tiny_models.py'}:plain"
    folder = tmp_path / "ckpt"
    train(config(work, model=plain, checkpoint=str(folder), max_steps=2, lr=0.05))
    start = params(folder / LATEST)
    events: list[object] = []
    with Trainer(config(work, model=plain, checkpoint=str(folder), resume=True, max_steps=4,
                        lr=0.0, log_every=2), on_event=events.append) as trainer:
        assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.0]
        trainer.run()
    notes = [str(e) for e in events if str(e).startswith("note: resuming")]
    assert len(notes) == 1 and "lr 0.05 -> 0.0" in notes[0] and "log_every 3 -> 2" in notes[0]
    assert "will not repeat" in notes[0]
    # lr 0: SGD moves no weight (momentum or not), so the resumed steps left them as they were
    end = params(folder / LATEST)
    assert load_checkpoint(folder / LATEST)["step"] == 4
    assert all(torch.equal(start[k], end[k]) for k in start)


def test_the_cli_resumes_with_the_checkpoints_settings_unless_given_again(work, tmp_path):
    folder = tmp_path / "ckpt"
    assert cli(work, "--checkpoint", str(folder), "--max-steps", "2", "--lr", "0.05",
               "--seed", "3").exit_code == 0
    # not given again: the checkpoint's lr and seed, said so
    res = cli(work, "--checkpoint", str(folder), "--resume", "--max-steps", "3")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "with its settings lr 0.05, seed 3 (not given on the command line)" in text
    assert "resuming with settings other" not in text
    saved = load_checkpoint(folder / LATEST)["config"]
    assert (saved["lr"], saved["seed"]) == (0.05, 3)
    # given: it wins, and the note says what changed
    at = params(folder / LATEST)
    res = cli(work, "--checkpoint", str(folder), "--resume", "--max-steps", "4", "--lr", "0")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "lr 0.05 -> 0.0" in text
    assert all(torch.equal(at[k], v) for k, v in params(folder / LATEST).items())


# ---------------------------------------------------------------------------------------
# Non-finite settings are refused; a diverging run stops before it checkpoints

@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_non_finite_or_negative_lr_is_refused_before_any_work(work, tmp_path, value):
    data, folder = tmp_path / "data", tmp_path / "ckpt"
    text = one_error_line(cli(work, "--lr", value, "--synthetic", "8", "--checkpoint",
                              str(folder), data=data))
    assert f"--lr {float(value)}" in text and "finite" in text
    assert not data.exists() and not folder.exists()  # nothing written, nothing trained
    with pytest.raises(TrainError, match="finite number"):
        train(config(work, lr=float(value)))


def _first_non_finite_step(cfg) -> int:
    """Reality: the step at which this configuration's loss first stops being finite."""
    with Trainer(cfg) as trainer:
        for step in range(1, trainer.total_steps + 1):
            loss, _ = trainer.train_step(*trainer.next_batch())
            if not math.isfinite(loss.item()):
                return step
    raise AssertionError("the run never diverged: raise the lr of the test")


def test_a_diverging_run_stops_naming_the_step_and_writes_no_checkpoint(work, tmp_path):
    cfg = config(work, lr=1e30, epochs=2, log_every=8)
    step = _first_non_finite_step(cfg)
    folder = tmp_path / "ckpt"
    with pytest.raises(TrainError, match=rf"loss is not finite at step {step} ") as info:
        train(config(work, lr=1e30, epochs=2, log_every=8, checkpoint=str(folder)))
    assert "before writing a checkpoint" in str(info.value)
    assert not (folder / LATEST).exists()


def test_weights_that_are_not_finite_are_never_checkpointed(work, tmp_path):
    folder = tmp_path / "ckpt"
    with Trainer(config(work, checkpoint=str(folder), max_steps=1)) as trainer:
        step = trainer.optimizer.step

        def step_then_break(*args, **kwargs):  # fault injection: the update goes NaN
            out = step(*args, **kwargs)
            next(iter(trainer.model.parameters())).data.fill_(math.nan)
            return out

        trainer.optimizer.step = step_then_break
        with pytest.raises(TrainError, match=r"not finite at step 1 \(0.weight\)"):
            trainer.run()
    assert not (folder / LATEST).exists()


# ---------------------------------------------------------------------------------------
# An unreadable image is named

def test_an_unreadable_image_stays_named_under_a_library_that_wraps_pil(tmp_path,
                                                                       monkeypatch) -> None:
    # as ultralytics does on import: a file PIL does not identify is retried after installing
    # a plugin, and that step fails with its own error (raised while PIL's is handled)
    from memlayout.train.data import Unreadable, read_image

    pil_open = Image.open

    def wrapped(fp, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:
            return pil_open(fp, *args, **kwargs)
        except Image.UnidentifiedImageError:
            raise ModuleNotFoundError("No module named 'pi_heif'") from None

    monkeypatch.setattr(Image, "open", wrapped)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\x00not an image\xff" * 8)
    got = read_image(str(bad))
    assert isinstance(got, Unreadable) and "no image format" in got.reason
    good = tmp_path / "good.png"
    Image.new("RGB", (4, 4)).save(good)
    assert read_image(str(good)).size == (4, 4)  # the wrapper's success path is untouched


@pytest.mark.parametrize(("layout", "workers", "damage"), [
    ("nhwc", "0", "garbage"), ("nchw", "1", "garbage"), ("nhwc", "1", "truncated")])
def test_an_unreadable_image_is_one_error_naming_the_file(work, tmp_path, layout, workers,
                                                         damage):
    data = tmp_path / "data"
    make_synthetic(data, 16, classes=4, size=IMAGE)
    bad = sorted(data.rglob("*.jpg"))[5]
    whole = bad.read_bytes()
    bad.write_bytes(b"\x00not an image\xff" * 8 if damage == "garbage" else whole[:len(whole) // 2])
    with pytest.raises(OSError):  # what PIL makes of it
        Image.open(bad).load()
    # 16 images, batch 4: every image is read in the first epoch
    text = one_error_line(cli(work, "--layout", layout, "--workers", workers, data=data),
                          before_work=False)
    assert str(bad) in text and "cannot be read as an image" in text
    with pytest.raises(TrainError, match="cannot be read as an image"):
        train(config(work, data=str(data), layout=layout))
