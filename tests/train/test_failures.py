"""What a user can get wrong around ``memlayout train`` ends in one clear error, before long
work where it can: checkpoint folders (a file, a missing or unwritable parent, a full disk,
a second run on the same folder, a live writer's temporary file), a rank that stops answering
(during an FSDP step), BatchNorm statistics per rank."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from memlayout.cli import app
from memlayout.errors import CheckpointError, TrainError
from memlayout.train import checkpoint as ckpt
from memlayout.train import load_checkpoint, make_synthetic, train
from memlayout.train.checkpoint import LATEST, PAUSE_ENV, CheckpointLock, atomic_save
from memlayout.train.ddp import DistInfo, batchnorm_notice
from memlayout.train.loop import Trainer
from tests.support.train import IMAGE, config, write_models

pytestmark = pytest.mark.faults

SRC = str(Path(__file__).resolve().parents[2] / "src")
WAIT = 90  # seconds: a bound on child processes that must not hang the suite


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("failures")
    write_models(folder)
    make_synthetic(folder / "data", 16, classes=4, size=IMAGE)
    return folder


def python(code: str, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """A second Python process that imports this checkout's memlayout."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, text=True, **kw)


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends a SIGSTOPped process too
        proc.wait(timeout=WAIT)


# ---------------------------------------------------------------------------------------
# Bad checkpoint locations are refused before training starts

def _location_cases(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "a-file").write_text("not a folder")
    return {
        "a file": (tmp / "a-file", "is a file; expected a folder"),
        "missing parent": (tmp / "no-such" / "ckpt", "does not exist; create it first"),
        "parent a file": (tmp / "a-file" / "ckpt", "is a file, not a folder"),
    }


@pytest.mark.parametrize("case", ["a file", "missing parent", "parent a file"])
def test_a_bad_checkpoint_location_is_refused_before_training(work, tmp_path, case):
    path, reason = _location_cases(tmp_path)[case]
    events: list[object] = []
    with pytest.raises(CheckpointError, match=reason) as info:
        train(config(work, checkpoint=str(path), max_steps=2), on_event=events.append)
    assert str(path) in str(info.value)
    assert events == []  # not one step was trained


def test_training_channels_last_into_a_kernel_fault_is_refused_before_a_step(work):
    events: list[object] = []
    model = f"{work / 'tiny_models.py'}:strided_stem"
    with pytest.raises(TrainError, match=r"--layout nhwc would train 0 channels-last, and "
                                         r"oneDNN's .* --layout planned"):
        train(config(work, model=model, layout="nhwc", max_steps=2), on_event=events.append)
    assert events == []


def test_the_cli_names_a_bad_checkpoint_location_in_one_line(work, tmp_path):
    path, _ = _location_cases(tmp_path)["a file"]
    res = CliRunner().invoke(app, ["train", f"{work / 'tiny_models.py'}:plain", "--data",
                                   str(work / "data"), "--image-size", str(IMAGE), "--batch", "4",
                                   "--checkpoint", str(path)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "error:" in text and str(path) in text and "Traceback" not in text
    assert "Epoch" not in text


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_checkpoint_location_is_refused(work, tmp_path):
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="not writable"):
            train(config(work, checkpoint=str(locked / "ckpt"), max_steps=2))
    finally:
        locked.chmod(0o700)


def test_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    path = tmp_path / "ckpt" / LATEST
    atomic_save({"step": 1}, path)
    written: list[int] = []

    def disk_full(fd: int, data: memoryview) -> None:
        if written:  # the first half fits, the second does not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(os.write(fd, data))

    monkeypatch.setattr(ckpt, "_write_all", disk_full)
    with pytest.raises(CheckpointError) as info:
        atomic_save({"step": 2, "weights": torch.zeros(1000)}, path)
    message = str(info.value)
    assert str(path) in message and "No space left" in message and "free space" in message
    assert "previous latest.pt is kept" in message
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert ckpt.temporaries(path.parent) == []  # the partial file is gone


def test_a_full_disk_during_training_is_a_checkpoint_error(work, tmp_path, monkeypatch):
    def disk_full(fd: int, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_write_all", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        train(config(work, checkpoint=str(tmp_path / "ckpt"), max_steps=1))


# ---------------------------------------------------------------------------------------
# One writer per checkpoint folder

WRITER = """
import sys
from memlayout.train.checkpoint import CheckpointLock, atomic_save
lock = CheckpointLock(sys.argv[1])
atomic_save({"step": 2, "pad": bytes(4096)}, sys.argv[1] + "/latest.pt")
"""


def test_a_second_run_is_refused_and_never_touches_the_writers_files(work, tmp_path):
    folder = tmp_path / "shared"
    # a run holding the folder, paused half-way through a checkpoint write (as if slow)
    writer = python(WRITER, str(folder), env={PAUSE_ENV: "1:60"})
    try:
        deadline = time.monotonic() + WAIT
        while not [t for t in ckpt.temporaries(folder) if t.stat().st_size > 0]:
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        (live,) = ckpt.temporaries(folder)
        assert str(writer.pid) in live.name

        events: list[object] = []
        with pytest.raises(CheckpointError) as info:
            train(config(work, checkpoint=str(folder), max_steps=1), on_event=events.append)
        message = str(info.value)
        assert str(folder) in message and f"pid {writer.pid}" in message
        assert "its own --checkpoint folder" in message
        assert events == []  # refused at its start, not one step trained
        # a cleaner (not holding the lock) leaves a live writer's file alone
        assert ckpt.remove_stale_temporaries(folder) == [] and live.exists()

        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=WAIT)
        # the kernel dropped the dead writer's lock; its half-written file is stale now and
        # goes when the next run takes the folder
        assert ckpt.stale_temporaries(folder) == [live]
        assert train(config(work, checkpoint=str(folder), max_steps=1)).step == 1
        assert ckpt.temporaries(folder) == []
        assert load_checkpoint(folder / LATEST)["step"] == 1
    finally:
        stop(writer)


def test_the_lock_is_released_when_a_run_ends(work, tmp_path):
    folder = tmp_path / "ckpt"
    with Trainer(config(work, checkpoint=str(folder), max_steps=1)) as trainer:
        with pytest.raises(CheckpointError, match="in use by another training run"):
            CheckpointLock(folder)
        trainer.run()
    CheckpointLock(folder).release()  # free again


# ---------------------------------------------------------------------------------------
# A rank that stops answering

# rank 0 trains a model sharded with FSDP (its parameter all-gathers are the collectives that
# wait), or replicated with DDP (its layout check and gradient all-reduce)
COLLECTIVE = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
from memlayout.errors import TrainError
from memlayout.train.ddp import DistInfo, collectives, wrap_ddp
from memlayout.train.fsdp import wrap_fsdp

strategy, port = sys.argv[1], int(sys.argv[2])
# the ranks may take long to start on a busy machine: joining waits for them as long as the
# test does; gloo's own set-up and the collectives get the run's timeout
store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=90))
# (the prefix init_process_group gives its own store, which rank 1's env:// join uses)
dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                        world_size=2, timeout=timedelta(seconds=2))
info = DistInfo(rank=0, world_size=2)
try:
    with collectives(info, 2, f"a {strategy.upper()} training step"):
        model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3)), nn.Flatten(),
                              nn.Linear(4 * 6 * 6, 2))
        model = wrap_fsdp(model) if strategy == "fsdp" else wrap_ddp(model)
        x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
        model(x).sum().backward()
except TrainError as exc:
    print(f"error: {exc}", flush=True)
    sys.exit(3)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# rank 1 joins and freezes (as under a debugger, or swapped out); plain torch: fast to start
FROZEN = """
import os, signal
import torch.distributed as dist
dist.init_process_group("gloo")
os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_frozen_rank_is_named_within_the_timeout(strategy):
    port = _free_port()
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [python(code, *args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r, (code, args) in enumerate(((COLLECTIVE, (strategy, str(port))),
                                               (FROZEN, ())))]
    try:
        out, _ = ranks[0].communicate(timeout=WAIT)  # torch's default would be 30 minutes
        assert ranks[0].returncode == 3, out
        text = " ".join(out.split())
        assert (f"rank 0 of 2: rank 1 stopped answering while a {strategy.upper()} training "
                "step") in text
        assert "--timeout 2 s" in text and "raise --timeout" in text
        assert "Traceback" not in text
    finally:
        stop(*ranks)


def test_the_timeout_must_be_positive(work):
    with pytest.raises(TrainError, match="--timeout must be > 0"):
        train(config(work, timeout=0))


# ---------------------------------------------------------------------------------------
# BatchNorm statistics per rank

def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())


def test_batchnorm_under_ddp_is_announced_with_what_can_be_done():
    two = DistInfo(rank=0, world_size=2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    text = batchnorm_notice(_bn_model(), two, device=cpu, sync_batchnorm=False)
    assert text and "1 BatchNorm layers (1)" in text and "its own batch's statistics" in text
    assert "CUDA only" in text  # no --sync-bn offered where it cannot run
    assert "--sync-bn shares" in batchnorm_notice(_bn_model(), two, device=cuda,
                                                  sync_batchnorm=False)
    # nothing to say: one process, SyncBatchNorm asked for, or no BatchNorm
    assert batchnorm_notice(_bn_model(), DistInfo(), device=cpu, sync_batchnorm=False) is None
    assert batchnorm_notice(_bn_model(), two, device=cuda, sync_batchnorm=True) is None
    assert batchnorm_notice(nn.Conv2d(3, 4, 3), two, device=cpu, sync_batchnorm=False) is None


def test_sync_bn_on_cpu_under_ddp_says_it_is_cuda_only(work):
    with pytest.raises(TrainError, match="no CPU kernel.*own BatchNorm statistics"):
        Trainer(config(work, sync_batchnorm=True), DistInfo(rank=0, world_size=2))


@pytest.fixture
def one_member_group(tmp_path):
    """A gloo group of this process alone: enough for a Trainer told it is one of two ranks
    to build DDP (a second real rank costs a second torch start)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        import gc

        gc.collect()  # no DDP reducer may outlive the group
        dist.destroy_process_group()


def test_a_batchnorm_model_under_ddp_warns_once_on_rank_0(work, one_member_group):
    for rank in (0, 1):
        events: list[object] = []
        trainer = Trainer(config(work), DistInfo(rank=rank, world_size=2), on_event=events.append)
        warned = [e for e in events if "BatchNorm" in str(e)]
        if rank == 0:
            assert len(warned) == 1 and str(warned[0]).startswith("warning: the model has 1 ")
        else:
            assert warned == []
        del trainer
    events = []
    plain = config(work, model=f"{work / 'tiny_models.py'}:plain")
    del Trainer(plain, DistInfo(rank=0, world_size=2), on_event=events.append).model
    assert events == []
