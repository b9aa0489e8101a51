"""memlayout.train across processes: 2-process DDP on gloo (torchrun) equals one process on
the global batch with no gradient-layout warning, and a training process killed in the middle
of a checkpoint write leaves the previous checkpoint loadable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memlayout.models import load_model
from memlayout.train import TrainConfig, load_checkpoint, make_synthetic, train
from memlayout.train.checkpoint import LATEST, PAUSE_ENV, stale_temporaries, temporaries
from tests.support.torchrun import LAYOUT_WARNINGS, TIMEOUT, torchrun
from tests.support.train import IMAGE, write_models


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ddp")
    write_models(folder)
    make_synthetic(folder / "data", 32, classes=4, size=IMAGE)
    return folder


def test_two_process_ddp_equals_one_process_on_the_global_batch(work):
    # one torchrun run (they are slow here), of the planned model: its convolutions run
    # channels-last
    layout = "planned"
    steps = 6
    common = ["--data", str(work / "data"), "--image-size", str(IMAGE), "--layout", layout,
              "--max-steps", str(steps), "--log-every", "3", "--lr", "0.05",
              "--plan-costs", "analytic"]
    ddp = torchrun("-m", "memlayout.cli", "train", f"{work / 'tiny_models.py'}:plain",
                   "--batch", "2", "--checkpoint", str(work / f"ddp-{layout}"), *common, cwd=work)
    log = ddp.stdout + ddp.stderr
    assert ddp.returncode == 0, log[-3000:]
    assert "2 processes (torchrun, DDP gloo)" in " ".join(ddp.stdout.split())
    assert ddp.stdout.count("Epoch: [0][   6/8]") == 1  # rank 0 logs, once
    for text in LAYOUT_WARNINGS:
        assert text not in log

    single = train(TrainConfig(f"{work / 'tiny_models.py'}:plain", str(work / "data"), batch=4,
                               image_size=IMAGE, layout=layout, max_steps=steps, log_every=3,
                               lr=0.05, plan_measure=False,
                               checkpoint=str(work / f"one-{layout}")))
    assert single.step == steps
    a = load_checkpoint(work / f"ddp-{layout}" / LATEST)
    b = load_checkpoint(work / f"one-{layout}" / LATEST)
    assert a["world_size"] == 2 and b["world_size"] == 1 and a["step"] == b["step"] == steps
    start = TrainConfig(f"{work / 'tiny_models.py'}:plain", str(work / "data"))
    moved = False
    for key, value in a["model"].items():
        # same global batch, gradients averaged over ranks: equal up to summation order
        torch.testing.assert_close(value, b["model"][key], rtol=1e-4, atol=1e-6)
        moved = moved or not torch.equal(value, _initial(start)[key])
    assert moved  # training changed the weights: the comparison is not of two fresh models


def _initial(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    return load_model(cfg.model, batch=1, image_size=IMAGE, seed=cfg.seed).module.state_dict()


WORKER = '''
import gc, json, sys, warnings
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from memlayout.train.ddp import grad_layout_mismatches, wrap_ddp


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def two_steps(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)).sum().backward()
        opt.step()


dist.init_process_group("gloo")
out = {}
# wrapped first: torch warns once per process, so the late conversion must come second
for case in ("wrap_ddp", "converted_after_ddp"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "wrap_ddp":
            model = wrap_ddp(net().to(memory_format=torch.channels_last))
        else:  # the usual mistake: DDP built its buckets before the conversion
            model = DistributedDataParallel(net(), gradient_as_bucket_view=False)
            model.module.to(memory_format=torch.channels_last)
        two_steps(model)
    out[case] = {"warnings": [str(w.message) for w in caught],
                 "mismatches": grad_layout_mismatches(model)}
    del model  # a DDP reducer alive when the group goes aborts the process (1 run in ~6)
gc.collect()
# one file per rank: the two ranks share torchrun's stdout, where their lines can interleave
with open(f"result-{dist.get_rank()}.json", "w") as fh:
    json.dump(out, fh)
dist.barrier()
dist.destroy_process_group()
'''


def test_wrap_ddp_emits_no_layout_warning_where_a_late_conversion_does(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    res = torchrun(str(tmp_path / "worker.py"), cwd=tmp_path)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        # the control: the capture sees torch's warning when layouts change after DDP
        assert any("Grad strides do not match" in w for w in r["converted_after_ddp"]["warnings"])
        assert r["wrap_ddp"] == {"warnings": [], "mismatches": []}


@pytest.mark.faults
def test_killed_during_a_checkpoint_write_the_previous_one_survives(work, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    # 8 steps per epoch; the first write (end of epoch 0) completes, the second (end of
    # epoch 1) stops half-written for a minute: the test kills the process there.
    cmd = [sys.executable, "-m", "memlayout.cli", "train", f"{work / 'tiny_models.py'}:bn_dropout",
           "--data", str(work / "data"), "--image-size", str(IMAGE), "--batch", "4",
           "--epochs", "3", "--checkpoint", str(ckpt_dir)]
    env = {**os.environ, PAUSE_ENV: "2:60"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        latest = ckpt_dir / LATEST
        # the first write done (latest.pt there), the second one begun (its temporary file)
        while not (latest.exists() and [p for p in temporaries(ckpt_dir)
                                        if p.stat().st_size > 0]):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the second checkpoint write never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    partial = stale_temporaries(ckpt_dir)
    assert partial  # the half-written file is there (its writer dead): the kill was mid-write
    assert latest.stat().st_size > partial[0].stat().st_size
    state = load_checkpoint(latest)
    assert state["step"] == 8 and state["epoch"] == 1 and state["step_in_epoch"] == 0
    # ... and training resumes from it.
    resumed = train(TrainConfig(f"{work / 'tiny_models.py'}:bn_dropout", str(work / "data"),
                                batch=4, image_size=IMAGE, epochs=2, resume=True,
                                checkpoint=str(ckpt_dir)))
    assert resumed.start_step == 8 and resumed.step == 16
    assert load_checkpoint(latest)["step"] == 16 and not temporaries(ckpt_dir)
