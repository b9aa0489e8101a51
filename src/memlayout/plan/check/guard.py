"""Guard (L2 plan, between rewrite and verify): the plan against all-NCHW and all-NHWC, whole model.

Per-op costs are measured one op at a time; the real forward can disagree (a concatenation run
NCHW between channels-last convolutions costs more in the model than alone). So the min-cut plan
is timed as a whole model against the original run entirely in one format, exactly as eager
NCHW and eager NHWC run it (weights and inputs converted; outputs as the plan keeps them),
except a format the plan already runs end to end, interleaved round by round through
``memlayout.timing.interleaved``. The plan is kept unless another candidate is faster by
more than ``margin`` (default ``memlayout.timing.KEEP_MARGIN``, 2 %: near ties keep the
plan) in the median of the per-round ratios ``planned / candidate``. A close call (the
decision the best candidate's rounds would take could still cost more than the margin: a
candidate kept while a quarter of its rounds or more have it slower than the plan, or the plan
kept while a quarter or more have the candidate faster beyond the margin) is timed for as
many rounds again before it is decided: on a noisy machine five rounds cannot tell 2 %
apart, and the bar is "never below 0.98x". A cached record of a close call that was not
timed longer is measured again.

The measured ratios are cached (same SQLite store as the costs) under the device, torch version,
autocast dtype and a signature of the captured graphs (every node, its shapes, strides and
dtypes, and the plan's labels), with the conditions they were measured under
(``memlayout.machine.Conditions``) and the spread of the plan's rounds: a second plan of the
same model times nothing, unless the cached ratios were measured on a busy machine, or their
rounds spread beyond ``machine.SPREAD_LIMIT``; those are measured again.

The guard also measures what the plan's cost table only predicts: the planned model's time per
call as a whole. Where the prediction exceeds the measurement by more than ``SUSPECT``
(:func:`suspect`), the costs are not to be trusted (measured under load, or cached from a
busier day): the planner measures them once more, and says so loudly if they still disagree.

The measurement is a :class:`memlayout.timing.Race` with the plan as its reference:

>>> def race(**rounds):
...     return Race(PLANNED, {n: Ratio(PLANNED, n, 1.0, r) for n, r in rounds.items()}, rounds=3)
>>> str(race(all_contiguous=(0.8, 0.9, 0.85), all_channels_last=(1.2, 1.3, 1.1)).kept(PLANNED))
'all_channels_last'
>>> close = race(all_channels_last=(1.01, 1.0, 1.02))
>>> str(close.kept(PLANNED)), str(close.kept(PLANNED, 0.0))
('planned', 'all_channels_last')
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from memlayout.devices import seam
from memlayout.dtypes import autocast
from memlayout.machine import Conditions, busier
from memlayout.plan.capture.regions import Captured
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import measured_on
from memlayout.plan.graph import KEEP_KEY, META_KEY, Label, Request, value_meta
from memlayout.plan.inputs import inputs_in
from memlayout.plan.options import RunOptions
from memlayout.plan.report.records import GuardRecord, RatioRange, decode
from memlayout.plan.runners import Runner
from memlayout.plan.solve.regions import Solution
from memlayout.plan.steer.build import (
    Build,
    build,
    conversions_of,
    node_choices,
    steering_of,
    uniform_conversions,
    uniform_steering,
)
from memlayout.plan.steer.state import Formats
from memlayout.tensors import iter_tensors, mean_square_loss
from memlayout.timing import (
    ModeTiming,
    Race,
    Ratio,
    behind,
    interleaved,
    round_ratios,
    separated,
)

#: the plan run eagerly, the race's reference
PLANNED = Runner.PLAN_EAGER
#: predicted / measured planned time above which the cost table is suspect. The table leaves
#: out what runs between the layout nodes (elementwise ops, dispatch, Python) and takes each
#: op's fastest round, so it predicts less than the model takes (docs/benchmarks.md has the
#: ratios measured); costs taken under load can predict many times the measured time. A
#: prediction below the measurement is what the table leaves out, not a sign of bad costs, so
#: only this side is checked.
SUSPECT = 3.0
#: the form of a stored race (``timing.Race``), in every key a race is stored under, so a record
#: stored in another form is not read
RACE = "race v2"
#: eager in one format -> its label
UNIFORM = {Runner.ALL_CONTIGUOUS: Label.CONTIGUOUS, Runner.ALL_CHANNELS_LAST: Label.CHANNELS_LAST}


def signature(graphs: list[tuple[str, fx.GraphModule, Mapping[str, Label]]],
              extra: Any = None) -> str:
    """A hash of ``(region path, graph, planned labels)`` triples: every node's op, target
    (a module's repr), arguments and the shapes, strides and dtypes of its output; plus
    ``extra`` (JSON-able)."""
    h = hashlib.sha256()
    for path, gm, labels in graphs:
        h.update(f"region {path!r}\n".encode())
        for n in gm.graph.nodes:
            args = fx.node.map_arg((n.args, n.kwargs), lambda m: f"%{m.name}")
            h.update(repr((n.name, n.op, _target(gm, n), args, n.meta.get(META_KEY))).encode())
        h.update(json.dumps(sorted(labels.items())).encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _target(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        sub = gm.get_submodule(n.target)
        return f"{type(sub).__module__}.{type(sub).__qualname__}:{sub!r}:train={sub.training}"
    if n.op == "get_attr":
        value = gm
        for part in str(n.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor):
            return f"{value.dtype}{list(value.shape)}{list(value.stride())}"
        return type(value).__name__
    if n.op == "call_function":
        return f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', repr(n.target))}"
    return str(n.target)


def cache_key(device: str, dtype: torch.dtype | None, graph_signature: str) -> str:
    """The cost-cache key of one guard measurement (``RACE``: the stored form)."""
    return json.dumps(["guard", RACE, device, torch.__version__, str(dtype), graph_signature])


def time_candidates(models: Mapping[str, nn.Module], inputs: tuple[Any, ...],
                    dtype: torch.dtype | None, *, device: torch.device, rounds: int,
                    on_step: Callable[[int, str], None] | None = None,
                    train: bool = False, margin: float | None = None,
                    inputs_of: Mapping[str, tuple[Any, ...]] | None = None,
                    reference: str = PLANNED) -> Race:
    """Time whole models (``models[reference]`` and the others) interleaved, as they will run
    (no grad, autocast for ``dtype`` on ``device``; ``train``: a training step's forward and
    backward, the loss ``memlayout.tensors.mean_square_loss``, backward outside autocast,
    gradients into ``.grad`` as an optimizer reads them; the caller restores buffers).
    With ``margin``, a close call (``Race.is_close``) is timed for ``rounds`` rounds more.
    ``inputs_of``: a candidate's own inputs (e.g. in its format), instead of ``inputs``.
    Returns the :class:`Race`, ratios against ``reference`` (the cache stores it: :func:`save`)."""
    def runner(module: nn.Module, xs: tuple[Any, ...]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad(), autocast(device, dtype):
                return module(*xs)
        return train_step(module, xs, dtype, device) if train else run

    own = inputs_of or {}
    return time_steps({name: runner(m, own.get(name, inputs)) for name, m in models.items()},
                      device=device, rounds=rounds, on_step=on_step, margin=margin,
                      reference=reference)


def time_steps(fns: Mapping[str, Callable[[], Any]], *, device: torch.device, rounds: int,
               on_step: Callable[[int, str], None] | None = None,
               margin: float | None = None, reference: str = PLANNED,
               protect: tuple[str, ...] | None = None) -> Race:
    """Time ``fns[reference]`` and the other steps interleaved, each a whole call as it will
    run; with ``margin`` (the decision being ``race.kept(reference, margin)``), the rounds end
    early once the candidates are apart beyond the noise or tied (``memlayout.timing.separated``),
    a candidate out of the running leaves them (``memlayout.timing.behind``), and a close call
    (``Race.is_close``; with ``protect``, one the reference could lose by) is timed for
    ``rounds`` rounds more, the reference against the candidates it is a close call with
    (``Race.contested``). The :class:`Race` :func:`time_candidates` describes."""
    before = Conditions.now()
    sync = seam(device).synchronize
    # A warm-up and one probe round size the samples: a small model is called repeatedly so a
    # sample lasts ~20 ms (one call is mostly timer noise). When one call is long enough the
    # probe round is already a proper interleaved round and counts as the first.
    probe = interleaved(fns, rounds=1, warmup=1, baseline=reference, sync=sync, on_step=on_step)
    live = {n: f for n, f in fns.items() if probe[n].ok}
    quick = min((probe[n].median for n in live), default=1.0)
    repeat = max(1, min(100, int(0.02 / max(quick, 1e-6))))
    runs = [probe] if repeat == 1 else []
    if reference in live and rounds > len(runs):
        # with a margin, the rounds stop as soon as more cannot change the decision, and a
        # candidate out of the running leaves them
        stop = separated(reference, margin, rounds - len(runs)) if margin is not None else None
        retire = behind(reference, margin, rounds - len(runs)) if margin is not None else None
        runs.append(interleaved(live, rounds=rounds - len(runs), warmup=0, repeat=repeat,
                                baseline=reference, sync=sync, on_step=on_step, stop=stop,
                                retire=retire))

    def race(extended: bool = False) -> Race:
        errors = {n: t.error for c in (probe, *runs) for n, t in c.modes.items() if t.error}
        timed = [{n: t.times for n, t in c.modes.items()} for c in runs]  # retired: not in later runs
        return race_of(timed, reference, live if reference in live else (), errors=errors,
                       extended=extended, before=before, repeat=repeat, protect=protect)

    first = race()
    if margin is None or first.errors or not first.is_close(margin):
        return first
    # the reference and the candidates whose close call it is, not the ones retired as out
    # of the running nor those clearly behind (Race.contested)
    contested = first.contested(margin)
    running = {n: f for n, f in live.items()
               if (n == reference or n in contested)
               and len(runs[-1][n].times) == len(runs[-1][reference].times)}
    runs.append(interleaved(running, rounds=rounds, warmup=0, repeat=repeat,
                            baseline=reference, sync=sync, on_step=on_step))
    return race(extended=True)


def race_of(runs: Sequence[Mapping[str, Sequence[float]]], reference: str,
            names: Iterable[str], *, errors: Mapping[str, str], extended: bool,
            before: Conditions, repeat: int = 1,
            protect: tuple[str, ...] | None = None, now: Conditions | None = None) -> Race:
    """The :class:`Race` of the ways ``names`` (with ``reference``; none: the reference did
    not run) over interleaved ``runs`` (each: way -> its per-round seconds, rounds paired
    within a run, a way retired from a later run absent there), those in ``errors`` left
    out; the machine's conditions the busier of ``before`` and now (``now``: as read by the
    caller; noise anywhere in the runs counts). What ``time_steps`` and the backend's race
    on a graph's calls (``memlayout.plan.compilers.backend_race``) decide on."""
    def times(name: str) -> tuple[float, ...]:
        return tuple(t for run in runs for t in run.get(name, ()))

    names = list(names)
    ratios: dict[str, Ratio] = {}
    for name in names if reference not in errors else ():
        per_round = tuple(r for run in runs
                          for r in round_ratios(run.get(reference, ()), run.get(name, ())))
        whole = Ratio.of_times(reference, name, times(reference), times(name))
        if name != reference and name not in errors and whole and per_round:
            ratios[name] = dataclasses.replace(whole, per_round=per_round)
    own = ModeTiming(reference, times(reference) if reference in names else ())
    return Race(reference, ratios, rounds=len(own.times), repeat=repeat, errors=dict(errors),
                extended=extended, conditions=busier(before, now or Conditions.now()),
                reference_seconds=own.median if own.times else None,
                spread=own.spread if own.times else None, protect=protect)


def train_step(module: nn.Module, inputs: tuple[Any, ...], dtype: torch.dtype | None,
               device: torch.device) -> Callable[[], Any]:
    """One training step of ``module`` without the optimizer: gradients set to ``None``,
    forward under autocast, ``memlayout.tensors.mean_square_loss``, backward (into ``.grad``)."""
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> Any:
        for p in params:
            p.grad = None
        with torch.enable_grad():
            with autocast(device, dtype):
                out = module(*inputs)
            loss = mean_square_loss(out)
            if loss is not None:
                loss.backward()
        return out
    return step


def load(value: Any) -> Race:
    """A stored race (:func:`save`) read back; ``PlanError`` (a ``ValueError``) when
    ``value`` is not one.

    >>> race = Race(PLANNED, {"all_contiguous": Ratio(PLANNED, "all_contiguous", 1.1, (1.1, 0.9))},
    ...             rounds=2)
    >>> load(json.loads(json.dumps(dataclasses.asdict(race)))) == race
    True
    """
    race: Race = decode(Race, value, "race")
    return race


def is_race(value: Any) -> bool:
    """``value`` reads back as a :class:`Race` (the cache's check on read)."""
    try:
        load(value)
    except ValueError:
        return False
    return True


def stored(store: Any, key: str) -> Race | None:
    """The race stored under ``key`` in ``store`` (a ``CostCache``), if one is."""
    value = store.get(key, is_race) if store is not None else None
    return load(value) if value is not None else None


def reusable(store: Any, key: str, margin: float) -> Race | None:
    """The race stored under ``key`` where its decision stands (taken on a quiet machine, and
    settled at ``margin``: not a close call, or one timed longer); ``None``: time it again."""
    cached = stored(store, key)
    return cached if cached is not None and not cached.busy and cached.settled(margin) else None


def save(store: Any, key: str, race: Race) -> None:
    """Cache a measured race with the conditions and spread it was measured under. It is
    noisy when the machine was busy: the decision weighs per-round ratios of interleaved
    rounds, where drift cancels, and a close call is timed longer (``Race.is_close``), so the
    spread of the reference's own times is kept as information, not held against it."""
    store.put(key, dataclasses.asdict(race), spread=race.spread, conditions=race.conditions,
              is_noisy=race.busy)


def suspect(predicted: float | None, measured: float | None) -> float | None:
    """The factor by which the cost table's predicted plan time exceeds the plan's measured
    time, when above ``SUSPECT``; else ``None``.

    >>> round(suspect(0.48381, 0.019), 1), suspect(0.0079, 0.019), suspect(None, 0.019)
    (25.5, None, None)
    """
    if not predicted or not measured or predicted <= 0 or measured <= 0:
        return None
    factor = predicted / measured
    return factor if factor > SUSPECT else None


def suspect_note(predicted: float, record: GuardRecord, factor: float) -> str:
    """What a plan says when its costs and its measured whole-model time still disagree after
    the costs were measured again."""
    conditions = record.conditions.describe() if record.conditions is not None else "unknown"
    return (f"the plan rests on suspect costs: its cost table predicts "
            f"{predicted * 1e3:.2f} ms for the planned model, the guard measured "
            f"{(record.planned_seconds or 0.0) * 1e3:.2f} ms per call ({factor:.1f}x, "
            f"beyond {SUSPECT:g}x) even after measuring the costs again ({conditions}); plan "
            "again on a quiet machine (--refresh)")


def describe(race: Race, *, kept: str, margin: float, source: str,
             skipped: list[str], seconds: float | None = None) -> GuardRecord:
    """The guard's entry in ``Plan.guard``."""
    return GuardRecord(
        kept=kept, margin=margin, source=source, rounds=race.rounds,
        candidates={name: RatioRange.of(r) for name, r in race.ratios.items()},
        skipped=tuple(skipped), errors=dict(race.errors), extended=race.extended,
        repeat=race.repeat, seconds=seconds, conditions=race.conditions,
        planned_seconds=race.reference_seconds, spread=race.spread)


def guarded_build(reference: nn.Module, captured: Captured, solution: Solution,
                  inputs: tuple[Any, ...], options: RunOptions, store: CostCache | None,
                  outputs: Formats) -> GuardDecision:
    """Build the min-cut plan; with the guard on (and measuring), time it as a whole model
    against the original run entirely in one format (eager NCHW, eager NHWC: weights and
    inputs converted, outputs as the plan hands them back), skipping a format the plan
    already is end to end (or read that measurement from the cache), and keep the fastest
    (``memlayout.plan.check.guard``). With ``input_format="auto"`` each candidate is timed with
    its inputs already in its format, and the inputs then arrive in the kept one's."""
    entry = solution.chosen_input() if options.auto_input else options.input_label
    own_inputs = options.auto_input and entry is not None

    def uniform(label: Label) -> Build:
        return build_uniform(reference, captured, solution, label, options, outputs,
                             arrive=label if own_inputs else options.input_label)

    skipped = uniform_already(solution, "module" if options.keywords else "")
    if skipped:
        # the plan runs the model in one format end to end: run it exactly as that eager
        # model, so it is what it is compared with, not another copy of it
        eager = uniform(UNIFORM[skipped[0]])
        planned = dataclasses.replace(eager, nodes=node_choices(solution), label=None)
    else:
        planned = build(reference, steering_of(solution, options), options, outputs=outputs,
                        input_label=entry, nodes=node_choices(solution),
                        conversions=conversions_of(solution, options))
    if not (options.guard and options.measure and solution.has_variables):
        return GuardDecision(planned, None, entry)
    if own_inputs:
        inputs = inputs_in(inputs, entry, options.ranks)
    names = [name for name in UNIFORM if name not in skipped
             and not (UNIFORM[name] is Label.CHANNELS_LAST and faulty(solution))]
    if _outputs_mixed(captured, options):
        names, skipped = [], []  # outputs in both formats: a one-format model cannot keep them
    if not names:
        return GuardDecision(planned, GuardRecord(PLANNED, options.guard_margin, "none", 0,
                                                  skipped=tuple(skipped)), entry)

    def candidate(name: str) -> Build:
        return planned if name == PLANNED else uniform(UNIFORM[name])

    margin = options.guard_margin
    key = cache_key(measured_on(options.device), options.dtype, signature(
        solution.graphs(), [options.signature_extra, names, skipped, "boundaries"]))

    def decided(kept: str, record: GuardRecord) -> GuardDecision:
        label = UNIFORM.get(kept)  # an eager model won: its inputs arrive in its format
        return GuardDecision(candidate(kept), record,
                             label if own_inputs and label is not None else entry, key)

    cached = reusable(store, key, margin)
    if cached is not None:
        kept = cached.kept(PLANNED, margin)
        return decided(kept, describe(cached, kept=kept, margin=margin, source="cache",
                                        skipped=skipped))
    builds = {name: candidate(name) for name in [PLANNED, *names]}
    start = time.perf_counter()
    inputs_of = ({name: inputs_in(inputs, UNIFORM[name], options.ranks) for name in names}
                 if own_inputs else None)
    race = time_candidates({name: b.module for name, b in builds.items()}, inputs,
                           options.dtype, device=options.device, rounds=options.guard_rounds,
                           on_step=_progress(options, len(builds)), train=options.train,
                           margin=margin, inputs_of=inputs_of)
    if store is not None and not race.errors:
        save(store, key, race)
    kept = race.kept(PLANNED, margin)
    return decided(kept, describe(race, kept=kept, margin=margin, source="measured",
                                    skipped=skipped, seconds=time.perf_counter() - start))


def faulty(solution: Solution) -> bool:
    """Some node of the plan must not run channels-last (``memlayout.plan.costs.faults``):
    the model run channels-last end to end, as eager would, is not a candidate."""
    return any(s.table.faults for s in solution.regions)


def uniform_already(solution: Solution, root: str) -> list[str]:
    """The one-format models (``UNIFORM`` names) the plan already is end to end
    (:func:`is_uniform`), the format most of its nodes run in first (a plan whose every node
    is pinned is uniform in both)."""
    return sorted((name for name, label in UNIFORM.items()
                   if is_uniform(solution, label, root)),
                  key=lambda name: -sum(label == UNIFORM[name] for s in solution.regions
                                        for label in s.labels.values()))


def _progress(options: RunOptions, candidates: int) -> Callable[[int, str], None]:
    """The guard's ``on_step``: ``options.progress(done, total, what)`` per timed sample."""
    rounds, steps = options.guard_rounds, [0]

    def on_step(_round: int, name: str) -> None:
        steps[0] += 1
        if options.progress is not None:
            # a close call runs as many rounds again (memlayout.timing.Race.is_close)
            total = rounds * candidates * (1 + (steps[0] > rounds * candidates))
            options.progress(steps[0], total, f"whole model, {name}")
    return on_step


def build_uniform(reference: nn.Module, captured: Captured, solution: Solution, label: Label,
                  options: RunOptions, outputs: Formats, *, arrive: Label | None) -> Build:
    """The original model run entirely in ``label``, as eager NCHW / NHWC: a copy with its
    weights in it, inputs converted on entry, results handed back as the plan hands them."""
    model = reference.module if options.keywords else reference
    conversions = uniform_conversions(solution, captured.calls, label, options, arrive)
    return build(reference, uniform_steering(label, options, model, conversions), options,
                 outputs=outputs, input_label=arrive, nodes=node_choices(solution, label),
                 label=label, conversions=conversions)


def is_uniform(solution: Solution, label: Label, root: str = "") -> bool:
    """The plan runs the whole model in ``label`` as eager would: one region (the model),
    every layout node in ``label`` (or pinned), and conversions only of the model's inputs
    on entry or of its results on the way out (``root``: the model's call)."""
    if len(solution.regions) != 1 or solution.regions[0].region.path != "":
        return False
    if label is Label.CHANNELS_LAST and faulty(solution):
        return False  # eager channels-last would run a kernel's known fault
    s = solution.regions[0]
    # a node pinned because it runs in one format only is in ``label`` as eager would run it;
    # one that layout-reading code sees (``KEEP_KEY``) must be in ``label`` itself
    seen = {n.name for n in s.region.gm.graph.nodes if n.meta.get(KEEP_KEY)}
    if any(s.labels[n] != (label if n in seen else s.form.seconds.pins.get(n, label))
           for n in s.table.nodes):
        return False
    return all(c.call == root for c in s.form.crossings
               if c.convertible and s.labels[c.outer] != s.labels[c.inner])


def _outputs_mixed(captured: Captured, options: RunOptions) -> bool:
    """The kept outputs are in both formats (or in none): no one-format model keeps them."""
    if options.output_label != Request.KEEP:
        return False
    return value_meta(captured.output, options.ranks).label is Label.NEITHER and any(
        True for _ in iter_tensors(captured.output))


def suspect_costs(captured: Captured, solution: Solution, decision: GuardDecision) -> float | None:
    """How far the predicted plan time exceeds the guard's measured one, when beyond
    ``guard.SUSPECT`` (``None`` too when the guard did not time the plan, or parts of the model
    run eager outside the plan's prediction)."""
    if decision.record is None or any(r.path for r in captured.regions) or captured.uncaptured:
        return None
    return suspect(solution.predicted.get("planned"), decision.record.planned_seconds)


@dataclass(frozen=True)
class GuardDecision:
    """The build the guard kept, its record (``Plan.guard``; ``None``: the guard did not run)
    and the format the inputs now arrive in."""

    build: Build
    record: GuardRecord | None
    input_label: Label | None
    #: the cost-cache key its race is stored under (``None``: nothing timed)
    key: str | None = None

    @property
    def kept(self) -> str:
        """``planned``, or the eager model that replaced the plan."""
        return self.record.kept if self.record is not None else "planned"
