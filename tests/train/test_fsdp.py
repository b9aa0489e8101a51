"""memlayout train --strategy fsdp: FSDP2 (``fully_shard`` per block, then the root) with
planned layouts on 2 gloo ranks equals one process on the global batch, with no layout
warning; its sharded checkpoint (DCP) resumes at another world size (2 ranks, then 1) and
loads into the plain, unplanned model in one process; a planned model with contiguous weights
is taken by ``fully_shard`` as it is, a channels-last one refused with what to do. (A frozen
rank during an FSDP step: tests/train/test_failures.py.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from memlayout.errors import FSDPError, TrainError
from memlayout.models import load_model
from memlayout.plan.pipeline import optimize
from memlayout.timing import KEEP_MARGIN
from memlayout.train import TrainConfig, load_checkpoint, make_synthetic, train
from memlayout.train.checkpoint import (
    LATEST,
    LATEST_SHARDED,
    load_sharded_model,
    remove_stale_temporaries,
)
from memlayout.train.ddp import grad_layout_mismatches
from memlayout.train.fsdp import shard_groups, wrap_fsdp
from tests.support.torchrun import LAYOUT_WARNINGS, torchrun

IMAGE = 16

# A stem, two residual blocks in a Sequential (FSDP's blocks), a head; no BatchNorm or
# dropout, so N ranks compute what one process computes on the global batch.
MODELS = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.relu(self.conv1(x)))


def blocks():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                         nn.Sequential(Block(8), Block(8)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fsdp")
    (folder / "tiny_fsdp.py").write_text(MODELS)
    make_synthetic(folder / "data", 32, classes=4, size=IMAGE)
    return folder


def _config(work: Path, **kw) -> TrainConfig:
    base = dict(model=f"{work / 'tiny_fsdp.py'}:blocks", data=str(work / "data"), batch=4,
                image_size=IMAGE, layout="planned", log_every=2, lr=0.05, plan_measure=False)
    base.update(kw)
    return TrainConfig(**base)


def _plain(work: Path) -> nn.Module:
    return load_model(f"{work / 'tiny_fsdp.py'}:blocks", batch=1, image_size=IMAGE,
                      seed=0).module


def test_fsdp_on_two_ranks_equals_one_process_and_resumes_on_one(work):
    steps = 4
    run = torchrun("-m", "memlayout.cli", "train", f"{work / 'tiny_fsdp.py'}:blocks",
                   "--strategy", "fsdp", "--layout", "planned", "--batch", "2",
                   "--data", str(work / "data"), "--image-size", str(IMAGE),
                   "--max-steps", str(steps), "--log-every", "2", "--lr", "0.05",
                   "--plan-costs", "analytic", "--checkpoint", str(work / "fsdp"), cwd=work)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "2 processes (torchrun, FSDP gloo)" in " ".join(run.stdout.split())
    for text in (*LAYOUT_WARNINGS, "non-contiguous"):
        assert text not in log
    sharded = [float(v) for v in re.findall(r"Loss (\d+\.\d+)", run.stdout)]
    assert len(sharded) == 2  # rank 0 logs, every 2 steps

    # one process, batch 2 x 2: the same global batches, 8 steps straight
    straight = train(_config(work, max_steps=2 * steps))
    losses = [i.loss for i in straight.intervals]
    # the log prints 4 decimals; the rest is summation order across ranks
    assert sharded == pytest.approx(losses[:2], abs=2e-4)

    # the sharded checkpoint, read into the plain, unplanned model in one process, computes
    # what one process's checkpoint after the same steps computes
    train(_config(work, max_steps=steps, checkpoint=str(work / "one")))
    from_sharded = load_sharded_model(_plain(work), work / "fsdp").eval()
    reference = _plain(work).eval()
    reference.load_state_dict(load_checkpoint(work / "one" / LATEST)["model"])
    x = torch.randn(3, 3, IMAGE, IMAGE)
    with torch.no_grad():
        torch.testing.assert_close(from_sharded(x), reference(x), rtol=1e-4, atol=1e-5)

    # resumed on one process (another world size, the same global batch): continues the
    # loss curve of the straight run
    shutil.copytree(work / "fsdp", work / "resume", symlinks=True)
    notes: list[str] = []
    resumed = train(_config(work, strategy="fsdp", checkpoint=str(work / "resume"),
                            resume=True, max_steps=2 * steps), on_event=notes.append)
    assert resumed.start_step == steps and resumed.step == 2 * steps
    assert [i.loss for i in resumed.intervals] == pytest.approx(losses[2:], rel=1e-4)
    assert not [n for n in notes if isinstance(n, str) and "other settings" in n]
    assert (work / "resume" / LATEST_SHARDED).is_symlink()


def test_with_measured_costs_the_ranks_time_the_plan_together_and_train_what_they_keep(work,
                                                                                     tmp_path):
    """Measured costs under torchrun: every rank times the plan against the original model
    at once, rank 0 decides, and the run says which it trains; it trains without a layout
    warning either way (the decision itself is timing: tests/train/test_train.py fakes the clock)."""
    run = torchrun("-m", "memlayout.cli", "train", f"{work / 'tiny_fsdp.py'}:blocks",
                   "--strategy", "fsdp", "--layout", "planned", "--batch", "2",
                   "--data", str(work / "data"), "--image-size", str(IMAGE), "--max-steps", "2",
                   "--log-every", "1", "--plan-costs", "measured", cwd=tmp_path,
                   env={"MEMLAYOUT_CACHE_DIR": str(tmp_path / "cache")})
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    said = re.findall(r"planned vs the original model with all 2 ranks computing at once: "
                      r"(\d+\.\d+)x .*?; (the plan is trained|the original model is trained)",
                      " ".join(run.stdout.split()))
    assert len(said) >= 1, log[-3000:]  # in the plan summary (and a note when it gives way)
    ratio, kept = float(said[0][0]), said[0][1]
    threshold = 1.0 + KEEP_MARGIN  # near ties keep the model as built
    if abs(ratio - threshold) > 1e-3:  # the ratio is printed to 3 decimals
        assert (ratio > threshold) == (kept == "the plan is trained")
    assert len(re.findall(r"Loss (\d+\.\d+)", run.stdout)) == 2
    for text in LAYOUT_WARNINGS:
        assert text not in log


def _net() -> nn.Module:
    return load_model("torchvision:resnet18", batch=1, image_size=IMAGE, seed=0).module


def test_a_planned_model_with_contiguous_weights_is_taken_by_fully_shard(one_member_group):
    model = _net()
    x = torch.randn(2, 3, IMAGE, IMAGE).contiguous(memory_format=torch.channels_last)
    planned = optimize(model, x, train=True, weights="contiguous", measure=False, cache=False)
    groups = [name for name, _ in shard_groups(planned)]
    assert groups == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    sharded = wrap_fsdp(planned)
    out = sharded(x)
    assert out.shape == (2, 1000)
    out.sum().backward()
    assert grad_layout_mismatches(sharded) == []
    # the model reached fully_shard unconverted: what the error of a channels-last one says
    with pytest.raises(FSDPError, match="weights='contiguous'"):
        wrap_fsdp(_net().to(memory_format=torch.channels_last))


def test_a_planned_model_trains_in_bf16_under_fsdp_mixed_precision(one_member_group, work):
    model = _plain(work)
    x = torch.randn(2, 3, IMAGE, IMAGE).contiguous(memory_format=torch.channels_last)
    planned = optimize(model, x, dtype="bf16", train=True, weights="contiguous",
                       measure=False, cache=False)
    sharded = wrap_fsdp(planned, dtype=torch.bfloat16)
    out = sharded(x)  # fp32 input, as the data pipeline gives it
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert planned.memlayout.replans == 0  # the example's plan ran: no new "shape" from a cast input
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in sharded.parameters())


def test_fsdp_with_fp16_is_refused_with_what_to_use(work):
    with pytest.raises(TrainError, match="use --dtype bf16"):
        train(_config(work, strategy="fsdp", dtype="fp16"))


@pytest.mark.faults
def test_a_killed_sharded_write_leaves_the_linked_checkpoint_and_is_cleaned_up(tmp_path):
    """What a writer killed mid-way leaves (its temporary folder, a version no link points
    at) is removed by the next run holding the folder; the linked version stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    current = tmp_path / "dcp-step00000004-aaaa"
    current.mkdir()
    (tmp_path / LATEST_SHARDED).symlink_to(current.name)
    orphan = tmp_path / "dcp-step00000008-bbbb"  # renamed, link not yet switched
    orphan.mkdir()
    half = tmp_path / f".{LATEST_SHARDED}.{dead.pid}.cccc.tmp"  # DCP still writing
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"half")
    live = tmp_path / f".{LATEST_SHARDED}.{os.getpid()}.dddd.tmp"  # a live writer's
    live.mkdir()
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([half, orphan])
    assert current.is_dir() and live.is_dir() and (tmp_path / LATEST_SHARDED).resolve() == current
