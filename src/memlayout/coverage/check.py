"""Run one OpInfo op's samples in contiguous and in channels-last form, and judge them.

Per sample: every tensor of the format's rank goes in once in contiguous form and once in
the format (fresh copies, so in-place ops cannot leak between runs), both runs seeded alike.
The channels-last run says whether outputs (and input gradients) keep the format; the two
runs together say whether values agree. A disagreement is explained when a run called an aten
op tagged ``nondeterministic_seeded`` (``random``: dropout draws its mask in memory order), when
a second contiguous run differs from the first (``nondeterministic``), when the op reads raw
storage (``not comparable``: ``as_strided``), or when a float64 run shows the channels-last
result is as accurate as the contiguous one (another summation order). The rest are listed as
disagreements, never hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import signal
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memlayout.coverage.opinfo import Sample, describe, map_tensors, op_name, samples_for
from memlayout.coverage.records import Disagreement, OpRecord, Values, Verdict
from memlayout.dispatch import ObservingMode
from memlayout.dtypes import Compared, tolerance, torch_name
from memlayout.layout import Format
from memlayout.tensors import format_name, format_of, in_format, iter_tensors, to_format

#: OpInfo ops whose values depend on the memory layout by definition: they address storage
#: directly (as_strided, resize_) or return uninitialized memory (empty_like). Their values are
#: compared and reported, but a difference is ``not comparable``, not a bug.
LAYOUT_DEFINED = frozenset({
    "as_strided", "as_strided_copy", "as_strided_scatter", "resize_", "resize_as_", "empty",
    "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
})

_SEED = 1234
_MAX_ERRORS = 3


class SampleTimeout(Exception):
    """A sample ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise ``SampleTimeout`` in the block after ``seconds`` (Unix main thread only; a
    no-op elsewhere). A kernel stuck in C++ is only interrupted when it returns to Python:
    the runner's worker processes are the hard limit."""
    usable = (seconds and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"sample ran past its {seconds:g} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _classify(tensors: list[torch.Tensor], fmt: Format) -> str:
    """``preserves`` / ``drops`` / ``mixed`` over tensors whose format is unambiguous about
    ``fmt``; ``n/a`` when none is (no tensor of the rank, or all ambiguous)."""
    keep = drop = 0
    for t in tensors:
        answer = format_of(t)
        if answer is fmt:
            keep += 1
        elif not in_format(answer, fmt):  # ambiguous answers that include fmt tell nothing
            drop += 1
    if keep and drop:
        return "mixed"
    return "preserves" if keep else "drops" if drop else "n/a"


def _of_rank(obj: Any, rank: int) -> list[torch.Tensor]:
    return [t for t in iter_tensors(obj) if t.dim() == rank and t.layout == torch.strided]


_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)
_NONDETERMINISTIC = getattr(torch.Tag, "nondeterministic_bitwise", None)


class Watch(ObservingMode):
    """Sees every aten call of a run: notes random and nondeterministic ops (by their tags),
    and, given ``counts``, records per aten op whether calls with an input in ``fmt`` gave
    outputs in it (``counts["aten.relu"]["preserves"]``). Thin: it calls the op, then only
    reads tags and strides; it changes nothing.
    """

    def __init__(self, fmt: Format, counts: dict[str, Counter[str]] | None = None) -> None:
        super().__init__()
        self.fmt, self.rank, self.counts = fmt, fmt.rank or 4, counts
        self.phase = "forward"
        self.seeded = self.nondeterministic = False

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        tags = getattr(func, "tags", ())
        self.seeded = self.seeded or _SEEDED in tags
        self.nondeterministic = self.nondeterministic or _NONDETERMINISTIC in tags
        if self.counts is not None:
            ins = _of_rank((args, kwargs), self.rank)
            if any(format_of(t) is self.fmt for t in ins):
                verdict = _classify(_of_rank(out, self.rank), self.fmt)
                if verdict != "n/a":
                    c = self.counts.setdefault(str(func.overloadpacket), Counter())
                    c[verdict] += 1
                    c["phase:" + self.phase] += 1


@dataclass
class _Run:
    out: Any = None
    error: str | None = None
    grads: list[torch.Tensor | None] = field(default_factory=list)
    grad_error: str | None = None
    grad_labels: list[str] = field(default_factory=list)
    grad_converted: list[bool] = field(default_factory=list)
    informative: bool = False
    seeded: bool = False  # an aten op tagged nondeterministic_seeded ran (dropout, randn)
    nondeterministic: bool = False  # an aten op tagged nondeterministic_bitwise ran


def _message(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


@dataclass(frozen=True)
class _How:
    """How to run a sample: tensors of ``rank`` in ``fmt``; floating tensors cast to ``cast``
    (the float64 reference run); ``seed`` for the op's own random numbers, ``grad_seed`` for
    the gradients fed to backward, rounded to ``nominal`` (the dtype under test) so that every
    run of a sample, the float64 one included, gets the same values."""

    fmt: Format
    rank: int
    seed: int
    grad_seed: int
    nominal: torch.dtype
    backward: bool
    cast: torch.dtype | None = None


def _grad_output(o: torch.Tensor, how: _How) -> torch.Tensor:
    """Gradient fed to backward for output ``o``, laid out like ``o`` (as the next layer's
    gradient would be)."""
    if o.is_complex():
        g = torch.randn(o.shape, dtype=torch.complex64, device=o.device)
    else:
        g = torch.randn(o.shape, dtype=torch.float32, device=o.device).to(how.nominal)
    return torch.empty_like(o).copy_(g)


def _run(op: Any, sample: Sample, how: _How, counts: dict[str, Counter[str]] | None = None,
         step: Callable[[str], None] | None = None) -> _Run:
    """One run of ``sample``, every tensor a fresh copy (in-place ops cannot leak); aten ops
    recorded into ``counts`` when given (see ``Watch``); ``step("contiguous forward")`` called
    before each half."""
    label = how.fmt.value + (f" {torch_name(how.cast)}" if how.cast else "")
    run = _Run()
    grad_leaves: list[torch.Tensor] = []

    def convert(label: str):
        def fn(t: torch.Tensor) -> torch.Tensor:
            c = t.detach().clone()
            if how.cast is not None and (c.is_floating_point() or c.is_complex()):
                c = c.to(how.cast if c.is_floating_point() else torch.complex128)
            converted = t.layout == torch.strided and t.dim() == how.rank
            if converted:
                c = to_format(c, how.fmt)
                run.informative = run.informative or format_of(c) is how.fmt
            if t.requires_grad:
                c.requires_grad_(True)
                grad_leaves.append(c)
                run.grad_labels.append(label)
                run.grad_converted.append(converted and format_of(c) is how.fmt)
            return c
        return fn

    inp = map_tensors(sample.input, convert("input"))
    args = tuple(map_tensors(a, convert(f"arg {i}")) for i, a in enumerate(sample.args))
    kwargs = {k: map_tensors(v, convert(f"{k}=")) for k, v in sample.kwargs.items()}
    watch = Watch(how.fmt, counts)
    if step is not None:
        step(f"{label} forward")
    torch.manual_seed(how.seed)
    try:
        with watch:
            run.out = op.op(inp, *args, **kwargs)
    except SampleTimeout:
        raise
    except Exception as exc:
        run.error = _message(exc)
        return run
    finally:
        run.seeded, run.nondeterministic = watch.seeded, watch.nondeterministic
    if not (how.backward and grad_leaves):
        return run
    try:
        diff = [o for o in iter_tensors(sample.output_process_fn_grad(run.out)) if o.requires_grad]
        if not diff:
            return run
        torch.manual_seed(how.grad_seed)
        gos = [_grad_output(o, how) for o in diff]
        watch.phase = "backward"
        if step is not None:
            step(f"{label} backward")
        with watch:
            run.grads = list(torch.autograd.grad(diff, grad_leaves, gos, allow_unused=True))
    except SampleTimeout:
        raise
    except Exception as exc:
        run.grad_error = _message(exc)
    finally:
        run.seeded = run.seeded or watch.seeded
        run.nondeterministic = run.nondeterministic or watch.nondeterministic
    return run


def _flat(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _flat(v)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _flat(v)]
    return [obj]


def _results(run: _Run, grads: bool = True) -> dict[str, Any]:
    """A run's outputs and input gradients by label (``output 0``, ``grad of input``)."""
    found: dict[str, Any] = {f"output {i}": x for i, x in enumerate(_flat(run.out))}
    for label, g in zip(run.grad_labels, run.grads if grads else (), strict=False):
        if g is not None:
            found[f"grad of {label}"] = g
    return found


def _dense(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_dense() if t.layout != torch.strided else t


def _compare(a: Any, b: Any) -> tuple[float, float, int, int] | None:
    """``None`` when ``a`` (channels-last run) equals ``b`` (contiguous run) within the dtype's
    tolerance, NaN equal to NaN; else (max abs error, max rel error, mismatched, numel).

    >>> _compare(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")])) is None
    True
    >>> _compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
    (0.5, 0.2, 1, 2)
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            n = max(a.numel(), b.numel())
            return (math.inf, math.inf, n, n)
        a, b = _dense(a), _dense(b)
        if a.is_floating_point() or a.is_complex():
            rtol, atol = tolerance(a.dtype, Compared.OP)
            close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        else:
            close = a == b
        bad = int((~close).sum())
        if not bad:
            return None
        wide = torch.complex128 if a.is_complex() else torch.float64
        diff = (a.to(wide) - b.to(wide)).abs()[~close]
        ref = b.to(wide).abs()[~close]
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
        rel = diff / ref.clamp_min(1e-30)
        return (float(diff.max()), float(rel.max()), bad, a.numel())
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (math.inf, math.inf, 1, 1)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else (math.inf, math.inf, 1, 1)


def _differences(cl: _Run, ref: _Run) -> dict[str, tuple[float, float, int, int]]:
    """What differs between two runs of a sample, by label (gradients only when both runs'
    backward worked)."""
    grads = not (cl.grad_error or ref.grad_error)
    a, b = _results(cl, grads), _results(ref, grads)
    if a.keys() != b.keys():
        return {"outputs": (math.inf, math.inf, 1, 1)}
    found = {}
    for label in a:
        d = _compare(a[label], b[label])
        if d is not None:
            found[label] = d
    return found


def _error_vs(x: torch.Tensor, r: torch.Tensor) -> float:
    """Largest |x - r| over finite values (``r`` the float64 reference)."""
    x, r = _dense(x).to(r.dtype), _dense(r)
    d = (x - r).abs()
    d = torch.where(torch.isfinite(x) & torch.isfinite(r), d, torch.zeros_like(d))
    return float(d.max()) if d.numel() else 0.0


def _as_accurate(cl: _Run, ref: _Run, r64: _Run, labels: list[str]) -> bool:
    """Whether, for every differing result, the channels-last run is about as accurate as the
    contiguous one against a float64 run: same NaN and inf positions, and a largest error at
    most 4x the contiguous run's plus the dtype's tolerance at the result's scale
    (atol + rtol * max |reference|). Kernels that sum in another order differ this way; a
    layout bug (values from the wrong place) does not pass."""
    a, b, r = _results(cl), _results(ref), _results(r64)
    for label in labels:
        x, y, z = a.get(label), b.get(label), r.get(label)
        if not all(isinstance(t, torch.Tensor) for t in (x, y, z)):
            return False
        if not (x.is_floating_point() or x.is_complex()) or x.shape != z.shape:
            return False
        x, y = _dense(x), _dense(y)
        if not (torch.equal(torch.isnan(x), torch.isnan(y))
                and torch.equal(torch.isinf(x), torch.isinf(y))):
            return False
        wide = torch.complex128 if z.is_complex() else torch.float64
        z = _dense(z).to(wide)
        rtol, atol = tolerance(x.dtype, Compared.OP)
        finite = z[torch.isfinite(z)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        if _error_vs(x, z) > 4 * _error_vs(y, z) + atol + rtol * scale:
            return False
    return True


@dataclass
class _Tally:
    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    values: list[Values] = field(default_factory=list)
    grads: list[Values] = field(default_factory=list)
    out_formats: Counter[str] = field(default_factory=Counter)
    grad_formats: Counter[str] = field(default_factory=Counter)
    disagreements: list[Disagreement] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    error_samples: int = 0
    rejected: int = 0
    rejected_msg: str = ""
    backward_errors: int = 0
    cl_only_errors: int = 0
    accuracy_only: int = 0  # beyond assert_close tolerance, as accurate as contiguous

    def error(self, msg: str) -> None:
        self.error_samples += 1
        if msg not in self.errors and len(self.errors) < _MAX_ERRORS:
            self.errors.append(msg)


def _judge(op: Any, idx: int, sample: Sample, fmt: Format, dtype: torch.dtype, backward: bool,
           float64: bool, counts: dict[str, Counter[str]], tally: _Tally,
           step: Callable[[str], None] | None = None) -> None:
    rank = fmt.rank or 4
    how = _How(Format.CONTIGUOUS, rank, _SEED + idx, _SEED - idx, dtype, backward)
    ref = _run(op, sample, how, step=step)
    cl = _run(op, sample, dataclasses.replace(how, fmt=fmt), counts, step)
    if ref.error is not None:
        if sample.lifted:  # memlayout's own call: the op does not accept it at all
            tally.rejected += 1
            tally.rejected_msg = tally.rejected_msg or ref.error
        elif cl.error is not None:
            tally.error(ref.error)
        else:
            tally.error(f"fails only in contiguous form: {ref.error}")
        return
    if cl.error is not None:
        tally.cl_only_errors += 1
        tally.error(f"fails only in {fmt.value}: {cl.error}")
        return
    outs = _of_rank(cl.out, rank)
    tally.out_formats.update(format_name(format_of(t)) for t in outs)
    tally.forward.append(_classify(outs, fmt) if cl.informative else "n/a")
    grads_in_fmt = [g for g, conv in zip(cl.grads, cl.grad_converted, strict=False)
                    if conv and g is not None and g.layout == torch.strided and g.dim() == rank]
    tally.grad_formats.update(format_name(format_of(g)) for g in grads_in_fmt)
    if cl.grad_error or ref.grad_error:
        tally.backward_errors += 1
        only_cl = cl.grad_error and not ref.grad_error
        tally.cl_only_errors += bool(only_cl)
        tally.error(f"backward fails only in {fmt.value}: {cl.grad_error}" if only_cl
                    else f"backward: {ref.grad_error}")
    elif backward:
        tally.backward.append(_classify(grads_in_fmt, fmt) if grads_in_fmt else "n/a")
    has_grads = any(g is not None for g in cl.grads)

    def verdict(values: Values, grads: Values) -> None:
        tally.values.append(values)
        if has_grads:
            tally.grads.append(grads)

    diffs = _differences(cl, ref)
    if not diffs:
        return verdict(Values.AGREE, Values.AGREE)
    if cl.seeded or ref.seeded:  # dropout draws its mask in memory order: not a bug
        return verdict(Values.RANDOM, Values.RANDOM)
    if op.name in LAYOUT_DEFINED:
        return verdict(Values.NOT_COMPARABLE, Values.NOT_COMPARABLE)
    if cl.nondeterministic or ref.nondeterministic or _differences(_run(op, sample, how, step=step), ref):
        return verdict(Values.NONDETERMINISTIC, Values.NONDETERMINISTIC)
    if float64:
        r64 = _run(op, sample, dataclasses.replace(how, cast=torch.float64), step=step)
        if r64.error is None and _as_accurate(cl, ref, r64, list(diffs)):
            tally.accuracy_only += 1
            return verdict(Values.AGREE, Values.AGREE)
    call = describe(sample)
    for what, (mabs, mrel, bad, numel) in diffs.items():
        tally.disagreements.append(Disagreement(idx, what, mabs, mrel, bad, numel, call))
    out_bad = any(not w.startswith("grad") for w in diffs)
    grad_bad = any(w.startswith("grad") for w in diffs)
    verdict(Values.DISAGREE if out_bad else Values.AGREE,
            Values.DISAGREE if grad_bad else Values.AGREE)


def _values_verdict(found: list[Values]) -> Values:
    for v in (Values.DISAGREE, Values.RANDOM, Values.NONDETERMINISTIC, Values.NOT_COMPARABLE,
              Values.AGREE):
        if v in found:
            return v
    return Values.NOT_APPLICABLE


def check_op(op: Any, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
             fmt: Format = Format.CHANNELS_LAST, max_samples: int = 24,
             sample_timeout: float | None = 20.0, op_budget: float | None = 60.0,
             on_step: Callable[[int, Sample, str], None] | None = None,
             skip: Collection[int] = ()) -> OpRecord:
    """Coverage record of one OpInfo op on ``device`` in ``dtype``: its samples (at most
    ``max_samples``, each cut at ``sample_timeout`` s, all cut at ``op_budget`` s) run in
    contiguous form and in ``fmt``. ``on_step(index, sample, "channels_last backward")`` is called
    before each run (the runner uses it to say where a worker crashed); samples whose index is
    in ``skip`` are left out (they crashed a worker before)."""
    start = time.perf_counter()
    name = op_name(op)
    device_type = torch.device(device).type
    counts: dict[str, Counter[str]] = {}

    def record(forward: Verdict, backward: Verdict, notes: tuple[str, ...] = (),
               errors: tuple[str, ...] = (), **kw: Any) -> OpRecord:
        return OpRecord(name=name, forward=forward, backward=backward,
                        values=kw.pop("values", Values.NOT_APPLICABLE),
                        grads=kw.pop("grads", Values.NOT_APPLICABLE), notes=notes, errors=errors,
                        aten={k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
                        seconds=round(time.perf_counter() - start, 3), **kw)

    na = Verdict.NOT_APPLICABLE
    if dtype not in op.supported_dtypes(device_type):
        return record(na, na, (f"{torch_name(dtype)} not supported on {device_type}",))
    backward = bool(op.supports_autograd) and dtype in op.supported_backward_dtypes(device_type)
    float64 = dtype != torch.float64 and torch.float64 in op.supported_dtypes(device_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(sample_timeout):
                samples, lifted = samples_for(op, device, dtype, fmt, requires_grad=backward,
                                              max_samples=max_samples)
        except Exception as exc:
            msg = f"OpInfo samples: {_message(exc)}"
            return record(Verdict.ERROR, Verdict.ERROR if backward else na, errors=(msg,))
        tally = _Tally()
        stopped = None
        for idx, sample in enumerate(samples):
            if op_budget and time.perf_counter() - start > op_budget:
                stopped = idx
                break
            if idx in skip:
                continue
            step = None if on_step is None else functools.partial(on_step, idx, sample)
            try:
                with time_limit(sample_timeout):
                    _judge(op, idx, sample, fmt, dtype, backward, float64, counts, tally, step)
            except SampleTimeout as exc:
                tally.error(str(exc))
    notes = _notes(op, tally, samples=len(samples), lifted=lifted, stopped=stopped,
                   op_budget=op_budget, fmt=fmt, dtype=dtype, backward=backward)
    forward_v, backward_v = _verdicts(tally, backward)
    return record(
        forward_v, backward_v, notes, tuple(tally.errors),
        values=_values_verdict(tally.values), grads=_values_verdict(tally.grads),
        samples=len(samples), lifted=lifted,
        forward_counts=dict(Counter(tally.forward)), backward_counts=dict(Counter(tally.backward)),
        output_formats=dict(tally.out_formats), grad_formats=dict(tally.grad_formats),
        disagreements=tuple(tally.disagreements[:10]), error_samples=tally.error_samples,
        rejected_samples=tally.rejected,
    )


def _notes(op: Any, tally: _Tally, *, samples: int, lifted: bool, stopped: int | None,
           op_budget: float | None, fmt: Format, dtype: torch.dtype,
           backward: bool) -> tuple[str, ...]:
    """What a record says beside its verdicts: samples missing, lifted, cut short, rejected,
    failing; values that differ only in accuracy, or by definition; no backward."""
    rank = fmt.rank or 4
    notes = []
    if not samples:
        notes.append(f"no sample with a rank-{rank} tensor")
    elif lifted:
        notes.append(f"samples lifted to rank {rank} by memlayout (OpInfo has none)")
    if stopped is not None:
        notes.append(f"stopped after {stopped} of {samples} samples (time budget {op_budget:g} s)")
    if tally.rejected:
        notes.append(f"{tally.rejected} lifted samples rejected by the op: {tally.rejected_msg[:120]}")
    if tally.accuracy_only:
        notes.append(f"{tally.accuracy_only} samples differ beyond assert_close tolerance but are "
                     f"as accurate as contiguous against float64")
    if tally.cl_only_errors:
        notes.append(f"{tally.cl_only_errors} samples fail only in {fmt.value} "
                     f"(forward or backward)")
    if tally.error_samples:
        notes.append(f"{tally.error_samples} of {samples} samples raised")
    if op.name in LAYOUT_DEFINED:
        notes.append("values depend on the layout by definition (raw storage or uninitialized "
                     "memory): differences not comparable")
    if not backward:
        notes.append("no autograd" if not op.supports_autograd
                     else f"no backward in {torch_name(dtype)}")
    return tuple(notes)


def _verdicts(tally: _Tally, backward: bool) -> tuple[Verdict, Verdict]:
    """The forward and backward verdicts of the samples judged: an error where every sample
    that ran raised."""
    na = Verdict.NOT_APPLICABLE
    forward_v = Verdict.combine(tally.forward)
    if forward_v is na and tally.error_samples and not tally.forward:
        forward_v = Verdict.ERROR
    backward_v = Verdict.combine(tally.backward) if backward else na
    if backward and backward_v is na and tally.backward_errors:
        backward_v = Verdict.ERROR
    return forward_v, backward_v
