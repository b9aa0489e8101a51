"""One plan per training job: ``memlayout train --layout planned`` plans on rank 0 alone (the
other ranks take its planned model, measuring nothing), and ``memlayout train --compile
backend`` under torchrun measures each graph on rank 0 and compiles that plan on every rank.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memlayout.errors import TrainError
from memlayout.train import DistInfo, TrainConfig, make_synthetic, planning
from memlayout.train.compiling import CompiledPlans
from memlayout.train.config import settings_of
from tests.support.torchrun import LAYOUT_WARNINGS, torchrun

# a model file of its own class (file specs reach the torchrun processes)
MODELS = '''
from torch import nn


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.down(self.stem(x)).mean((2, 3)))


def small():
    return Small()
'''


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_only_rank_0_plans_the_trained_model_and_the_others_take_it(monkeypatch):
    from memlayout.plan import pipeline

    config = TrainConfig("net", "data", plan_measure=False)
    example = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    sent: list[Any] = []
    monkeypatch.setattr(planning.dist, "broadcast_object_list",
                        lambda box, src: sent.append(box[0]))
    zero, summary0 = planning.plan_on_rank0(_net(), example, config, DistInfo(0, 2, 0))

    def no_planning(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank other than 0 planned")

    monkeypatch.setattr(pipeline, "optimize", no_planning)
    monkeypatch.setattr(planning.dist, "broadcast_object_list",
                        lambda box, src: box.__setitem__(0, sent[0]))
    one, summary1 = planning.plan_on_rank0(_net(), example, config, DistInfo(1, 2, 1))

    assert summary1 == summary0 and summary0
    assert {n: p.stride() for n, p in one.named_parameters()} == {
        n: p.stride() for n, p in zero.named_parameters()}
    torch.testing.assert_close(one(example), zero(example), rtol=0, atol=0)


def test_compile_settings_are_checked_and_not_kept_in_a_checkpoint():
    with pytest.raises(TrainError, match="--compile 'fast' is not one of none, inductor, backend"):
        TrainConfig("m", "d", compile="fast").check()
    with pytest.raises(TrainError, match="--compile backend plans every graph"):
        TrainConfig("m", "d", compile="backend", layout="planned").check()
    assert "compile" not in settings_of(TrainConfig("m", "d", compile="backend"))


@pytest.mark.parametrize("digests,agree", [(("a", "b"), True), (("a", "c"), False)])
def test_the_run_says_whether_every_rank_ran_the_same_plans(digests, agree):
    zero = (("0/0", "a", 0, 5), ("0/1", "b", 0, 3))
    one = tuple((g, d, 0, 0) for (g, *_), d in zip(zero, digests, strict=True))
    plans = CompiledPlans((zero, one))
    assert plans.agree is agree
    text = plans.describe()
    assert "decided by rank 0 (8 costs timed there, 0 on the other ranks)" in text
    assert ("every rank runs the same plan" in text) is agree
    assert ("different plans for graph 0/1" in text) is not agree


def test_two_ranks_train_with_the_backend_measured_on_rank_0(tmp_path: Path):
    (tmp_path / "user_models.py").write_text(MODELS)
    make_synthetic(tmp_path / "data", 8, classes=4, size=16)
    res = torchrun("-m", "memlayout.cli", "train", f"{tmp_path / 'user_models.py'}:small",
                   "--data", str(tmp_path / "data"), "--image-size", "16", "--layout", "nhwc",
                   "--batch", "2", "--max-steps", "2", "--log-every", "1",
                   "--compile", "backend", cwd=tmp_path,
                   env={"MEMLAYOUT_CACHE_DIR": str(tmp_path / "cache"),
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    out = " ".join(res.stdout.split())
    assert "torch.compile with memlayout's backend" in out
    timed = re.search(r"memlayout backend: \d+ graphs?, decided by rank 0 \((\d+) costs timed "
                      r"there, 0 on the other ranks\); every rank runs the same plan", out)
    assert timed and int(timed.group(1)) > 0, out[-2000:]
    assert "BackendWarning" not in log and not any(t in log for t in LAYOUT_WARNINGS)
