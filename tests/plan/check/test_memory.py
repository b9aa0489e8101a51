"""Peak activation memory (plan/memory.py): the tensor-lifetime count against hand-computed
peaks, the plan's report against a second measurement, and plans within a memory budget."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from memlayout.bench.unets import unet_small
from memlayout.errors import PlanError
from memlayout.plan.candidates import padding as padding_mod
from memlayout.plan.check.memory import peak_memory
from memlayout.plan.options import budget_bytes
from memlayout.plan.pipeline import optimize
from memlayout.plan.report.plan import Plan
from tests.support.machine import AVX512, as_cpu

# Padded plans are the largest, and which exist is the CPU's vector width: `make test` runs
# these again under ATEN_CPU_CAPABILITY=avx2.
pytestmark = pytest.mark.isa


def _nbytes(*shape: int) -> int:
    n = 4  # float32
    for s in shape:
        n *= s
    return n


def test_a_chain_of_convolutions_peaks_at_the_largest_neighbouring_pair() -> None:
    channels = [3, 8, 16, 4, 12]
    pairs = zip(channels, channels[1:], strict=False)
    net = nn.Sequential(*[nn.Conv2d(a, b, 3, padding=1) for a, b in pairs])
    x = torch.randn(2, 3, 10, 10)
    sizes = [_nbytes(2, c, 10, 10) for c in channels[1:]]
    # Sequential drops its reference to an activation once the next one exists; the input
    # existed before the call and is not counted.
    expected = max([sizes[0]] + [a + b for a, b in zip(sizes, sizes[1:], strict=False)])
    got = peak_memory(net.eval(), (x,))
    assert got.peak_bytes == expected
    assert got.end_bytes == sizes[-1]  # the output is still held


class Branch(nn.Module):
    """y and z both live when their sum is made; views and in-place ops allocate nothing; a
    channels-last copy does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 6, 1)
        self.b = nn.Conv2d(6, 6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = torch.relu_(self.b(y)).view(y.shape)
        s = y + z
        return s.contiguous(memory_format=torch.channels_last)


def test_views_and_in_place_ops_add_nothing_copies_do() -> None:
    x = torch.randn(1, 3, 5, 7)
    one = _nbytes(1, 6, 5, 7)
    got = peak_memory(Branch().eval(), (x,))
    # y, z, s live together; then s and its channels-last copy (y, z still referenced by the
    # frame until return): y + z + s + copy
    assert got.peak_bytes == 4 * one
    assert got.end_bytes == one


def test_the_plan_reports_the_peaks_of_the_models_it_compares() -> None:
    net, x = unet_small()
    opt = optimize(net, x, measure=False)
    m = opt.plan.memory
    assert m.method == "tensor_lifetime"
    assert opt.plan.conversions  # a plan that converts: the planned model holds copies
    # the peaks are those of the original and of the model returned, measured after planning
    assert m.original == peak_memory(net, (x,)).peak_bytes
    assert m.planned == peak_memory(opt, (x,)).peak_bytes
    # and the only memory a plan adds is its conversions' copies (activations are the same
    # size in either format)
    assert m.original <= m.planned <= m.original + opt.plan.conversion_bytes
    assert "peak activation memory" in opt.plan.summary()


def test_plan_json_without_the_new_fields_still_loads() -> None:
    p = Plan(model="m", device="cpu", torch_version="2", dtype=None, input_format=None,
             output_format="keep", nodes=[], conversions=[], predicted={})
    data = json.loads(p.to_json())
    for key in ("padding", "memory", "blocked"):
        data.pop(key)
    assert Plan.from_json(json.dumps(data)) == p


def _pad_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every convolution that can be padded is, whatever was measured: a plan that allocates
    more than the unpadded one."""
    monkeypatch.setattr(padding_mod, "decide",
                        lambda seconds, race, margin: next(n for n in seconds if n != "unpadded"))
    monkeypatch.setattr(padding_mod, "whole_model_ratio", lambda *args, **kwargs: 2.0)


def _plan_all_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver labels every unpinned node channels-last: the same plan whatever the noisy
    measurements say (which labels a plan gets decides where its peak falls)."""
    from memlayout.plan.solve import regions as solve_regions
    from memlayout.plan.solve.mincut import Solution

    real = solve_regions.solve_min_cut
    monkeypatch.setattr(solve_regions, "solve_min_cut", lambda problem: Solution(
        {k: problem.pins.get(k, 1) for k in real(problem).labels}, 0))


def test_a_budget_below_the_fastest_plans_peak_is_respected(tmp_path, monkeypatch) -> None:
    _plan_all_channels_last(monkeypatch)
    # blocks of 16 pad unet_small's 8-channel convolutions (with AVX2's 8 only its input
    # convolution pads, and that copy does not raise the peak)
    as_cpu(monkeypatch, AVX512)
    assert padding_mod.block_sizes("cpu", None) == (16, 8)
    net, x = unet_small()
    options = dict(cache=tmp_path / "c.sqlite", guard=False, rounds=1, blocked=False)
    plain = optimize(net, x, padding=False, **options).plan.memory.planned
    _pad_everything(monkeypatch)
    fastest = optimize(net, x, **options)
    padded = fastest.plan.memory.planned
    assert any(p.chosen != "unpadded" for p in fastest.plan.padding)
    assert padded > plain  # the padded copies are what makes it bigger
    budget = padded - 1
    within = optimize(net, x, memory_budget=budget, **options)
    m = within.plan.memory
    assert m.budget == budget and m.planned <= budget
    assert peak_memory(within, (x,)).peak_bytes <= budget  # measured again
    assert m.chosen != fastest.plan.memory.chosen
    assert padded in [c.peak for c in m.candidates.values()]
    assert within.plan.verification.ok
    torch.testing.assert_close(within(x), net(x), rtol=1e-4, atol=1e-5)


def test_a_budget_nothing_fits_names_the_smallest_peak(tmp_path) -> None:
    net, x = unet_small()
    with pytest.raises(PlanError, match="smallest peak found is") as info:
        optimize(net, x, measure=False, memory_budget=1000)
    smallest = int(str(info.value).split("smallest peak found is ")[1].split()[0])
    plain = optimize(net, x, measure=False)
    assert 1000 < smallest <= plain.plan.memory.planned


@pytest.mark.parametrize("bad", [0, -5, "lots", "12XB", True])
def test_bad_budgets_are_refused(bad) -> None:
    with pytest.raises(PlanError, match="memory_budget"):
        budget_bytes(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peaks_come_from_the_allocator() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)).cuda().eval()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    got = peak_memory(net, (x,))
    assert got.method == "cuda_allocator"
    assert got.peak_bytes >= 2 * _nbytes(2, 8, 32, 32)  # both activations live at the second conv


def test_a_gpus_peaks_come_from_its_allocator_through_the_device_seam(monkeypatch) -> None:
    """The CUDA path run here (the seam's fake GPU): the allocator's counters around the
    forward, not the tensor-lifetime count."""
    from tests.support.fake_cuda import fake_gpu

    gpu = fake_gpu(monkeypatch)
    gpu.allocated = 1000
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1)).eval()

    def allocate(*_):
        gpu.peak, gpu.allocated = 1000 + 5000, 1000 + 2048
    net.register_forward_hook(allocate)
    got = peak_memory(net, (torch.randn(2, 3, 8, 8),))
    assert (got.method, got.peak_bytes, got.end_bytes) == ("cuda_allocator", 5000, 2048)
    assert gpu.cuda.called("reset_peak_memory_stats") == [((0,), {})]


def test_a_second_plan_reads_memory_padding_and_mkldnn_records_from_the_cache(
        tmp_path, monkeypatch) -> None:
    from memlayout.plan.candidates import blocked
    from memlayout.plan.check import memory

    net, x = unet_small()
    options = dict(cache=tmp_path / "c.sqlite", guard=False, rounds=1, blocked=True)
    first = optimize(net, x, **options).plan

    def no_run(*args, **kwargs):
        raise AssertionError("ran a forward although everything was cached")

    for module, name in ((memory, "peak_memory"), (padding_mod, "first_inputs"),
                         (blocked, "first_inputs")):
        monkeypatch.setattr(module, name, no_run)
    second = optimize(net, x, **options).plan
    assert second.memory == first.memory
    assert [(p.module, p.chosen) for p in second.padding] == \
        [(p.module, p.chosen) for p in first.padding]
    assert [c.ratio for c in second.blocked.chains] == \
        [c.ratio for c in first.blocked.chains]
