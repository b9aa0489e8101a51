"""Each rank of a torchrun job on several GPUs works on its own GPU: it is made current before
any collective, rank 0's planned model arrives on it, a plan made for ``cuda:0`` serves
``cuda:k`` as it is, and an NCCL failure names the collective and the rank. No GPU here: CUDA
is a recording fake behind the device seam, and fake tensors carry CUDA devices."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from typer.testing import CliRunner

from memlayout import devices
from memlayout.cli import app
from memlayout.errors import TrainError
from memlayout.plan.steer.state import PlannedState, shape_signature
from memlayout.train import ddp, planning
from memlayout.train.config import TrainConfig
from memlayout.train.ddp import DistInfo, collectives, init_distributed


class Stop(Exception):
    """Ends a run at its first barrier."""


class RecordingCuda:
    """The part of ``torch.cuda`` that making a device current touches; calls go to ``events``."""

    def __init__(self, events: list[tuple[str, Any]]) -> None:
        self.events = events

    def current_device(self) -> int:
        return 0

    def set_device(self, index: int) -> None:
        self.events.append(("set_device", index))


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, Any]]:
    """A torchrun job's rank 1 of 2 on CUDA, its process group calls recorded after the
    seam's ``set_device``: ``init_process_group`` (with the NCCL async error setting it saw),
    ``barrier``, which stops the run, and ``destroy_process_group``."""
    seen: list[tuple[str, Any]] = []
    fake = RecordingCuda(seen)
    monkeypatch.setitem(devices.KINDS, "cuda", lambda d: devices.CudaDevice(d, cuda=fake))
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ddp.NCCL_ASYNC_ERRORS:  # set, then removed: the fixture restores the user's
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    joined = [False]

    def init_process_group(backend: str, **kw: Any) -> None:
        joined[0] = True
        seen.append(("init_process_group", backend,
                     ddp.os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))

    def barrier(*a: Any, **kw: Any) -> None:
        seen.append(("barrier", None))
        raise Stop  # what follows needs a real GPU

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: joined[0])
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: seen.append(("destroy", None)))
    return seen


def test_joining_makes_the_ranks_gpu_current_first_and_nccl_errors_asynchronous(events):
    info = init_distributed("cuda", timeout=5)
    assert (info.rank, info.world_size, info.local_rank) == (1, 2, 1)
    assert events == [("set_device", 1), ("init_process_group", "nccl", "1")]


@pytest.mark.parametrize(("name", "value"), [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
                                           ("NCCL_ASYNC_ERROR_HANDLING", "0")])  # older name
def test_a_users_nccl_error_handling_setting_is_kept(events, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    init_distributed("cuda", timeout=5)
    assert events == [("set_device", 1), ("init_process_group", "nccl",
                                          value if name.startswith("TORCH") else None)]


def test_gloo_on_cpu_leaves_the_nccl_setting_alone(events):
    init_distributed("cpu", timeout=5)
    assert events == [("init_process_group", "gloo", None)]


def test_the_cli_makes_the_ranks_gpu_current_before_its_first_barrier(events, monkeypatch,
                                                                     tmp_path):
    # --synthetic: rank 0 writes the images while the others wait at a barrier
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = CliRunner().invoke(app, ["train", "torchvision:resnet18", "--device", "cuda",
                                      "--synthetic", "4", "--data", str(tmp_path / "d")])
    assert isinstance(result.exception, Stop), result.output
    calls = [e[0] for e in events]
    assert "barrier" in calls
    assert calls.index("set_device") < calls.index("init_process_group") < calls.index("barrier")
    assert ("set_device", 1) in events


# -------------------------------------------------------------------- rank 0's planned model

def test_rank_k_gets_rank_0s_planned_model_on_its_own_device(monkeypatch):
    planned_on_rank0 = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())  # rank 0's, on its device

    def broadcast_object_list(box: list[Any], src: int) -> None:
        box[0] = ("planned", planning._dumps(planned_on_rank0),
                  planning._class_modules(planned_on_rank0))

    monkeypatch.setattr(planning.dist, "broadcast_object_list", broadcast_object_list)
    mine = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    example = torch.empty(2, 3, 8, 8, device="meta")  # rank 1's device (a GPU's stand-in)
    config = TrainConfig("m.py:net", "data", layout="planned", plan_measure=False)
    got, summary = planning.plan_on_rank0(mine, example, config, DistInfo(1, 2, 1))
    assert summary is None
    assert {p.device for p in got.parameters()} == {torch.device("meta")}
    assert [tuple(p.shape) for p in got.parameters()] == \
        [tuple(p.shape) for p in planned_on_rank0.parameters()]


# -------------------------------------------------------------------- one plan, every GPU

def _on(device: str, *shape: int) -> torch.Tensor:
    return FakeTensor(FakeTensorMode(), torch.empty(*shape, device="meta"), torch.device(device))


def test_a_plan_made_for_cuda0_serves_cuda1_without_planning_again():
    planned: list[Any] = []

    def replanner(model: nn.Module, args: Any, kwargs: Any, key: Any) -> None:
        planned.append(key)

    state = PlannedState(plan=types.SimpleNamespace(mode="train"),
                         key=shape_signature((_on("cuda:0", 2, 3, 8, 8),)), dtype=None,
                         ranks=(4,), input_label=None, outputs=(), replanner=replanner)
    model = nn.Identity().train()
    assert state.key_for(model, (_on("cuda:1", 2, 3, 8, 8),), {}) == state.example
    assert planned == []
    # another shape on cuda:1 is planned on first sight (the check above can fail)
    state.key_for(model, (_on("cuda:1", 4, 3, 8, 8),), {})
    assert len(planned) == 1


# -------------------------------------------------------------------- NCCL failures

WATCHDOG = ("[PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated "
            "with exception: [Rank 1] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=10, NumelOut=10, Timeout(ms)=1000) "
            "ran for 1004 milliseconds before timing out.")
REMOTE = ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
          "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
          "network error or a remote process exiting prematurely.")


@pytest.mark.parametrize(("text", "silent", "named"), [
    (WATCHDOG, [], "NCCL collective ALLREDUCE (number 7 of the process group) failed on rank 1"),
    (REMOTE, [0], "an NCCL collective failed on rank 1"),
])
def test_an_nccl_failure_names_the_collective_and_the_rank(monkeypatch, text, silent, named):
    monkeypatch.setattr(ddp, "roll_call", lambda info, seconds: silent)
    with (pytest.raises(TrainError) as caught,
          collectives(DistInfo(1, 2, 1), 1.0, "training step 3 (the gradient all-reduce)")):
        raise dist.DistBackendError(text)
    message = str(caught.value)
    assert message.startswith(f"rank 1 of 2: {named}, reported while training step 3")
    assert "asynchronously" in message and "raise --timeout (now 1 s)" in message
    if silent:
        assert "rank 0 stopped answering" in message


def test_a_gloo_failure_is_reported_as_before(monkeypatch):
    monkeypatch.setattr(ddp, "roll_call", lambda info, seconds: [0])
    with (pytest.raises(TrainError, match="rank 1 of 2: rank 0 stopped answering while a step"),
          collectives(DistInfo(1, 2, 1), 1.0, "a step")):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                           "Connection closed by peer [127.0.0.1]:1234")
