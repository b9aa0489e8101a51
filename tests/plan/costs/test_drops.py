"""The plan says why a node drops channels-last, in the coverage matrix's words.

Which nodes drop is checked against torch directly (each op fed a channels-last tensor); the
sentence is the coverage store's own ``explain`` for the aten op the audit recorder saw.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlayout
from memlayout.coverage.store import explain

CL = torch.channels_last


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cumsum(self.norm(self.conv(x)), dim=1)
        return self.head(torch.relu(y))


def _drops_by_torch() -> set[str]:
    """Node name -> does torch return another format when it is fed channels-last?"""
    x = torch.randn(1, 8, 10, 10).contiguous(memory_format=CL)
    ops = {"norm": nn.GroupNorm(2, 8), "cumsum": lambda t: torch.cumsum(t, dim=1),
           "relu": torch.relu}
    return {name: not fn(x).is_contiguous(memory_format=CL) for name, fn in ops.items()}


@pytest.fixture()
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_dropping_nodes_are_those_torch_drops_and_notes_name_the_aten_op(empty_cache):
    opt = memlayout.optimize(Net(), torch.randn(1, 3, 12, 12), measure=False)
    noted = {n.name for n in opt.plan.nodes if n.drops}
    expected = {name for name, drops in _drops_by_torch().items() if drops}
    assert "cumsum" in expected  # the test needs at least one dropping op on this build
    assert noted == expected & {n.name for n in opt.plan.nodes}
    (note,) = next(n.drops for n in opt.plan.nodes if n.name == "cumsum")
    assert note.startswith("aten.cumsum") and "no cached coverage matrix" in note


def test_notes_quote_the_cached_coverage_matrix(empty_cache):
    from memlayout.coverage import CoverageConfig, run_coverage
    from memlayout.coverage.store import save_to_cache
    from memlayout.errors import CoverageUnavailableError

    try:
        (report,) = run_coverage(CoverageConfig(ops="cumsum", jobs=0, max_samples=3),
                                 command="pytest")
    except CoverageUnavailableError as exc:
        pytest.skip(f"OpInfo unavailable on this torch build: {exc}")
    save_to_cache(report)
    sentence = explain("aten.cumsum", "cpu", "float32", "channels_last")
    assert sentence is not None and "drops" in sentence
    opt = memlayout.optimize(Net(), torch.randn(1, 3, 12, 12), measure=False)
    assert next(n.drops for n in opt.plan.nodes if n.name == "cumsum") == [sentence]
    assert sentence in opt.plan.summary()
    again = memlayout.Plan.from_json(opt.plan.to_json())
    assert again.nodes == opt.plan.nodes
