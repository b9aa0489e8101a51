"""torch.compile and the planner: ``torch.compile(optimize(...))``, ``memlayout.compile``.

Compiles are slow on this machine: tiny models only, and each test compiles at most twice.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memlayout
from memlayout.plan.compilers import compiled as c
from memlayout.plan.report.plan import Plan
from memlayout.timing import Race, Ratio

# Peer runtimes (OpenVINO, ONNX Runtime, mkldnn) are built in this process: `make test` runs
# these tests in a pytest process of their own (see the Makefile).
pytestmark = pytest.mark.runtimes

# the memory / padding / blocked reports: slow here, not what these tests are about
QUICK = {"memory": False, "padding": False, "blocked": False}


def _cnn() -> nn.Module:
    # few ops: every distinct graph costs a C++ compile, slow on a loaded machine
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()


def test_torch_compile_of_an_optimized_module_computes_what_the_original_does():
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    opt = memlayout.optimize(net, x, measure=False, **QUICK)
    compiled = torch.compile(opt)
    with torch.no_grad():
        want, got = net(x), compiled(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # another batch size: dynamo recompiles; the example's plan serves it, nothing is planned
    # inside the compiled region
    x3 = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x3), net(x3), rtol=1e-4, atol=1e-5)
    assert opt.memlayout.replans == 0


def test_inductor_decision_is_what_its_config_says():
    """On CPU with mkldnn, Inductor's layout optimization is on for any graph with a 2-d
    convolution (it then requires channels-last for each); switched off in the config, it is
    off: the switch memlayout.compile uses to let the plan stand."""
    import pytest
    import torch._inductor.config as inductor_config

    net, x = _cnn(), (torch.randn(2, 3, 16, 16),)
    decision = c.inductor_layout_decision(net, x)
    if decision is None:
        pytest.skip("this torch has no GraphLowering.decide_layout_opt to ask")
    if torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
        assert decision is True
    with inductor_config.patch(layout_optimization=False):
        assert c.inductor_layout_decision(net, x) is False
    no_conv = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 4)).eval()
    assert c.inductor_layout_decision(no_conv, x) is False


def test_memlayout_compile_keeps_a_measured_candidate_equal_to_the_original(tmp_path):
    net, x = _cnn(), torch.randn(2, 3, 16, 16)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    fast = memlayout.compile(net, x, cache=tmp_path / "costs.sqlite", rounds=2,
                             plan_kwargs=QUICK, runtimes=())
    record = fast.plan.compiled
    assert record.kept in (c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN)
    assert record.source == "measured", record
    assert set(record.candidates) == {c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN}, record.errors
    assert set(record.compile_seconds) == {c.Runner.PLAN_COMPILED, c.Runner.INDUCTOR_OWN, c.Runner.INDUCTOR_FROZEN}, record.errors
    assert record.settings[c.Runner.PLAN_COMPILED] == {"layout_optimization": False}
    assert record.settings[c.Runner.INDUCTOR_FROZEN] == {"freezing": True}
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-5)
    # compiled in place: the original's state_dict keys, values untouched
    assert list(fast.state_dict()) == list(net.state_dict())
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    # the record round-trips and is shown
    assert Plan.from_json(fast.plan.to_json()).compiled == record
    assert "compile: kept" in fast.plan.summary()

    # a second compile of the same model reads the decision from the cache: one compile
    again = memlayout.compile(net, x, cache=tmp_path / "costs.sqlite", rounds=2,
                              plan_kwargs=QUICK, runtimes=())
    assert again.plan.compiled.source == "cache"
    assert again.plan.compiled.kept == record.kept
    assert list(again.plan.compiled.compile_seconds) == [record.kept]


def test_a_frozen_winner_follows_weights_loaded_after_the_compile(monkeypatch):
    """Inductor's freezing makes the weights constants of the compiled graph: a state dict
    loaded afterwards must still reach the outputs (not the weights frozen at compile time)."""
    net, x = _cnn(), torch.randn(2, 3, 16, 16)

    def frozen_fastest(models, inputs, dtype, *, device, rounds, **_):
        fast = {c.Runner.INDUCTOR_FROZEN: 2.0}  # planned / candidate time: freezing twice as fast
        return Race(c.Runner.PLAN_COMPILED, {n: Ratio(c.Runner.PLAN_COMPILED, n, fast.get(n, 1.0),
                                         (fast.get(n, 1.0),) * rounds)
                                for n in models if n != c.Runner.PLAN_COMPILED}, rounds=rounds)
    monkeypatch.setattr(c, "time_candidates", frozen_fastest)
    fast = memlayout.compile(net, x, cache=False, rounds=2, guard=False, plan_kwargs=QUICK,
                             runtimes=())
    assert fast.plan.compiled.kept == c.Runner.INDUCTOR_FROZEN
    other = _cnn()
    fast.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), other(x), rtol=1e-4, atol=1e-5)
        assert not torch.allclose(fast(x), net(x))


def test_memlayout_compile_without_measuring_compiles_the_plan_only():
    net, x = _cnn(), torch.randn(1, 3, 12, 12)
    fast = memlayout.compile(net, x, measure=False, plan_kwargs=QUICK)
    assert fast.plan.compiled.kept == c.Runner.PLAN_COMPILED
    assert list(fast.plan.compiled.compile_seconds) == [c.Runner.PLAN_COMPILED]
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-5)


def test_a_backend_other_than_inductor_compiles_the_plan_as_asked():
    net, x = _cnn(), torch.randn(1, 3, 12, 12)
    fast = memlayout.compile(net, x, measure=False, backend="eager", plan_kwargs=QUICK)
    assert fast.plan.compiled.kept == c.Runner.PLAN_COMPILED
    assert fast.plan.compiled.backend == "eager"
    with torch.no_grad():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-4, atol=1e-5)


def test_old_plan_json_without_the_new_fields_still_loads():
    p = Plan(model="m", device="cpu", torch_version="2", dtype=None, input_format=None,
             output_format="keep", nodes=[], conversions=[], predicted={})
    data = __import__("json").loads(p.to_json())
    del data["compiled"], data["notes"]
    old = Plan.from_json(__import__("json").dumps(data))
    assert old.compiled is None and old.notes == []


def test_a_candidate_rounding_otherwise_is_kept_by_the_float64_recheck():
    """Under TF32 the original's own fp32 result is ~1e-3 from the exact one, and a candidate
    rounding otherwise (NHWC kernels) another ~1e-3: apart by more than fp32's tolerance,
    yet no farther from the float64 result than the original. A wrong one is farther."""
    from memlayout.plan.compare import compare, float64
    from memlayout.plan.compilers.runtime_model import Reference

    net, x = _cnn().eval(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        exact = float64(net)(*float64((x,))).float()
    scale = exact.abs().max()
    signs = torch.randn_like(exact).sign()
    own, other = exact + 6e-4 * scale * signs, exact - 6e-4 * scale * signs
    reference = Reference(own, net, (x,))
    assert not compare(own, other, None)[0]  # the plain check alone drops it
    assert reference.agrees(other, None)[0]
    assert not reference.agrees(exact + 5e-3 * scale * signs, None)[0]
