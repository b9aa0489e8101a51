"""``torch.compile(model, backend="memlayout")``: every Dynamo graph planned, compiled with the
plan standing, verified, reported.

Compiles are slow on this machine: tiny models, ``inner="eager"`` wherever Inductor is not
what a test is about, and at most one Inductor compile per test. Costs a test depends on are
injected through the cost cache (a first run measures, then the channels-last time of every
convolution is scaled), so no expectation depends on this machine's speed.
"""

from __future__ import annotations

import copy
import json
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
import torchvision
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

import memlayout
from memlayout.errors import PlanError
from memlayout.plan.check import guard
from memlayout.plan.compilers import backend as b
from memlayout.plan.compilers import backend_check, backend_inner, backend_plan, backend_report
from memlayout.plan.compilers.compiled import inductor_layout_decision
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.runners import Runner
from memlayout.timing import KEEP_MARGIN
from tests.support.machine import fake_guard_clock


class Broken(nn.Module):
    """Two convolution blocks with a graph break between them (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if x.amax() > -1e9:  # always true; Dynamo cannot know: a graph break
            x = self.body(x)
        return self.head(x.mean((2, 3)))


def _plain() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                         nn.ReLU())


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _raced(call: Callable[[], Any], limit: int = 60) -> int:
    """Make ``call`` (a call of a compiled model: in training a step, forward and backward)
    until no graph's guard races on its calls any more; how many calls that took."""
    for made in range(limit):
        if not any(g.racing for g in memlayout.backend_report().graphs):
            return made
        call()
    raise AssertionError(f"a race on the graph's calls did not end in {limit} calls")


def _gain_clock(fastest: str) -> Callable[[str, int], float]:
    """A fake clock's seconds per call of each way to run the one graph compiled, in units of
    what its convolutions save in the plan's formats by their costs
    (``backend_plan.convolution_gain``): one for ``fastest``, two for the others."""
    def seconds(name: str, _i: int) -> float:
        (graph,) = memlayout.backend_report().graphs
        gain = backend_plan.convolution_gain(graph.convolutions)
        assert gain is not None and gain > 0
        return gain * (1.0 if name == fastest else 2.0)
    return seconds


def _scale_channels_last(cache: str, factor: float) -> int:
    """Every cached convolution's channels-last seconds made ``factor`` times the slowest
    contiguous convolution's (``factor`` >= 1) or the fastest's (< 1): each convolution is
    then slower (faster) channels-last by ``factor`` at least, whatever noise its measured
    times had. How many changed."""
    db = sqlite3.connect(cache)
    rows = [(key, fingerprint, json.loads(value)) for key, fingerprint, value in db.execute(
        "SELECT key, fingerprint, value FROM entries WHERE kind = 'node'")
        if "conv2d" in key and json.loads(value)["s"] is not None]
    contiguous = [record["s"] for key, _, record in rows if json.loads(key)[-1] == 0]
    seconds = factor * (max(contiguous) if factor >= 1 else min(contiguous))
    changed = 0
    for key, fingerprint, record in rows:
        if json.loads(key)[-1] == 1:
            db.execute("UPDATE entries SET value = ? WHERE key = ? AND fingerprint = ?",
                       (json.dumps({**record, "s": seconds}), key, fingerprint))
            changed += 1
    db.commit()
    db.close()
    return changed


def _measure_into(cache: str, model: nn.Module, x: torch.Tensor, *, train: bool) -> None:
    """Run the backend once on ``model`` (eagerly) so its costs land in ``cache``; its
    verification verdict is removed, so the test's own compile verifies its plan."""
    work = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=cache, inner="eager", guard=False, rounds=1))
    with torch.set_grad_enabled(train):
        work(x)
    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    db = sqlite3.connect(cache)
    with db:
        assert db.execute("DELETE FROM entries WHERE kind = 'backend-verified'").rowcount >= 1
    db.close()


def test_the_entry_point_registers_the_backend_and_bad_options_say_what_to_do():
    assert "memlayout" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("memlayout") is b.memlayout_backend
    with pytest.raises(PlanError, match="inner='tvm'.*inductor, eager"):
        memlayout.backend(inner="tvm")
    with pytest.raises(PlanError, match="rounds=0"):
        memlayout.backend(rounds=0)
    gm = torch.fx.symbolic_trace(_plain())
    with pytest.raises(PlanError, match=r"options \['speed'\] are neither memlayout's"):
        memlayout.backend()(gm, [torch.randn(1, 3, 8, 8)], options={"speed": 1})


def test_inductor_options_and_mode_reach_inductor_and_key_the_guard(monkeypatch):
    """``torch.compile(..., options=...)``: memlayout's own options set the backend, the
    rest are Inductor's and reach every compile_fx call (the plan's own patches win); the
    mode and those options are part of the guard's key."""
    seen = {}
    monkeypatch.setattr(b, "compile_graph", lambda gm, xs, chosen: seen.setdefault("b", chosen))
    gm = torch.fx.symbolic_trace(_plain())
    memlayout.backend()(gm, [torch.randn(1, 3, 8, 8)], mode="max-autotune",
                        options={"rounds": 2, "epilogue_fusion": False,
                                 "layout_optimization": True})
    chosen = seen["b"]
    assert chosen.rounds == 2 and chosen.mode == "max-autotune"
    assert dict(chosen.inductor) == {"epilogue_fusion": False, "layout_optimization": True}
    from torch._inductor import compile_fx as fx_module

    patches = {}
    monkeypatch.setattr(fx_module, "compile_fx",
                        lambda g, xs, config_patches=None: patches.update(config_patches or {}))
    backend_inner.inner_compile(gm, [torch.randn(1, 3, 8, 8)], chosen, None, torch.device("cpu"))
    assert patches["epilogue_fusion"] is False and patches["max_autotune"] is True
    assert patches["layout_optimization"] is False  # the plan stands whatever was asked
    keys = {backend_check.guard_key(["planned"], gm, [torch.randn(1, 3, 8, 8)], train=False,
                                     dtype=None, device=torch.device("cpu"),
                                     compiled_as=options.compiled_as)
            for options in (chosen, b.Backend(), b.Backend(mode="reduce-overhead"))}
    assert len(keys) == 3


def test_the_guards_training_step_hands_parameters_over_as_they_are():
    """Lifted parameters reach the timed step as the same tensors every call (CUDA graphs
    keep their addresses); an input that needs a gradient is cloned per call."""
    weight = nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    seen = []

    def graph(w, v):
        seen.append((w.data_ptr(), v.data_ptr()))
        return (w * v,)

    step = backend_check._timed_step(graph, [weight, x], True, None, torch.device("cpu"))
    step()
    step()
    (w1, v1), (w2, v2) = seen
    assert w1 == w2 and v1 != v2


def test_eager_inner_plans_every_subgraph_and_trains_as_the_model_does(tmp_path):
    model, x = Broken(), torch.randn(4, 3, 16, 16)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(ours, backend=memlayout.backend(
        cache=str(tmp_path / "costs.sqlite"), inner="eager", rounds=1))
    # the same dropout mask from the same seed: compiling (Dynamo, the backend's planning)
    # leaves the caller's RNG as it was
    torch.manual_seed(1)
    out, grads = _train_step(compiled, x)
    torch.manual_seed(1)
    want, want_grads = _train_step(theirs, x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ours.stem[1].running_mean, theirs.stem[1].running_mean)
    graphs = memlayout.backend_report().graphs
    # the graph with the dropout is checked with it off (its mask depends on the layout)
    assert any("dropout off" in g.verification for g in graphs)
    assert len(graphs) >= 2  # the graph break: each side planned on its own
    convolutions = [c for g in graphs for c in g.convolutions]
    assert {c.where for c in convolutions} == {"stem.0", "body.0"}
    assert all(g.train and g.planned and g.ran == Runner.PLAN_EAGER and g.verification
               for g in graphs
               if g.convolutions)
    # inference under bf16 autocast: recompiled (Dynamo's guard), planned for bf16
    ours.eval()
    theirs.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        got, want = compiled(x), theirs(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=1e-2)
    infer = [g for g in memlayout.backend_report().graphs if not g.train and g.convolutions]
    assert infer and all(g.dtype == "bf16" for g in infer)


class Random(nn.Module):
    """Stochastic depth (a ``bernoulli_`` draw per sample, as torchvision's EfficientNet
    does), and, with ``noisy``, noise drawn like the activation (``rand_like``: in memory
    order, so its values depend on the layout), between two convolutions (both planned
    channels-last, what lies between them is too)."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.noisy = noisy
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.depth = torchvision.ops.StochasticDepth(0.5, "row")
        self.out = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = y + self.depth(y)
        return self.out(y + torch.rand_like(y) if self.noisy else y)


@pytest.mark.parametrize("noisy", [False, True])
def test_a_graph_that_draws_random_numbers_is_compared_from_one_seed(tmp_path, noisy):
    """Stochastic depth draws the same from the same seed in either layout: the training
    graph is verified, gradients included. Noise drawn like a channels-last activation does
    not: that graph is not compared, and the report says so (rather than claiming it)."""
    model, x = Random(noisy).train(), torch.randn(4, 3, 8, 8)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=True)
    assert _scale_channels_last(cache, 0.02) == 2  # the convolutions want channels-last
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=cache, inner="eager", guard=False))
    compiled(x).sum().backward()
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and not graph.fallback
    assert [c.planned for c in graph.convolutions] == ["channels_last"] * 2
    if noisy:
        assert graph.verification.startswith("not compared") and graph.max_error is None
    else:
        assert graph.verification.endswith("from one random seed") and graph.max_error < 1e-3
    assert graph.verification in memlayout.backend_report().render()


class _Pairs(nn.Module):
    """Sums neighbouring pairs: a reshape whose ``-1`` a trace in the shape env guards on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, 2).sum(-1)


class _Calls(nn.Module):
    """Counts its calls in a buffer, written in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x.relu()


@pytest.mark.parametrize("tail", ["pairs", "calls", "batch_norm"])
def test_asking_inductors_rule_adds_no_guard_and_writes_nothing_of_dynamos(monkeypatch, tail):
    """Asked of a dynamic graph, the rule answers, adds no guard to Dynamo's shape env (the
    graph's recompiles stay Dynamo's; a reshape's ``-1`` would add some) and leaves Dynamo's
    example inputs untouched by what the graph writes in place (a buffer, batch norm's
    running statistics). Most graphs trace in Dynamo's own fake mode; a training batch norm
    reads its momentum as a value there (a float Dynamo passes as a tensor), so it is traced
    on real inputs instead."""
    from torch._guards import detect_fake_mode

    last = {"pairs": _Pairs, "calls": _Calls, "batch_norm": lambda: nn.BatchNorm2d(8)}[tail]
    model, asked, real_traces = nn.Sequential(nn.Conv2d(3, 8, 3), last()).train(), [], []
    on_real = backend_plan.on_real_inputs
    monkeypatch.setattr(backend_plan, "on_real_inputs",
                        lambda *a, **k: real_traces.append(1) or on_real(*a, **k))

    def state(example_inputs):
        env = detect_fake_mode(example_inputs).shape_env
        return len(env.guards), [x._version for x in example_inputs
                                 if isinstance(x, torch.Tensor)]

    def backend(gm, example_inputs):
        before = state(example_inputs)
        rule = b.inductor_rule(gm, example_inputs, dtype=None, train=True,
                               device=torch.device("cpu"))
        asked.append((rule, before, state(example_inputs)))
        return gm.forward

    torch.compile(model, dynamic=True, backend=backend)(torch.randn(2, 3, 9, 11))
    ((rule, before, after),) = asked
    assert rule is not None and before == after
    assert len(real_traces) == int(tail == "batch_norm")


def test_inductor_trains_with_a_plan_its_own_rule_would_not_choose(monkeypatch, tmp_path):
    """Convolutions made slow channels-last (the costs in the cache scaled) are planned
    contiguous; Inductor's rule on this CPU is channels-last. Inductor keeps the plan (its
    convolution kernel is fed contiguous inputs and weights), the report names each
    convolution with its measured times, and a training step equals the model's."""
    from torch._inductor import config as inductor_config
    from torch._inductor.select_algorithm import extern_kernels

    # what Inductor's code hands its convolution kernel, call by call (the code looks the
    # kernel up by name each call)
    fed: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = extern_kernels.convolution

    def convolution(x, weight, *args, **kwargs):
        fed.append((x, weight))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(extern_kernels, "convolution", convolution)
    model, x = _plain(), torch.randn(2, 3, 12, 12)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=True)
    assert _scale_channels_last(cache, 50.0) >= 2
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    # on its training steps, Inductor's own races the plan run eagerly, then the compiled
    # plan (made the fastest on a fake clock) is built on a later call and raced against the
    # way kept: each compiled and run for real, forward and backward
    fake_guard_clock(monkeypatch, _gain_clock(Runner.PLAN_COMPILED))
    compiled = torch.compile(ours, backend=memlayout.backend(cache=cache, rounds=1))
    out, grads = _train_step(compiled, x)
    want, want_grads = _train_step(theirs, x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    assert _raced(lambda: _train_step(compiled, x)) > 0  # on its training steps
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and graph.ran == Runner.PLAN_COMPILED
    assert graph.measured == 0 and graph.cached > 0
    # Inductor's rule asked a second way: of the whole model's aten graph (on a CPU with
    # mkldnn it is on for any graph with a 2-d convolution)
    rule = inductor_layout_decision(model, (x,))
    assert graph.inductor_rule == rule
    assert [c.where for c in graph.differing] == (["0", "2"] if rule else [])
    assert all(c.inductor == "channels_last" for c in graph.differing)
    assert all(c.planned == "contiguous" and c.timed and c.seconds[1] > 10 * c.seconds[0]
               for c in graph.convolutions)
    assert {how for how, _ in graph.timed} == {Runner.PLAN_COMPILED}
    assert graph.later_seconds > 0 and "built on a later call" in graph.plan_later
    assert "measured" in memlayout.backend_report().render()
    # both convolutions, at every call of the graph that runs
    fed.clear()
    compiled(x)
    assert len(fed) == 2 and all(t.is_contiguous() and w.is_contiguous() for t, w in fed)
    with inductor_config.patch(layout_optimization=False):  # the switch the plan relies on
        assert b.inductor_rule(torch.fx.symbolic_trace(model), [x], dtype=None, train=True,
                               device=x.device) is False
    assert b.inductor_rule(torch.fx.symbolic_trace(model), [x], dtype=None, train=True,
                           device=x.device) == rule


def test_the_report_names_the_weights_a_plan_converts_on_every_call(tmp_path):
    """Convolutions made fast channels-last (the cached costs scaled) are planned so. A
    model stored contiguous hands Dynamo its weights contiguous, and the plan converts them
    on every call: the report names them with their bytes. Stored channels-last, the same
    plan converts none."""
    cache = str(tmp_path / "costs.sqlite")
    x = torch.randn(2, 3, 12, 12)
    stored = {fmt: _plain().to(memory_format=fmt)
              for fmt in (torch.contiguous_format, torch.channels_last)}
    for model in stored.values():
        _measure_into(cache, model, x, train=True)
    assert _scale_channels_last(cache, 0.01) >= 2
    named = {}
    for fmt, model in stored.items():
        compiled = torch.compile(model, backend=memlayout.backend(cache=cache, inner="eager",
                                                                  rounds=1))
        _train_step(compiled, x)
        report = memlayout.backend_report(clear=True)
        (graph,) = report.graphs
        torch._dynamo.reset()
        assert [c.planned for c in graph.convolutions] == ["channels_last"] * 2
        params = dict(model.named_parameters())
        # what the model's own strides say a channels-last convolution has to convert
        want = {f"{c.where}.weight": params[f"{c.where}.weight"].nbytes
                for c in graph.convolutions
                if not params[f"{c.where}.weight"].is_contiguous(memory_format=torch.channels_last)}
        assert dict(graph.converted_weights) == want
        named[fmt] = want
        if want:
            assert f"{len(want)} of them weights" in graph.headline()
            assert "converted on every call and back" in graph.headline()
            assert ", ".join(sorted(want)) in report.render()
    assert set(named[torch.contiguous_format]) == {"0.weight", "2.weight"}
    assert named[torch.channels_last] == {}


def _spied_inner(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Inductor replaced by the graph run as it is (Inductor itself is not what the test is
    about); returns the config patches of every compile asked for, in order."""
    asked: list[dict] = []

    def inner(gm, example_inputs, options, dtype, device, patches=backend_inner.PLAN_STANDS,
              backward_now=True):
        asked.append(dict(patches))
        return gm.forward
    monkeypatch.setattr(backend_inner, "inner_compile", inner)
    return asked


def _planned_contiguous(monkeypatch: pytest.MonkeyPatch, tmp_path, *, rule: bool,
                        train: bool) -> tuple[nn.Module, torch.Tensor, str, list[dict]]:
    """``_plain()`` in ``train`` mode, its costs measured into a cache where channels-last
    convolutions are 50x slower (the plan puts them contiguous), Inductor's rule stated as
    ``rule`` and Inductor replaced as ``_spied_inner`` does: the model, its input, the
    cache and the compiles asked for."""
    monkeypatch.setattr(backend_plan, "inductor_rule", lambda *args, **kwargs: rule)
    model, x = _plain().train(train), torch.randn(2, 3, 12, 12)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=train)
    _scale_channels_last(cache, 50.0)
    return model, x, cache, _spied_inner(monkeypatch)


@pytest.mark.parametrize("fastest", [Runner.PLAN_COMPILED, Runner.PLAN_EAGER, Runner.INDUCTOR_OWN])
def test_the_guard_runs_the_fastest_way_and_makes_inductors_own_only_when_needed(
        monkeypatch, tmp_path, fastest):
    """Convolutions made slow channels-last (the cost cache scaled) are planned contiguous,
    where Inductor's rule (stated: on) puts them channels-last. The compiled plan is timed
    against the plan run eagerly and against Inductor's own layouts, on a fake clock where
    ``fastest`` takes half the time: that one runs, and the report gives the ratios. The plan
    that runs is verified, compiled or eagerly (other kernels), against one run of the graph;
    a second compile reads the decision and that verdict from the cache, times and verifies
    nothing, and builds only the way kept: the compiled plan, Inductor's own, or nothing
    compiled at all for the eager plan. (Raced before the first call returns; on the calls,
    the compiled plan waits: ``test_the_compiled_plan_is_built_on_a_later_call_...``.)
    Inductor's rule is asked once: later compiles of the graph read it from the
    cache, which each compile of the graph opens once, for all it reads and writes."""
    rules = []
    monkeypatch.setattr(backend_plan, "inductor_rule", lambda *args, **kwargs: rules.append(1) or True)
    model, x = _plain().eval(), torch.randn(2, 3, 12, 12)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=False)
    asked = _spied_inner(monkeypatch)
    assert _scale_channels_last(cache, 50.0) >= 2
    opened, cost_cache = [], backend_report.CostCache
    monkeypatch.setattr(backend_report, "CostCache", lambda *a, **k: opened.append(a) or cost_cache(*a, **k))
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == fastest else 1.0)
    steps, real_step = [], backend_check._step
    monkeypatch.setattr(backend_check, "_step", lambda fn, *a, **k: steps.append(fn)
                        or real_step(fn, *a, **k))
    for run in ("measured", "cached"):
        compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
            cache=cache, race_on_calls=False))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
            torch.testing.assert_close(compiled(x), model(x))
        report = memlayout.backend_report(clear=True)
        (graph,) = report.graphs
        assert graph.planned and len(graph.differing) == 2 and graph.ran == fastest
        assert not graph.racing and not graph.race_calls and not graph.plan_later
        # the price, by step: the guard (timing, and its compile of Inductor's own layouts:
        # what torch.compile alone spends on the graph) only where it ran
        assert (graph.own_compile_seconds is not None) == (graph.guard_seconds > 0) == (
            run == "measured")
        assert 0 <= graph.verify_seconds + graph.guard_seconds <= graph.compile_seconds
        assert ("torch.compile alone" in report.price()) == (run == "measured")
        assert report.render().splitlines()[1] == report.price()
        timed = dict(graph.timed)
        assert set(timed) == {Runner.PLAN_EAGER, Runner.INDUCTOR_OWN}
        for how, ratio in timed.items():  # the compiled plan's time over that way's
            assert ratio == pytest.approx(2.0 if how == fastest else
                                          (0.5 if fastest == Runner.PLAN_COMPILED else 1.0))
        built = {Runner.PLAN_COMPILED: [backend_inner.PLAN_STANDS], Runner.PLAN_EAGER: [],
                 Runner.INDUCTOR_OWN: [{}]}[fastest]
        assert asked == ([backend_inner.PLAN_STANDS, {}] if run == "measured" else built)
        # the graph once and the compiled plan; the eager plan where the guard kept it
        assert len(steps) == (0 if run == "cached" else 3 if fastest == Runner.PLAN_EAGER else 2)
        if fastest != Runner.INDUCTOR_OWN:  # verified by the first compile, read by the second
            assert ("verified before" in graph.verification) == (run == "cached")
            assert ("the plan compiled" in graph.verification) == (fastest == Runner.PLAN_COMPILED)
        assert len(opened) == 1
        asked.clear()
        steps.clear()
        opened.clear()
        torch._dynamo.reset()
        monkeypatch.setattr(guard, "interleaved", _no_timing)
    assert len(rules) == 1


@pytest.mark.parametrize("fastest", [Runner.PLAN_COMPILED, Runner.PLAN_EAGER, Runner.INDUCTOR_OWN])
def test_the_compiled_plan_is_built_on_a_later_call_only_where_it_can_win(
        monkeypatch, tmp_path, fastest):
    """The same graph, raced on its calls: Inductor's own (compiled as torch.compile
    compiles it) races the plan run eagerly (verified) first; the compiled plan is not built
    before the first call returns. When that race ends, the compiled plan is built only where,
    at best (Inductor's own time less what the convolutions save by their costs, ``gain``),
    it beats the way kept by more than the margin; then the next call compiles and verifies
    it, and the calls after race it against that way. On a fake clock in units of ``gain``,
    ``fastest`` takes one, the others two: the compiled plan, built, wins its race; the eager
    plan, kept at one, leaves the compiled plan no win (at best 2 - 1) and it is never
    compiled; Inductor's own, kept at one, leaves it one (at best 1 - 1), so it is built, and
    loses. A second compile reads both races from the cache and builds only the way kept."""
    monkeypatch.setattr(backend_plan, "inductor_rule", lambda *args, **kwargs: True)
    model, x = _plain().eval(), torch.randn(2, 3, 12, 12)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=False)
    asked = _spied_inner(monkeypatch)
    assert _scale_channels_last(cache, 50.0) >= 2

    fake_guard_clock(monkeypatch, _gain_clock(fastest))
    built = fastest != Runner.PLAN_EAGER
    for run in ("measured", "cached"):
        compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(cache=cache))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
            (graph,) = memlayout.backend_report().graphs
            if run == "measured":
                assert set(graph.racing) == {Runner.INDUCTOR_OWN, Runner.PLAN_EAGER}
                assert asked == [{}]  # Inductor's own alone, before the first call returned
                assert _raced(lambda c=compiled: c(x)) > 0
            assert not graph.racing if run == "cached" else True
            torch.testing.assert_close(compiled(x), model(x))
        (graph,) = memlayout.backend_report(clear=True).graphs
        assert graph.ran == fastest and not graph.racing
        if run == "measured":
            assert ("the compiled plan built on a later call" in graph.plan_later) == built
            assert ("the compiled plan not built" in graph.plan_later) == (not built)
            assert asked == ([{}, backend_inner.PLAN_STANDS] if built else [{}])
            assert (graph.later_seconds > 0) == built
            # the second race's ratios where the compiled plan was raced, against the way kept
            timed = dict(graph.timed)
            assert graph.timed_against == Runner.INDUCTOR_OWN
            assert set(timed) == ({Runner.PLAN_COMPILED} if built else {Runner.PLAN_EAGER})
            assert next(iter(timed.values())) == pytest.approx(
                0.5 if fastest == Runner.INDUCTOR_OWN else 2.0)
        else:
            assert asked == {Runner.PLAN_COMPILED: [backend_inner.PLAN_STANDS],
                             Runner.PLAN_EAGER: [], Runner.INDUCTOR_OWN: [{}]}[fastest]
            assert graph.race_calls == 0 and graph.later_seconds == 0
        asked.clear()
        torch._dynamo.reset()
        monkeypatch.setattr(guard, "interleaved", _no_timing)
        monkeypatch.setattr(backend_inner, "CallRace", _no_timing)


def test_a_cached_first_race_without_its_second_builds_the_compiled_plan_at_the_first_call(
        monkeypatch, tmp_path):
    """Both races of a graph ran and were cached (the compiled plan won the second); the
    second is then lost from the cache. A new compile reads the first (Inductor's own kept,
    the compiled plan able to win by its costs), builds Inductor's own alone, and the first
    call builds the compiled plan, verifies it and races it against Inductor's own again."""
    model, x, cache, asked = _planned_contiguous(monkeypatch, tmp_path, rule=True, train=False)
    fake_guard_clock(monkeypatch, _gain_clock(Runner.PLAN_COMPILED))
    for run in ("measured", "second race lost"):
        compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(cache=cache))
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
            if run != "measured":
                (graph,) = memlayout.backend_report().graphs
                assert asked == [{}, backend_inner.PLAN_STANDS]  # the plan, at that call
                assert graph.racing == (Runner.INDUCTOR_OWN, Runner.PLAN_COMPILED)
            assert _raced(lambda c=compiled: c(x)) > 0
            torch.testing.assert_close(compiled(x), model(x))
        (graph,) = memlayout.backend_report(clear=True).graphs
        assert graph.ran == Runner.PLAN_COMPILED and graph.later_seconds > 0
        assert dict(graph.timed)[Runner.PLAN_COMPILED] == pytest.approx(2.0)
        db = sqlite3.connect(cache)
        with db:  # the second race: Inductor's own against the compiled plan
            assert db.execute("DELETE FROM entries WHERE key LIKE "
                              "'%\"inductor\", \"planned+inductor\"]%'").rowcount == 1
        db.close()
        asked.clear()
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["default", "max-autotune"])
def test_the_eager_plan_is_verified_while_inductors_own_compiles_where_inductor_times_nothing(
        monkeypatch, tmp_path, mode):
    """A training graph raced on its calls: the plan run eagerly is verified on a thread of
    its own while Inductor's own compiles (here the verification waits for that compile to
    begin, and the compile for the verification to end), at the lowest priority, and the
    price counts that time as alongside it. Under ``max-autotune``, whose
    compile times kernels, the verification runs first, alone. Either way the step is the
    model's."""
    model, x, cache, asked = _planned_contiguous(monkeypatch, tmp_path, rule=False, train=True)
    compiling, verified, waited, niceness = threading.Event(), threading.Event(), [], []
    spied, real_verify = backend_inner.inner_compile, backend_check.verify_graph

    def verify_graph(*args, **kwargs):
        waited.append(compiling.wait(timeout=10.0 if mode == "default" else 0.5))
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        time.sleep(0.1)  # a verification the price line shows (it rounds to 0.1 s)
        try:
            return real_verify(*args, **kwargs)
        finally:
            verified.set()

    def inner(gm, example_inputs, options, dtype, device, patches=backend_inner.PLAN_STANDS,
              backward_now=True):
        if not patches:  # Inductor's own: compiling until the verification has ended
            compiling.set()
            verified.wait(timeout=10.0)
        return spied(gm, example_inputs, options, dtype, device, patches, backward_now)
    monkeypatch.setattr(backend_check, "verify_graph", verify_graph)
    monkeypatch.setattr(backend_inner, "inner_compile", inner)
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(cache=cache,
                                                                             mode=mode))
    (out, grads), (want, want_grads) = _train_step(compiled, x), _train_step(model, x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grads, want_grads)
    report = memlayout.backend_report()
    (graph,) = report.graphs
    assert asked == [{}] and graph.ran == Runner.INDUCTOR_OWN and graph.racing
    assert waited == [mode == "default"]
    # alongside, at the lowest priority: what the compile leaves idle
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness == [backend_inner.LOWEST_PRIORITY if mode == "default" else main]
    assert (graph.verify_alongside > 0) == (mode == "default")
    assert graph.verify_alongside <= graph.verify_seconds
    assert ("alongside Inductor's compile" in report.price()) == (mode == "default")


def test_a_compiled_plan_built_later_that_fails_its_check_is_dropped_and_the_way_kept_runs_on(
        monkeypatch, tmp_path):
    """The compiled plan (the fastest on the fake clock), built on a later call after the
    first race kept Inductor's own, computes other values than the graph (a wrong kernel,
    injected): it is dropped with a warning before any call runs it, Inductor's own runs on,
    the record says why, and every call computes what the model does."""
    model, x, cache, asked = _planned_contiguous(monkeypatch, tmp_path, rule=True, train=False)
    spied = backend_inner.inner_compile

    def wrong(gm, example_inputs, options, dtype, device, patches=backend_inner.PLAN_STANDS,
              backward_now=True):
        fn = spied(gm, example_inputs, options, dtype, device, patches, backward_now)
        return fn if not patches else lambda *args: tuple(t * 1.5 for t in fn(*args))
    monkeypatch.setattr(backend_inner, "inner_compile", wrong)
    fake_guard_clock(monkeypatch, _gain_clock(Runner.PLAN_COMPILED))
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(cache=cache))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), model(x))
        assert _raced(lambda: torch.testing.assert_close(compiled(x), model(x))) > 0
        torch.testing.assert_close(compiled(x), model(x))
    (graph,) = memlayout.backend_report().graphs
    assert asked == [{}, backend_inner.PLAN_STANDS]  # Inductor's own, then the plan, later
    assert graph.ran == Runner.INDUCTOR_OWN and not graph.racing
    assert graph.plan_later.startswith("the compiled plan dropped (")
    assert graph.later_seconds > 0
    assert [w for w in caught if "the compiled plan of graph" in str(w.message)]


@pytest.mark.parametrize("on_calls", [False, True])
def test_an_eager_plan_that_fails_its_check_gives_way_to_the_compiled_plan(
        monkeypatch, tmp_path, on_calls):
    """The plan run eagerly (the fastest on the fake clock) computes other values than the
    graph (a wrong kernel, injected). Raced before the first call returns, the guard keeps
    it, it fails its check, and the compiled plan, verified, runs instead; the race that kept
    it is forgotten. Raced on the graph's calls, it is verified before its race against
    Inductor's own, with the compiled plan not yet built: the plan is dropped, with a
    warning, and Inductor's own runs. Either way the report says why, nothing is stored,
    and the next compile does the same."""
    model, x, cache, _ = _planned_contiguous(monkeypatch, tmp_path, rule=True, train=False)
    monkeypatch.setattr(backend_inner, "eager_run", lambda gm, options, device: lambda *args:
                        tuple(t * 1.5 for t in gm(*args)))  # Dynamo's graphs return tuples
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == Runner.PLAN_EAGER else 1.0)
    for _ in range(2):
        compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
            cache=cache, race_on_calls=on_calls))
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.testing.assert_close(compiled(x), model(x))
            assert _raced(lambda c=compiled: c(x)) == 0
            torch.testing.assert_close(compiled(x), model(x))
        (graph,) = memlayout.backend_report(clear=True).graphs
        dropped = [w for w in caught if "was dropped" in str(w.message)]
        if on_calls:
            assert graph.ran == Runner.INDUCTOR_OWN and "relative error" in graph.fallback
            assert len(dropped) == 1 and graph.guard_seconds == 0
        else:
            assert graph.ran == Runner.PLAN_COMPILED and not graph.fallback and not dropped
            assert "the plan run eagerly was faster but failed its check" in graph.verification
            assert dict(graph.timed)[Runner.PLAN_EAGER] == pytest.approx(2.0)
            assert graph.guard_seconds > 0  # raced, each time
        torch._dynamo.reset()


@pytest.mark.parametrize(("train", "on_calls"), [(False, True), (True, False), (True, True)])
def test_a_plan_that_agrees_with_inductors_rule_is_not_timed_against_inductors_own(
        monkeypatch, tmp_path, train, on_calls):
    """Inductor's rule stated off (convolutions keep their traced strides) and the plan
    contiguous: no convolution differs. In inference the two programs differ at most between
    the convolutions: Inductor's own runs, compiled once, nothing timed, the plan neither
    compiled nor verified. In training the plan run eagerly is verified and raced against one
    compiled way. Raced before the first call returns, that is the compiled plan (it also
    decides the gradients' strides), and Inductor's own is neither compiled nor timed (made
    the fastest on the fake clock, it would have been kept). Raced on the graph's calls, it
    is Inductor's own, compiled as torch.compile compiles it, and the compiled plan is not
    built: Inductor's own, the fastest, is kept."""
    model, x, cache, asked = _planned_contiguous(monkeypatch, tmp_path, rule=False, train=train)
    verified = []
    monkeypatch.setattr(backend_check, "verify_graph",
                        lambda *a, real=backend_check.verify_graph, **k: verified.append(1)
                        or real(*a, **k))
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == Runner.INDUCTOR_OWN else 1.0)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(ours, backend=memlayout.backend(cache=cache,
                                                             race_on_calls=on_calls))
    if train:
        (out, grads), (want, want_grads) = _train_step(compiled, x), _train_step(theirs, x)
        torch.testing.assert_close(grads, want_grads)
    else:
        with torch.no_grad():
            out, want = compiled(x), theirs(x)
    torch.testing.assert_close(out, want)
    if train and on_calls:  # raced on its training steps
        assert _raced(lambda: _train_step(compiled, x)) > 0
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and graph.convolutions and not graph.differing
    if train and on_calls:
        assert graph.ran == Runner.INDUCTOR_OWN and graph.own_compile_seconds is not None
        assert dict(graph.timed).keys() == {Runner.PLAN_EAGER}
        assert graph.timed_against == Runner.INDUCTOR_OWN
        assert "; Inductor's own layouts' time over planned's 0.5" in graph.headline()
        assert dict(graph.timed)[Runner.PLAN_EAGER] == pytest.approx(0.5)
        assert asked == [{}] and verified  # Inductor's own, once; the eager plan verified
    elif train:
        assert graph.ran == Runner.PLAN_COMPILED  # a tie with the eager plan: the default
        assert {how for how, _ in graph.timed} == {Runner.PLAN_EAGER}
        assert asked == [backend_inner.PLAN_STANDS] and verified
    else:
        assert graph.ran == Runner.INDUCTOR_OWN
        # its convolutions' costs alone settle it (every_plan_agrees): no plan made
        assert graph.timed == () and graph.verification == backend_plan.NONE_DIFFERS
        assert asked == [{}] and not verified  # Inductor's own, once: the plan not built


def _other_costs(cache: str) -> int:
    """How many entries of ``cache`` are costs of a node other than a convolution, or of a
    conversion."""
    db = sqlite3.connect(cache)
    try:
        return db.execute("SELECT COUNT(*) FROM entries WHERE kind = 'convert' OR "
                          "(kind = 'node' AND key NOT LIKE '%conv2d%')").fetchone()[0]
    finally:
        db.close()


@pytest.mark.parametrize("rule", [False, True])
def test_an_inference_graphs_other_costs_are_measured_only_where_its_convolutions_leave_it_open(
        monkeypatch, tmp_path, rule):
    """The cost cache holds the convolutions' costs alone, channels-last 50x slower. With
    Inductor's rule off (the convolutions keep their traced contiguous strides), no plan can
    differ from it by those costs: nothing else is measured, no cut solved, Inductor's own
    runs. With the rule on (every convolution channels-last) they leave it open: the other
    nodes and the conversions are measured, and the plan puts the convolutions contiguous."""
    model, x, cache, asked = _planned_contiguous(monkeypatch, tmp_path, rule=rule, train=False)
    db = sqlite3.connect(cache)
    with db:
        assert db.execute("DELETE FROM entries WHERE kind = 'convert' OR "
                          "(kind = 'node' AND key NOT LIKE '%conv2d%')").rowcount > 0
    db.close()
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == Runner.PLAN_COMPILED else 1.0)
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=cache, race_on_calls=False))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and len(graph.convolutions) == 2 and graph.cached >= 2
    if rule:
        assert _other_costs(cache) > 0 and graph.measured > 0
        assert {c.planned for c in graph.convolutions} == {"contiguous"}
        assert len(graph.differing) == 2 and graph.ran == Runner.PLAN_COMPILED
    else:
        assert _other_costs(cache) == 0 and graph.measured == 0
        assert graph.verification == backend_plan.NONE_DIFFERS and not graph.differing
        assert graph.ran == Runner.INDUCTOR_OWN and asked == [{}]


@pytest.mark.parametrize(("cycle", "extended"), [((0.98, 1.0, 1.05), False),
                                                 ((0.95, 1.04, 1.06), True)])
def test_a_close_call_with_the_eager_plan_is_timed_longer_only_where_it_would_be_kept(
        monkeypatch, tmp_path, cycle, extended):
    """A training graph that agrees with Inductor's rule: the guard races one compiled way
    against the plan run eagerly only (on the graph's training steps: Inductor's own, as
    torch.compile compiles it). The eager plan's steps take 1 / ``cycle``'s ratios in turn,
    the compiled way's 1 s: per-round ratios around 1.0 (a close call the compiled way keeps:
    decided on the guard's rounds) or around 1.04 with one round in three below 1 (a close
    call the eager plan would win: timed for as many rounds again before it is kept)."""
    model, x, cache, _ = _planned_contiguous(monkeypatch, tmp_path, rule=False, train=True)
    calls: dict[str, int] = {}

    def seconds(name, i):
        calls[name] = i + 1
        return 1 / cycle[i % len(cycle)] if name == Runner.PLAN_EAGER else 1.0
    fake_guard_clock(monkeypatch, seconds)
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(cache=cache))
    (out, grads), (want, want_grads) = _train_step(compiled, x), _train_step(model, x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grads, want_grads)
    _raced(lambda: _train_step(compiled, x))
    (graph,) = memlayout.backend_report().graphs
    rounds = 2 * 5 if extended else 5  # the backend's 5 rounds, twice for a close call
    kept = Runner.PLAN_EAGER if extended else Runner.INDUCTOR_OWN
    # the call that ends the race runs the way kept
    raced = {way: n - (way == kept) for way, n in calls.items()}
    assert raced == {Runner.INDUCTOR_OWN: 1 + rounds, Runner.PLAN_EAGER: 1 + rounds}  # + warm-up
    assert graph.race_calls == 2 * (1 + rounds) and graph.ran == kept
    assert abs(dict(graph.timed)[Runner.PLAN_EAGER] - (1 + KEEP_MARGIN)) < 0.03


def test_a_training_plan_nothing_runs_before_dynamo_compiles_its_backward_lazily(
        monkeypatch, tmp_path):
    """The first compile of a training graph verifies and times the compiled plan inside the
    backend's call, so its backward is compiled with the forward. A later compile that reads
    the guard's decision (the compiled plan, the fastest on the fake clock) and the verdict
    from the cache runs nothing before Dynamo does: with an Inductor cache of its own, its
    backward is compiled at the first backward, as ``torch.compile`` compiles it; with the
    Inductor cache the first compile wrote, with the forward again, as the first compile did
    (AOTAutograd's cache key holds the setting: lazily, it would miss that cache and compile
    both again). The gradients are the model's every way."""
    monkeypatch.setattr(backend_plan, "inductor_rule", lambda *args, **kwargs: False)
    model, x = _plain().train(), torch.randn(2, 3, 12, 12)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=True)
    asked: list[bool] = []

    def inner(gm, example_inputs, options, dtype, device, patches=backend_inner.PLAN_STANDS,
              backward_now=True):
        asked.append(backward_now)
        return gm.forward
    monkeypatch.setattr(backend_inner, "inner_compile", inner)
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == Runner.PLAN_COMPILED else 1.0)
    first, other = str(tmp_path / "inductor"), str(tmp_path / "inductor-elsewhere")
    for run, inductor_cache in (("measured", first), ("cached", other), ("cached", first)):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
        ours, theirs = copy.deepcopy(model), copy.deepcopy(model)  # no gradient yet
        # raced before the first call returns: on the calls, the plan would not be compiled
        compiled = torch.compile(ours, backend=memlayout.backend(cache=cache,
                                                                 race_on_calls=False))
        (out, grads), (want, want_grads) = _train_step(compiled, x), _train_step(theirs, x)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grads, want_grads)
        (graph,) = memlayout.backend_report(clear=True).graphs
        assert graph.ran == Runner.PLAN_COMPILED
        assert ("verified before" in graph.verification) == (run == "cached")
        # the plan's compile first (the first run's guard may compile Inductor's own too,
        # to time it: with its backward, as it runs there)
        assert asked[0] == (inductor_cache == first)
        assert run == "measured" or len(asked) == 1
        asked.clear()
        torch._dynamo.reset()
        monkeypatch.setattr(guard, "interleaved", _no_timing)


def _no_timing(*args, **kwargs):
    raise AssertionError("timed although the decision is in the cache")


def test_a_passing_verification_is_kept_and_a_failing_one_is_checked_again(monkeypatch, tmp_path):
    """A plan verified once (same graph, rewrite, input metadata, way of running it) is not run
    again, and says so; a plan that failed is checked again on every compile."""
    calls = []
    real = backend_check.verify_graph

    def counted(*args, **kwargs):
        calls.append(kwargs["compiled"])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_check, "verify_graph", counted)
    model = _plain().eval()
    reference = torch.fx.symbolic_trace(model)
    wrong = torch.fx.symbolic_trace(nn.Sequential(model, Scale(1.5)))
    inputs, store = [torch.randn(2, 3, 8, 8)], CostCache(tmp_path / "costs.sqlite")
    where = dict(store=store, train=False, dtype=None, device=torch.device("cpu"))
    for planned, ok in ((wrong, False), (wrong, False), (reference, True), (reference, True)):
        check = backend_check.verify_once(reference, planned, planned.forward, inputs,
                                          way=Runner.PLAN_EAGER, compiled=False, **where)
        assert check.ok == ok
    assert len(calls) == 3 and "verified before" in check.how
    check = backend_check.verify_once(reference, reference, reference.forward, inputs,
                                      way="inductor default", compiled=True, **where)
    assert check.ok and "verified before" not in check.how and calls[-1] is True


def test_the_guards_training_step_pays_for_gradients_in_other_strides():
    """A weight the plan converts to channels-last gets a channels-last gradient, which a
    training step copies into the parameter's strides (autograd's layout contract, as the
    gradient goes into ``.grad``); the step the guard times makes that copy too."""
    w, x = torch.randn(8, 3, 3, 3, requires_grad=True), torch.randn(2, 3, 8, 8)
    cl = torch.channels_last

    def planned(w, x):
        return nn.functional.conv2d(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl))

    step = backend_check._timed_step(planned, [w, x], True, None, torch.device("cpu"))
    with _CopiesInto() as copies:
        step()
    assert (tuple(w.shape), w.stride()) in copies
    model = nn.Conv2d(3, 8, 3)  # what a real step does with the same function
    planned(model.weight, x).sum().backward()
    assert model.weight.grad.stride() == model.weight.stride() == w.stride()


class _CopiesInto(TorchDispatchMode):
    """Records the shape and strides of every tensor ``aten.copy_`` writes into."""

    def __enter__(self):
        self.copies = []
        super().__enter__()
        return self.copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies.append((tuple(args[0].shape), args[0].stride()))
        return func(*args, **(kwargs or {}))


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _rewrite_then(monkeypatch: pytest.MonkeyPatch,
                  tail: Callable[[fx.Graph, fx.Node], fx.Node]) -> None:
    """The backend's rewrite, then the planned graph's one output replaced by what ``tail``
    makes of it (nodes added to the graph before its output)."""
    real = backend_plan.rewrite

    def rewrite(root, gm, form, labels):
        out = real(root, gm, form, labels)
        result = next(n for n in gm.graph.nodes if n.op == "output")
        (value,) = result.args[0]
        with gm.graph.inserting_before(result):
            result.args = ((tail(gm.graph, value),),)
        gm.recompile()
        return out

    monkeypatch.setattr(backend_plan, "rewrite", rewrite)


def test_a_plan_that_computes_other_values_gives_way_with_a_warning(monkeypatch, tmp_path):
    """A rewrite made wrong on purpose: verification catches it, the graph runs as given,
    outputs are the model's, the report says why."""
    _rewrite_then(monkeypatch, lambda graph, value: graph.call_function(torch.mul, (value, 1.5)))
    model, x = _plain().eval(), torch.randn(2, 3, 8, 8)
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=False, measure=False, inner="eager"))
    with pytest.warns(b.BackendWarning, match="plan of graph .* was dropped"), torch.no_grad():
        got = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))
    (graph,) = memlayout.backend_report().graphs
    assert graph.ran == Runner.ORIGINAL_EAGER and "relative error" in graph.fallback


class Upcast(nn.Module):
    """Attention-style code that computes in float32 whatever comes in (``q.float()``, then
    back to the input's dtype): Dynamo writes both casts as float32. With ``dropout``, the
    graph draws random numbers too (its check runs apart); with ``rounds``, its output is
    rounded to halves in float32 (``(out + 2**22) - 2**22``, exact in float64): a graph far
    from its float64 result by rounding alone."""

    def __init__(self, dropout: bool, rounds: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = nn.Dropout(0.5) if dropout else nn.Identity()
        self.out = nn.Conv2d(8, 8, 3, padding=1)
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y = (y.float().softmax(1) * 8).to(x.dtype)
        y = self.out(self.drop(y))
        return (y + 2.0 ** 22) - 2.0 ** 22 if self.rounds else y


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("rounds", [True, False])
def test_a_rounding_difference_is_rechecked_in_float64_through_a_graphs_float32_casts(
        monkeypatch, dropout, rounds):
    """A plan that differs from the graph only by rounding passes on its float64 re-check,
    also where the graph casts to float32 (which its float64 copy must not do: the conv after
    the cast would meet a float32 input and a float64 weight, and the plan be dropped). The
    plan rounds to whole numbers on purpose (``(out + 2**23) - 2**23``, exact in float64).
    That is rounding where the graph itself rounds about as coarsely (to halves: ``rounds``);
    where the graph's own float32 run is exact to 1e-7, a plan half a unit off computes
    something else in float32, exact rewrite or not: it is dropped, with a warning."""
    _rewrite_then(monkeypatch, lambda graph, value: graph.call_function(
        torch.sub, (graph.call_function(torch.add, (value, 2.0 ** 23)), 2.0 ** 23)))
    model, x = Upcast(dropout, rounds).train(), torch.randn(2, 3, 8, 8)
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=False, measure=False, inner="eager"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", b.BackendWarning)
        compiled(x).square().mean().backward()
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and graph.max_error > 1e-3  # beyond float32's tolerance
    if rounds:
        assert not graph.fallback and not caught, graph.fallback
        assert "float64" in graph.verification and "rounding" in graph.verification
        assert ("dropout off" in graph.verification) is dropout
    else:
        assert graph.fallback and graph.ran == Runner.ORIGINAL_EAGER
        assert [w for w in caught if "was dropped" in str(w.message)]


@pytest.mark.parametrize("dropout", [False, True])
def test_a_rewrite_exact_in_float64_is_not_run_in_float64_again(monkeypatch, tmp_path, dropout):
    """The float64 re-check says whether the rewrite is exact, whichever way the plan runs:
    the plan verified compiled (Inductor replaced by the graph as it is), then the same
    rewrite verified again run eagerly (as once the guard keeps the eager plan), with one
    cost cache. The second verification still compares the float32 step and finds it beyond
    tolerance, and takes the rewrite's float64 verdict from the cache instead of running the
    planned graph in float64 again (the graph itself runs in float64: how far the way's own
    run is from it is that way's); a rewrite that is not exact is never kept (a wrong one is
    dropped each time: ``test_a_plan_that_computes_other_values_gives_way_with_a_warning``).
    A graph with dropout is checked eagerly, dropout off, whichever way it runs: its whole
    verdict holds for the second way, and nothing is run again."""
    _rewrite_then(monkeypatch, lambda graph, value: graph.call_function(
        torch.sub, (graph.call_function(torch.add, (value, 2.0 ** 23)), 2.0 ** 23)))
    _spied_inner(monkeypatch)
    widened: list[str] = []  # the code of each graph copied to float64
    monkeypatch.setattr(backend_check, "float64", lambda value, real=backend_check.float64:
                        widened.append(getattr(value, "code", "")) or real(value))
    model, x = Upcast(dropout, rounds=True).train(), torch.randn(2, 3, 8, 8)
    cache = str(tmp_path / "costs.sqlite")
    for inner in ("inductor", "eager"):
        widened.clear()
        compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
            cache=cache, measure=False, inner=inner))
        compiled(x).square().mean().backward()
        (graph,) = memlayout.backend_report(clear=True).graphs
        assert graph.planned and not graph.fallback and graph.max_error > 1e-3
        assert ("dropout off" in graph.verification) is dropout
        assert "float64" in graph.verification and "rounding" in graph.verification
        said = "verified before" if dropout else "checked before"
        assert (said in graph.verification) == (inner == "eager")
        # the planned graph (which adds 2**23) copied to float64 the first time only
        assert any(str(2.0 ** 23) in code for code in widened) == (inner == "inductor")
        assert bool(widened) == (inner == "inductor" or not dropout)
        torch._dynamo.reset()


def test_dynamic_shapes_plan_at_the_example_and_serve_other_sizes(monkeypatch, tmp_path):
    """``dynamic=True``: one graph for every size, planned at the first example's sizes;
    with channels-last made cheap the plan converts (conversions traced with symbolic
    sizes), and Inductor compiles it. The report's Inductor rule for the dynamic graph is
    the decision Inductor's own compile of it makes."""
    from torch._inductor import config as inductor_config
    from torch._inductor.graph import GraphLowering

    decided, decide = [], GraphLowering.decide_layout_opt
    monkeypatch.setattr(GraphLowering, "decide_layout_opt", staticmethod(
        lambda gm, *, is_inference: decided.append(decide(gm, is_inference=is_inference))
        or decided[-1]))
    model, x = _plain().eval(), torch.randn(2, 3, 12, 14)  # H != W: no duck-sized guard
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=False)
    assert _scale_channels_last(cache, 0.02) >= 2
    compiled = torch.compile(copy.deepcopy(model), dynamic=True,
                             backend=memlayout.backend(cache=cache, guard=False))
    with torch.no_grad():
        for y in (x, torch.randn(3, 3, 10, 16)):
            torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-5)
    (graph,) = memlayout.backend_report().graphs
    assert graph.dynamic and graph.planned and not graph.fallback
    assert graph.ran == Runner.PLAN_COMPILED
    assert graph.conversions > 0
    assert all(c.planned == "channels_last" for c in graph.convolutions)
    decided.clear()
    # Inductor with its own layouts, compiled (a cached compile asks no rule)
    with torch.no_grad(), inductor_config.patch(force_disable_caches=True):
        torch.compile(copy.deepcopy(model), dynamic=True)(x)
    assert decided and graph.inductor_rule is decided[0]


def test_the_bench_mode_trains_through_the_backend_and_says_what_it_did(monkeypatch):
    from memlayout import machine
    from memlayout.bench.modes import prepare_mode

    # bf16 reads as native: an emulated bf16 CPU does not build compile modes in bf16
    monkeypatch.setattr(machine, "bf16_speed", lambda device="cpu": machine.Bf16Speed(2.0, "cpu"))
    model, x = Broken(), torch.randn(2, 3, 16, 16)
    prepared = prepare_mode("compile-memlayout", model, x, dtype="bf16", task="train",
                            compile_backend="eager", plan_measure=False)
    assert torch.isfinite(prepared.step()).all()
    graphs = memlayout.backend_report().graphs
    assert len(graphs) >= 2 and all(g.dtype == "bf16" for g in graphs if g.convolutions)
    assert prepared.note.startswith("torch.compile(backend=memlayout.backend(inner='eager')): "
                                    f"{len(graphs)} graphs")
    converted = sum(len(g.converted_weights) for g in graphs)
    assert f"{converted} weights" in prepared.note


def test_the_bench_mode_times_the_backend_after_its_races_on_the_calls_end(monkeypatch, tmp_path):
    """The bench's backend mode makes calls until no graph races any more, so its rounds time
    what runs from then on, and its note says how many calls the races took (the compile
    made an eager stand-in for Inductor: a fake clock decides, not its speed)."""
    from memlayout.bench.modes import prepare_mode

    monkeypatch.setattr(backend_plan, "inductor_rule", lambda *args, **kwargs: False)
    model, x = _plain().train(), torch.randn(2, 3, 12, 12)
    monkeypatch.setenv("MEMLAYOUT_CACHE_DIR", str(tmp_path))
    _measure_into(str(tmp_path / "costs.sqlite"), model, x, train=True)
    monkeypatch.setattr(backend_inner, "inner_compile", lambda gm, *a, **k: gm.forward)
    fake_guard_clock(monkeypatch, lambda name, _i: 0.5 if name == Runner.PLAN_EAGER else 1.0)
    prepared = prepare_mode("compile-memlayout", model, x, dtype="fp32", task="train")
    (graph,) = memlayout.backend_report().graphs
    assert not graph.racing and graph.ran == Runner.PLAN_EAGER and graph.race_calls > 0
    assert f"races on the calls ended {graph.race_calls} calls after the first" in prepared.note


def test_the_report_says_where_inductors_own_layouts_were_timed_slower_with_no_differing_conv():
    """A graph whose guard timed Inductor's own layouts slower than the compiled plan by more
    than the margin, every convolution in its rule's format: the report says the difference
    lies between convolutions. Within the margin it says nothing."""
    from memlayout.plan.compilers.backend_report import (
        BackendReport,
        ConvolutionChoice,
        GraphRecord,
    )

    conv = ConvolutionChoice("Mixed_6b.branch_pool.conv", "conv2d", (8, 768, 17, 17),
                             "channels_last", "channels_last", (1e-3, 1e-3), True)
    for ratio, says in ((0.41, True), (1 - KEEP_MARGIN / 2, False), (1.3, False)):
        record = GraphRecord("0/0", False, "bf16", False, True, Runner.PLAN_COMPILED,
                             convolutions=(conv,), timed=((Runner.INDUCTOR_OWN, ratio),))
        text = BackendReport((record,)).render()
        assert record.own_layouts_slower == (1 / ratio if says else None)
        assert (f"Inductor's own layouts took {1 / ratio:.3g}x the compiled plan's time: every "
                "convolution runs in the format its rule gives" in text) is says


def test_the_bench_note_counts_the_weights_of_the_plans_that_run():
    """Weights count where a plan runs (compiled or eagerly); a graph left to Inductor's own
    layouts converts none of its plan's. The differing convolutions are named, and how much
    slower the guard timed Inductor's own layouts."""
    from types import SimpleNamespace

    from memlayout.bench.modes import _backend_note

    graphs = [SimpleNamespace(ran=Runner.PLAN_COMPILED,
                              converted_weights=[("a.weight", 2_000_000)], own_layouts_slower=1.4),
              SimpleNamespace(ran=Runner.PLAN_EAGER, converted_weights=[("b.weight", 500_000)],
                              own_layouts_slower=2.5),
              SimpleNamespace(ran=Runner.INDUCTOR_OWN,
                              converted_weights=[("c.weight", 7_000_000)], own_layouts_slower=None)]
    differing = [(graphs[0], SimpleNamespace(where="layer1.conv"))]
    note = _backend_note(SimpleNamespace(graphs=graphs, differing=differing), "inductor")
    running = [w for g in graphs if g.ran != Runner.INDUCTOR_OWN for w in g.converted_weights]
    assert (f"{len(running)} weights ({sum(size for _, size in running) / 1e6:.3g} MB) "
            "converted per call") in note
    assert "3 graphs (1 planned+inductor, 1 planned, 1 inductor)" in note
    assert "1 convolutions differ from Inductor's rule: layer1.conv" in note
    assert "the guard timed Inductor's own layouts at up to 2.5x the compiled plan's time" in note


class Padded(nn.Module):
    """Images written into a zero batch through a slice, the batch read by a convolution and
    returned (torchvision detection's ``batch_images``): a write in place that a conversion
    of the batch would lose."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = x.new_zeros(x.shape[0], 3, 40, 40)
        for i in range(x.shape[0]):  # as batch_images does, image by image
            batch[i, :, :32, :32].copy_(x[i])
        return self.conv(batch).mean((2, 3)), batch


def test_a_tensor_written_in_place_is_not_converted_away_from_its_readers(tmp_path):
    model, x = Padded().eval(), torch.randn(2, 3, 32, 32)
    cache = str(tmp_path / "costs.sqlite")
    _measure_into(cache, model, x, train=False)
    _scale_channels_last(cache, 0.02)  # the convolution wants channels-last
    compiled = torch.compile(copy.deepcopy(model), backend=memlayout.backend(
        cache=cache, inner="eager", guard=False))
    with torch.no_grad():
        for got, want in zip(compiled(x), model(x), strict=True):
            torch.testing.assert_close(got, want)
    (graph,) = memlayout.backend_report().graphs
    assert graph.planned and not graph.fallback and graph.ran == Runner.PLAN_EAGER
    assert graph.convolutions[0].planned == "channels_last"  # the input converted, not the batch


def test_a_planned_graph_is_one_aotautograds_cache_keeps(monkeypatch):
    """A planned graph calls memlayout's conversion (and, in training, a weight's gradient
    strides): functions outside torch, for which AOTAutograd's cache check bypasses the
    cache, so every compile of the graph, a second compile in one process included, traced
    and partitioned it again. The inner compile names them cacheable (keyed by memlayout's
    version and source), and only for a graph that calls them: torch's own check then passes
    every node, where without it the conversion is refused."""
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import compile_fx

    from memlayout.plan.compilers.backend_graphs import grad_in_strides
    from memlayout.plan.convert import convert_value
    from memlayout.plan.graph import Label

    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x_cl = graph.call_function(convert_value, (x, Label.CHANNELS_LAST, (4, 5)))
    graph.output(graph.call_function(torch.conv2d, (x_cl, graph.call_function(
        grad_in_strides, (w,)))))
    planned = fx.GraphModule(nn.Module(), graph)
    plain = fx.symbolic_trace(nn.Conv2d(3, 4, 1))
    with pytest.raises(autograd_cache.BypassAOTAutogradCache):
        for n in planned.graph.nodes:
            autograd_cache.check_node_safe(n)
    patches = []
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, inputs, config_patches=None:
                        patches.append(config_patches or {}) or gm.forward)
    options = memlayout.backend()
    for gm in (planned, plain):
        backend_inner.inner_compile(gm, [], options, None, torch.device("cpu"))
    marked = patches[0]["unsafe_marked_cacheable_functions"]
    assert "unsafe_marked_cacheable_functions" not in patches[1]  # Inductor's own key kept
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked):
        for n in planned.graph.nodes:
            autograd_cache.check_node_safe(n)
