"""Blocked layouts inside PyTorch: do oneDNN's blocked activations or Inductor's CPU options close
the gap to the peer runtimes?

Per model and dtype, in one process, timed interleaved round by round
(``memlayout.timing.interleaved``), every mode verified against eager NCHW first
(``memlayout.plan.compare`` tolerances; a mode that differs is reported, not timed):

- ``compile``: ``torch.compile`` with Inductor's defaults (the reference of the ratios);
- ``freezing``: ``torch._inductor.config.freezing=True`` (weights become constants: folded
  batch norms, oneDNN-prepacked convolution weights run by ``mkldnn._convolution_pointwise``
  with fused activations, on strided channels-last activations);
- ``freezing+cpp_wrapper``: the same, with the C++ wrapper instead of Python between kernels;
- ``max_autotune`` (``--autotune``): ``mode="max-autotune"`` (slow to compile on a small CPU);
- ``mkldnn``: ``torch.utils.mkldnn.to_mkldnn`` (prepacked weights, blocked ``nChw16c``
  activations) over the largest region that runs in mkldnn tensors: the whole model where it
  can, else the convolutional trunk (``features`` / everything before the pooling head), one
  ``to_mkldnn`` in, one ``to_dense`` out;
- ``openvino``: the peer runtime (``memlayout.runtimes``), for scale.

Ratios are ``compile`` time / mode time per round (> 1: the mode is faster than torch.compile).
bf16 is autocast for the torch modes, the runtime's own bf16 for OpenVINO, bf16 weights and
activations for mkldnn.

    python benchmarks/inside_torch.py --models torchvision:resnet18,torchvision:mobilenet_v2 \
        --dtypes fp32,bf16 --batch 2 --image-size 96 --rounds 7 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memlayout import runtimes
from memlayout.dtypes import autocast, parse_dtype
from memlayout.machine import Conditions
from memlayout.models import load_model
from memlayout.plan.compare import compare
from memlayout.timing import interleaved


def _compiled(model: nn.Module, options: dict[str, Any] | None = None,
              mode: str | None = None) -> nn.Module:
    work = copy.deepcopy(model).eval()
    return torch.compile(work, options=options) if options else torch.compile(work, mode=mode)


class _MkldnnRegion(nn.Module):
    """``trunk`` in mkldnn tensors (one ``to_mkldnn`` in, one ``to_dense`` out), then ``head``
    strided."""

    def __init__(self, trunk: nn.Module, head: Callable[[torch.Tensor], Any],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.trunk, self.head, self.dtype = trunk, head, dtype

    def forward(self, x: torch.Tensor) -> Any:
        y = self.trunk(x.to(self.dtype).to_mkldnn()).to_dense()
        return self.head(y.float())


def _mkldnn(model: nn.Module, dtype: torch.dtype | None) -> list[tuple[nn.Module, str]]:
    """Regions of ``model`` to run in mkldnn tensors, largest first, each with its name."""
    from torch.utils import mkldnn

    dt = dtype or torch.float32
    work = copy.deepcopy(model).eval()
    whole = mkldnn.to_mkldnn(copy.deepcopy(work), dt)
    trunk = getattr(work, "features", None)
    if trunk is None:  # resnets: everything before the average pool
        names = [n for n, _ in work.named_children()]
        cut = names.index("avgpool")
        trunk = nn.Sequential(*[getattr(work, n) for n in names[:cut]])
        rest = nn.Sequential(*[getattr(work, n) for n in names[cut:-1]])
        fc = names[-1]

        def head(y: torch.Tensor) -> Any:
            return getattr(work, fc)(torch.flatten(rest(y), 1))
    else:
        def head(y: torch.Tensor) -> Any:
            pooled = nn.functional.adaptive_avg_pool2d(y, 1).flatten(1)
            return work.classifier(pooled)
    return [(_MkldnnRegion(whole, lambda y: y, dt), "whole model"),
            (_MkldnnRegion(mkldnn.to_mkldnn(trunk, dt), head, dt), "trunk")]


def case(spec_name: str, dtype_name: str, args: argparse.Namespace) -> list[str]:
    spec = load_model(spec_name, batch=args.batch, image_size=args.image_size)
    model, x = spec.module.eval(), spec.example_input.contiguous()
    dtype = parse_dtype(dtype_name, allowed=("fp32", "bf16"))
    with torch.no_grad(), autocast("cpu", dtype):
        want = model(x)
    candidates: dict[str, Callable[[], Any]] = {
        "compile": lambda: _compiled(model),
        "freezing": lambda: _compiled(model, {"freezing": True}),
        "freezing+cpp_wrapper": lambda: _compiled(model, {"freezing": True, "cpp_wrapper": True}),
    }
    if args.autotune:
        candidates["max_autotune"] = lambda: _compiled(model, mode="max-autotune")
    built: dict[str, Callable[[], Any]] = {}
    lines = []
    for name, make in candidates.items():
        start = time.perf_counter()
        try:
            m = make()
            with torch.no_grad(), autocast("cpu", dtype):
                got = m(x)
        except Exception as exc:  # a mode that fails is a finding
            lines.append(f"  {name}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        ok, worst, _ = compare(want, got, dtype)
        lines.append(f"  {name}: build + first call {time.perf_counter() - start:.1f} s, "
                     f"output vs eager {worst:.2g}{'' if ok else ' OUTSIDE tolerance: not timed'}")
        if ok:
            built[name] = (lambda m=m: _infer(m, x, dtype))
    for m, what in _mkldnn(model, dtype):
        try:
            with torch.no_grad():
                got = m(x)
        except Exception as exc:
            lines.append(f"  mkldnn ({what}): failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        ok, worst, _ = compare(want, got, dtype)
        lines.append(f"  mkldnn ({what}): output vs eager {worst:.2g}"
                     f"{'' if ok else ' OUTSIDE tolerance: not timed'}")
        if ok:
            built[f"mkldnn ({what})"] = (lambda m=m: _infer(m, x, None))
            break
    if runtimes.available("openvino") is None:
        rt = runtimes.build_runtime(model, x, runtimes.RuntimeOptions("openvino", dtype))
        built["openvino"] = lambda: rt(x)
    before = Conditions.now()
    timing = interleaved(built, rounds=args.rounds, warmup=1, baseline="compile")
    after = Conditions.now()
    lines.insert(0, f"{spec_name} {dtype_name}, batch {args.batch}, {args.image_size} px, "
                    f"{args.rounds} rounds; {before.describe()} -> {after.describe()}")
    for name in built:
        t = timing[name]
        if not t.ok:
            lines.append(f"  {name}: timing failed: {t.error}")
            continue
        r = timing.ratios(name)
        lines.append(f"  | {name} | {t.median * 1e3:.1f} ms | {statistics.median(r):.3f} "
                     f"({min(r):.3f}-{max(r):.3f}) |")
    return lines


def _infer(m: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> Any:
    with torch.no_grad(), autocast("cpu", dtype):
        return m(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="torchvision:resnet18,torchvision:mobilenet_v2")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--autotune", action="store_true", help="also max-autotune (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; ratio = compile time / mode time "
          "per round, median (min-max)")
    for spec in args.models.split(","):
        for dtype in args.dtypes.split(","):
            for line in case(spec, dtype, args):
                print(line, flush=True)


if __name__ == "__main__":
    main()
