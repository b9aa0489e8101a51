"""Padded channels (L2 plan, after rewrite): a convolution may run with its channel counts
rounded up to the hardware's vector width, where that measures faster.

oneDNN, cuDNN, TensorRT (kHWC8) and ONNX Runtime (NCHWc) all prefer channel counts that are a
multiple of a block ``k`` (8 floats for AVX2, 16 for AVX-512, 8 halves for tensor cores). A
convolution with ``C_in`` or ``C_out`` not a multiple of ``k`` can run padded: the input gets
``k``-rounded zero channels (and the weights zero input slices), the weights get extra zero
filters (the output extra channels, all zero), and the output is cropped back to the true
``C_out`` before anything else sees it. Zeros contribute nothing, so the values are those of the
unpadded convolution (up to summation order); the planner's verification compares them.

Per candidate convolution (``groups == 1``, 2-D) each variant -- unpadded, inputs padded,
outputs padded, both -- for each ``k`` of :func:`block_sizes` is timed on the input it receives
in the planned model, pad and crop included, interleaved through ``memlayout.timing`` (a
``Race`` against unpadded, with each variant's fastest round: :class:`PadTiming`); a padded
variant is chosen only when both its minimum and the median of its per-round ratios beat
unpadded by ``margin`` (see :func:`decide`), and kept only when the whole model with every
chosen padding then runs faster than without (``whole_model_ratio``). Timings are
cached in the cost cache (keyed by device, torch version, dtype, convolution, input layout and
variant). ``PaddedConv2d`` is an ``nn.Conv2d`` with the same parameters (so ``state_dict``
keys and shapes are the original's) and the padded weights in non-persistent buffers.

>>> import torch
>>> conv = torch.nn.Conv2d(3, 5, 3).eval()
>>> padded = PaddedConv2d.from_conv(conv, pad_in=16, pad_out=8)
>>> padded.padded_weight.shape
torch.Size([8, 16, 3, 3])
>>> x = torch.randn(1, 3, 6, 6)
>>> torch.allclose(padded(x), conv(x), atol=1e-6), padded(x).shape == conv(x).shape
(True, True)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from memlayout.devices import Device, seam
from memlayout.dtypes import autocast
from memlayout.machine import CpuIsa
from memlayout.plan.capture.calls import first_inputs
from memlayout.plan.check.guard import RACE, save, stored, time_candidates
from memlayout.plan.costs.cache import CostCache
from memlayout.plan.costs.table import measured_on
from memlayout.plan.graph import Label
from memlayout.plan.options import Progress, RunOptions
from memlayout.plan.report.records import UNPADDED, PadChoice, decode
from memlayout.plan.steer.boundary import padded_convolution, padded_weights
from memlayout.plan.steer.build import Build, build, user_path
from memlayout.plan.steer.state import Formats
from memlayout.plan.steer.steering import planned_state
from memlayout.tensors import device_of
from memlayout.timing import Race, interleaved, repeats_for

#: the whole model with every chosen padding, in :func:`whole_model_ratio`'s race
PADDED = "padded"


def block_sizes(device: torch.device | str, dtype: torch.dtype | None,
                isa: CpuIsa | None = None) -> tuple[int, ...]:
    """The channel multiples worth trying here: CUDA fp16/bf16 8 (tensor cores), CUDA fp32
    4 and 8; a CPU (``isa``, default this one's) with AVX-512 16 and 8, with AVX2 8, else 4.

    >>> block_sizes("cpu", None, CpuIsa("AVX512")), block_sizes("cpu", None, CpuIsa("AVX2"))
    ((16, 8), (8,))
    """
    return seam(device).channel_blocks(dtype, isa)


def _round_up(c: int, k: int) -> int:
    return -(-c // k) * k


def variants(conv: nn.Conv2d, blocks: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """Padded variants of ``conv``: name -> (padded C_in, padded C_out); empty when none
    applies (grouped, transposed, or channels already multiples).

    >>> variants(torch.nn.Conv2d(3, 24, 3), (16, 8))
    {'in16': (16, 24), 'out16': (3, 32), 'both16': (16, 32), 'in8': (8, 24)}
    """
    if not _eligible(conv):
        return {}
    cin, cout = conv.in_channels, conv.out_channels
    out: dict[str, tuple[int, int]] = {}
    for k in blocks:
        pin, pout = _round_up(cin, k), _round_up(cout, k)
        if pin != cin:
            out[f"in{k}"] = (pin, cout)
        if pout != cout:
            out[f"out{k}"] = (cin, pout)
        if pin != cin and pout != cout:
            out[f"both{k}"] = (pin, pout)
    return out


def _eligible(conv: nn.Module) -> bool:
    return (type(conv) is nn.Conv2d and conv.groups == 1 and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str))


class PaddedConv2d(nn.Conv2d):
    """``nn.Conv2d`` that runs with ``C_in`` padded to ``in_padded`` and ``C_out`` to
    ``out_padded`` (``memlayout.plan.steer.forward.padded_convolution``): what a padded
    variant is timed as, alone. Parameters are the original's (shared); the padded copies
    are made once. A planned model pads a convolution by steering it, not with this class."""

    in_padded: int
    out_padded: int

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, pad_in: int, pad_out: int) -> PaddedConv2d:
        """Wrap ``conv``'s parameters (shared, not copied); ``pad_in``/``pad_out``: the padded
        channel counts (``<=`` the true ones: unchanged)."""
        new = cls.__new__(cls)
        new.__dict__.update({k: v for k, v in conv.__dict__.items()
                             if k not in ("_parameters", "_buffers", "_modules")})
        new._parameters = dict(conv._parameters)
        new._buffers = dict(conv._buffers)
        new._modules = dict(conv._modules)
        new._non_persistent_buffers_set = set(conv._non_persistent_buffers_set)
        new.in_padded = max(pad_in, conv.in_channels)
        new.out_padded = max(pad_out, conv.out_channels)
        weight, bias = padded_weights(conv, new.in_padded, new.out_padded)
        new.register_buffer("padded_weight", weight, persistent=False)
        new.register_buffer("padded_bias", bias, persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return padded_convolution(self, x, self.padded_weight, self.padded_bias,
                                  self.in_padded, self.out_padded)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", padded=({self.in_padded}, {self.out_padded})"


def plan_padding(model: nn.Module, inputs: tuple[Any, ...], *,
                 padded: Callable[[dict[str, tuple[int, int]]], nn.Module] | None = None,
                 dtype: torch.dtype | None = None,
                 cache: Any = None, rounds: int = 5, margin: float = 0.02,
                 progress: Progress | None = None, blocks: tuple[int, ...] | None = None,
                 force: str | None = None, signature: str | None = None,
                 device: torch.device | None = None) -> list[PadChoice]:
    """Measure every eligible convolution of ``model`` (a planned model, run as it will run)
    unpadded and padded, and choose a padded variant where it is faster by ``margin``; keep
    the choices only if ``padded(choices)`` (a copy of ``model`` running those convolutions
    padded: ``{path: (C_in, C_out) padded}``) then runs faster as a whole model. ``force``: a
    variant name (``"both16"``) chosen wherever it exists, unmeasured (tests). ``signature``:
    the plan's (see ``memory.plan_signature``): the choices are cached under it, so a second
    plan of the same model pads from the cache without running it. Returns one
    :class:`PadChoice` per candidate convolution (``padded_channels`` gives what to pad).
    ``device``: where it runs (default: the inputs')."""
    device = device_of(inputs, model) if device is None else device
    blocks = blocks or block_sizes(device, dtype)
    convs = {path: m for path, m in model.named_modules(remove_duplicate=True)
             if path and variants(m, blocks)}
    if not convs:
        return []
    context = [measured_on(device), torch.__version__, str(dtype)]
    whole_key = None
    if cache is not None and signature is not None and force is None:
        whole_key = json.dumps(["pad-plan", *context, signature, blocks, rounds, margin])
        cached = cache.get(whole_key, _valid_choices)
        if cached is not None:
            return [dataclasses.replace(PadChoice.from_dict(c), source="cache") for c in cached]
    choices = _plan_padding(model, inputs, convs, padded=padded, dtype=dtype, cache=cache,
                            rounds=rounds, margin=margin, progress=progress, blocks=blocks,
                            force=force, context=context, device=device)
    if whole_key is not None:
        cache.put(whole_key, [asdict(c) for c in choices])
    return choices


def padded_channels(model: nn.Module, choices: list[PadChoice],
                    blocks: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """The padded ``(C_in, C_out)`` of each chosen convolution of ``model``, by path;
    ``KeyError`` when a choice is no variant of that convolution here (another vector width)."""
    return {c.module: variants(model.get_submodule(c.module), blocks)[c.chosen]
            for c in choices if c.chosen != UNPADDED}


def _plan_padding(model: nn.Module, inputs: tuple[Any, ...], convs: dict[str, nn.Module], *,
                  padded: Callable[[dict[str, tuple[int, int]]], nn.Module] | None,
                  dtype: torch.dtype | None, cache: Any, rounds: int, margin: float,
                  progress: Progress | None, blocks: tuple[int, ...], force: str | None,
                  context: list[str], device: torch.device) -> list[PadChoice]:
    seen = first_inputs(model, inputs, convs, dtype=dtype, device=device)
    on = seam(device)
    choices: list[PadChoice] = []
    chosen_channels: dict[str, tuple[int, int]] = {}
    for i, (path, conv) in enumerate(convs.items()):
        x = seen.get(path)
        if x is None or x.dim() != 4:
            continue  # not called in this forward (or not on a 4-D input): nothing to decide
        if progress is not None:
            progress(i + 1, len(convs), f"{path} (padded channels)")
        options = variants(conv, blocks)
        fmt = "channels_last" if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else "contiguous"
        key = json.dumps(["pad", RACE, *context, repr(conv), list(x.shape), list(x.stride()),
                          str(x.dtype), sorted(options), rounds])
        timed = _stored(cache, key) if cache is not None and force is None else None
        source = "cache"
        if force is not None:
            timed = PadTiming(Race(UNPADDED, {}, rounds=0), dict.fromkeys([UNPADDED, *options]))
            source = "forced"
        elif timed is None:
            timed, source = _measure(conv, x, options, dtype, rounds, on, interleaved), "measured"
            if cache is not None and all(v is not None for v in timed.seconds.values()):
                cache.put(key, asdict(timed), spread=timed.spread)
        if force is not None:
            chosen = force if force in options else UNPADDED
        else:
            chosen = decide(timed.seconds, timed.race, margin)
        choices.append(PadChoice(path, conv.in_channels, conv.out_channels, list(x.shape), fmt,
                                 timed.seconds, chosen, source,
                                 {name: r.median for name, r in timed.race.ratios.items()}))
        if chosen != UNPADDED:
            chosen_channels[path] = options[chosen]
    if not chosen_channels or padded is None:
        return choices
    if force is None:
        # Ops timed alone can disagree with the model (noise, caches): keep the padding only
        # if the whole model runs faster with it than without.
        key = json.dumps(["pad-model", RACE, *context,
                          [(c.module, c.chosen, c.input_shape) for c in choices], rounds])
        ratio = whole_model_ratio(model, padded(chosen_channels), inputs, dtype=dtype,
                                  device=device, rounds=rounds, cache=cache, key=key)
        if ratio is None or ratio <= 1.0:
            return [dataclasses.replace(c, chosen=UNPADDED, reverted=c.chosen, whole_model=ratio)
                    if c.chosen != UNPADDED else c for c in choices]
        choices = [dataclasses.replace(c, whole_model=ratio) if c.chosen != UNPADDED else c
                   for c in choices]
    return choices


def whole_model_ratio(model: nn.Module, padded: nn.Module, inputs: tuple[Any, ...], *,
                      dtype: torch.dtype | None, rounds: int, cache: Any = None,
                      key: str | None = None, device: torch.device | None = None) -> float | None:
    """Median of per-round ``model / padded`` whole-model times (``guard.time_candidates``,
    interleaved), or ``None`` when the padded model fails; the race is cached under ``key``."""
    race = stored(cache, key) if key is not None else None
    if race is None:
        race = time_candidates({UNPADDED: model, PADDED: padded}, inputs, dtype,
                               device=device_of(inputs, model) if device is None else device,
                               rounds=max(rounds, 3), reference=UNPADDED)
        if cache is not None and key is not None and PADDED in race.ratios:
            save(cache, key, race)
    return race.median(PADDED) if PADDED in race.ratios else None


@dataclass(frozen=True)
class PadTiming:
    """One convolution's variants timed interleaved: the race of each padded variant against
    ``unpadded``, each variant's fastest round in seconds per call (``None``: it failed), and
    the widest relative spread of their rounds (the cached entry's quality). The cache stores
    it as JSON (``dataclasses.asdict``)."""

    race: Race
    seconds: dict[str, float | None]
    spread: float | None = None


def _measure(conv: nn.Conv2d, x: torch.Tensor, options: dict[str, tuple[int, int]],
             dtype: torch.dtype | None, rounds: int, device: Device,
             interleaved: Callable[..., Any]) -> PadTiming:
    modules: dict[str, nn.Module] = {UNPADDED: conv}
    for name, (pin, pout) in options.items():
        modules[name] = PaddedConv2d.from_conv(conv, pad_in=pin, pad_out=pout)

    def call(m: nn.Module) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad(), autocast(x.device, dtype):
                return m(x)
        return run

    fns = {name: call(m) for name, m in modules.items()}
    sync = device.synchronize
    per_call = []
    for fn in fns.values():  # each variant warm before sizing (a GPU's first call autotunes)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        per_call.append(device.settle(fn, time.perf_counter() - start))
    repeat = repeats_for(min(per_call))
    result = interleaved(fns, rounds=rounds, warmup=0, repeat=repeat, sync=sync,
                         baseline=UNPADDED)
    unpadded = result[UNPADDED]
    ratios = {name: r for name in options
              if unpadded.ok and (r := result.ratio(UNPADDED, name)) is not None}
    race = Race(UNPADDED, ratios, rounds=len(unpadded.times), repeat=repeat,
                errors={n: t.error for n, t in result.modes.items() if t.error},
                reference_seconds=unpadded.median if unpadded.ok else None,
                spread=unpadded.spread if unpadded.ok else None)
    return PadTiming(race, {name: (t.min if t.ok else None) for name, t in result.modes.items()},
                     max((t.spread for t in result.modes.values() if t.ok), default=None))


def _stored(cache: CostCache, key: str) -> PadTiming | None:
    """The timing cached under ``key``, if one is."""
    value = cache.get(key, _is_timing)
    return None if value is None else _load(value)


def _load(value: Any) -> PadTiming:
    timed: PadTiming = decode(PadTiming, value, "padding")
    return timed


def _is_timing(value: Any) -> bool:
    """``value`` reads back as a :class:`PadTiming` with ``unpadded`` timed (the cache's check
    on read; one that raises is ignored and measured again)."""
    return UNPADDED in _load(value).seconds


def _valid_choices(record: Any) -> bool:
    """A cached list of a plan's padding choices that reads back as ``PadChoice`` records."""
    try:
        return isinstance(record, list) and all(
            isinstance(PadChoice.from_dict(c).seconds, dict) for c in record)
    except (TypeError, KeyError, AttributeError):
        return False


def decide(seconds: Mapping[str, float | None], race: Race, margin: float) -> str:
    """The variant to run: the padded one with the lowest minimum time when that beats
    unpadded by ``margin`` and the median of its per-round ratios (unpadded / padded) in
    ``race`` does too (a shared machine's noise can flatter one minimum); else ``unpadded``.

    >>> from memlayout.timing import Ratio
    >>> race = Race(UNPADDED, {"in16": Ratio(UNPADDED, "in16", 1.2, (1.2, 1.3, 1.1)),
    ...                        "out16": Ratio(UNPADDED, "out16", 1.1, (1.1, 1.1, 1.1))}, rounds=3)
    >>> decide({"unpadded": 1.0, "in16": 0.8, "out16": 0.9}, race, 0.02)
    'in16'
    >>> tie = Race(UNPADDED, {"in16": Ratio(UNPADDED, "in16", 1.0, (0.99, 0.99, 1.0))}, rounds=3)
    >>> decide({"unpadded": 1.0, "in16": 0.8}, tie, 0.02)
    'unpadded'
    """
    base = seconds.get(UNPADDED)
    timed = {n: s for n, s in seconds.items() if s is not None and n != UNPADDED}
    if base is None or not timed:
        return UNPADDED
    best = min(timed, key=timed.__getitem__)
    faster = (timed[best] < base * (1.0 - margin) and best in race.ratios
              and race.beats(best, UNPADDED, margin))
    return best if faster else UNPADDED


def padding_step(reference: nn.Module, built: Build, inputs: tuple[Any, ...],
                 options: RunOptions, store: CostCache | None, signature: str,
                 outputs: Formats) -> tuple[tuple[PadChoice, ...], Build]:
    """Convolutions padded to the vector width where that measures faster (inference only:
    a padded convolution's weights are copies made here, they would not train). Returns the
    choices and the build that runs them."""
    if not (options.padding and options.measure) or options.train:
        return (), built

    def padded(channels: dict[str, tuple[int, int]]) -> Build:
        steering = built.steering.padded({user_path(p, options): c for p, c in channels.items()})
        return dataclasses.replace(
            build(reference, steering, options, outputs=outputs, input_label=_entry(built),
                  label=built.label), nodes=built.nodes, conversions=built.conversions)

    blocks = block_sizes(options.device, options.dtype)
    choices = tuple(plan_padding(built.module, inputs, padded=lambda c: padded(c).module,
                                 dtype=options.dtype, cache=store, rounds=options.rounds,
                                 progress=options.progress, signature=signature,
                                 device=options.device, blocks=blocks))
    channels = padded_channels(built.module, list(choices), blocks)
    return choices, padded(channels) if channels else built


def _entry(built: Build) -> Label | None:
    """The format a build's inputs are converted to on entry (``None``: as they come)."""
    return planned_state(built.model).input_label
