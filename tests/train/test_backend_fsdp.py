"""The memlayout ``torch.compile`` backend under FSDP2: each ``fully_shard``-ed block compiled
on its own (the all-gathers and FSDP's hooks run between the blocks, outside their graphs),
every block's graph planned, compiled with the plan standing and verified, with no warning;
rank 0 measures and decides each graph and rank 1 compiles the same plan, measuring nothing;
three SGD steps leave the parameters that the same job compiled by Inductor leaves, within
the tolerance that job has against eager.

The model is the quick zoo's ``squeezenet1_1`` at 32x32: its Fire modules are FSDP's blocks.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import memlayout
from memlayout.models import load_model
from memlayout.plan.compilers.backend_graphs import fsdp_managed
from memlayout.train import make_synthetic
from memlayout.train.compiling import compile_blocks
from memlayout.train.fsdp import fsdp_available, wrap_fsdp
from tests.support.torchrun import LAYOUT_WARNINGS, run_worker, torchrun

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(fsdp_available() is not None, reason=str(fsdp_available()))]

MODEL, SIZE = "torchvision:squeezenet1_1", 32


def job(backend: Any) -> dict[str, Any]:
    """Three SGD steps of the model, each block compiled with ``backend`` (``None``: eager)
    and sharded by FSDP2 as ``memlayout train --strategy fsdp --compile`` does, a batch of
    its own per rank: the parameters after them (gathered whole) and the warnings."""
    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    model = load_model(MODEL, batch=2, image_size=SIZE, seed=0).module.train()
    if backend is not None:
        compile_blocks(model, backend)
    wrap_fsdp(model, per_block=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    torch.manual_seed(0)  # the classifier's dropout: the same masks in every job
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(2, 3, SIZE, SIZE, generator=data).contiguous(
                memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (2,), generator=data)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    return {"state": state, "warnings": [(w.category, str(w.message)) for w in caught]}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("sharded", [True, False])
def test_a_graph_of_a_module_fsdp_manages_is_known_as_one(one_member_group, sharded):
    from torch.distributed.fsdp import fully_shard

    seen: list[bool] = []

    def spy(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(fsdp_managed(gm))
        return gm.forward

    block = Block()
    if sharded:
        fully_shard(block)
    block.compile(backend=spy)
    block(torch.randn(1, 3, 8, 8)).sum().backward()
    assert seen == [sharded]


WORKER = '''
import torch, torch.distributed as dist
import memlayout
from memlayout.plan.compilers.backend import BackendWarning
from tests.support.torchrun import LAYOUT_WARNINGS, finish_rank, graph_record
from memlayout.models import load_model
from tests.train.test_backend_fsdp import MODEL, SIZE, job

dist.init_process_group("gloo")
# measured (no cache: every cost timed), on rank 0 alone
planned = job(memlayout.backend(rounds=1, guard=False, cache=False))
records = memlayout.backend_report().graphs
report = str(memlayout.backend_report())
inductor = job("inductor")
eager = job(None)
start = load_model(MODEL, batch=2, image_size=SIZE, seed=0).module.state_dict()

def close(a, b):
    return all(torch.allclose(a["state"][k], v, rtol=1e-4, atol=1e-5)
               for k, v in b["state"].items())

out = {"backend_warnings": [m for c, m in planned["warnings"] if issubclass(c, BackendWarning)],
       "layout_warnings": [m for _, m in planned["warnings"]
                           if any(t in m for t in LAYOUT_WARNINGS)],
       "graphs": [graph_record(r) for r in records], "report": report, "trained": any(not torch.equal(v, start[k])
                                        for k, v in planned["state"].items()),
       "close": close(planned, inductor), "inductor_vs_eager": close(inductor, eager)}
finish_rank(out)
'''


def test_two_ranks_plan_every_fsdp_block_once_and_train_as_inductor(tmp_path):
    log, (zero, one) = run_worker(WORKER, tmp_path)
    assert "Grad strides do not match bucket view strides" not in log
    for r in (zero, one):
        assert r["backend_warnings"] == [] and r["layout_warnings"] == []
    # a graph per Fire module (Dynamo runs a lone convolution's block eagerly), none of
    # FSDP's all-gathers inside
    assert len(zero["graphs"]) == len(one["graphs"]) >= 8, zero["report"]
    for g0, g1 in zip(zero["graphs"], one["graphs"], strict=True):
        assert g0["planned"] and not g0["fallback"] and g0["ran"] == g1["ran"], g0
        assert g0["verification"].startswith("the plan compiled vs the graph eagerly"), g0
        assert (g0["rank"], g0["decided_by"], g1["rank"], g1["decided_by"]) == (0, 0, 1, 0)
        assert g0["digest"] == g1["digest"] != ""  # one program on both ranks
        assert g0["convolutions"] == g1["convolutions"]
        assert g0["measured"] > 0  # rank 0 timed the costs ...
        assert g1["measured"] == g1["cached"] == 0  # ... rank 1 took them from the exchange
        assert f"rank 1: plan {g1['digest']}, decided by rank 0" in one["report"]
        assert f"rank 0: plan {g0['digest']}, decided here" in zero["report"]
    for r in (zero, one):
        assert r["trained"]
        # the control: Inductor's job against eager, within the tolerance checked below
        assert r["inductor_vs_eager"]
        assert r["close"]  # the planned job against Inductor's, gradients reduced over ranks


# a block of the user's own class: Dynamo compiles it (a lone torch layer it runs eagerly)
BLOCKS = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.conv1(x).relu())


def blocks():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sequential(Block(8), Block(8)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
'''


def test_memlayout_train_fsdp_compiles_each_block_with_one_plan_per_job(tmp_path):
    (tmp_path / "user_blocks.py").write_text(BLOCKS)
    make_synthetic(tmp_path / "data", 8, classes=4, size=16)
    res = torchrun("-m", "memlayout.cli", "train", f"{tmp_path / 'user_blocks.py'}:blocks",
                   "--strategy", "fsdp", "--compile", "backend", "--layout", "nhwc",
                   "--data", str(tmp_path / "data"), "--image-size", "16", "--batch", "2",
                   "--max-steps", "2", "--log-every", "1", cwd=tmp_path,
                   env={"MEMLAYOUT_CACHE_DIR": str(tmp_path / "cache")})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    out = " ".join(res.stdout.split())
    # the two blocks share one graph; FSDP's all-gathers between them break no graph
    timed = re.search(r"memlayout backend: 1 graph, decided by rank 0 \((\d+) costs timed "
                      r"there, 0 on the other ranks\); every rank runs the same plan", out)
    assert timed and int(timed.group(1)) > 0, out[-2000:]
    assert "BackendWarning" not in log and not any(t in log for t in LAYOUT_WARNINGS)
