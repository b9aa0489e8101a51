"""Blocked formats (L2 plan): mkldnn's opaque tensors as a measured, reported candidate.

oneDNN's fastest CPU kernels run on blocked layouts (``nChw16c``: channels padded to 16 and
stored in blocks of 16). PyTorch exposes them, inference only, as mkldnn tensors
(``Tensor.to_mkldnn``, ``torch.utils.mkldnn.to_mkldnn`` for Conv2d / BatchNorm / Linear).
Each maximal run of consecutive supported children of an ``nn.Sequential`` (convolutions,
batch norms, ReLUs, max pools) that contains a convolution is a *chain*; it is timed as the
planned model runs it and in mkldnn tensors (``to_mkldnn`` on entry and ``to_dense`` on exit
included), interleaved through ``memlayout.timing``, and its values compared. The result is
reported in ``plan.blocked``, including when mkldnn loses or this build has no mkldnn; chains
are not rewritten to mkldnn (opaque tensors do not flow through the rest of the graph).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch
from torch import nn

from memlayout.devices import seam
from memlayout.plan.capture.calls import first_inputs
from memlayout.plan.compare import worst_error
from memlayout.plan.costs.table import measured_on
from memlayout.plan.report.records import BlockedReport
from memlayout.tensors import device_of
from memlayout.timing import interleaved

_SUPPORTED: tuple[type[nn.Module], ...] = (nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d)
MAX_CHAINS = 12


def available() -> tuple[bool, str]:
    """Whether this build offers mkldnn tensors, and why not when it does not."""
    if not hasattr(torch.Tensor, "to_mkldnn"):
        return False, "this torch build has no Tensor.to_mkldnn"
    if not torch.backends.mkldnn.is_available():
        return False, "torch.backends.mkldnn.is_available() is False on this build"
    try:
        from torch.utils import mkldnn  # noqa: F401
    except ImportError as exc:
        return False, f"torch.utils.mkldnn cannot be imported ({exc})"
    return True, ""


def chains(model: nn.Module) -> list[tuple[str, list[str]]]:
    """``(sequential path, [child names])`` of every maximal supported run with a convolution.

    >>> seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 1))
    >>> chains(nn.Sequential(seq))
    [('0', ['0', '1']), ('0', ['3'])]
    """
    found: list[tuple[str, list[str]]] = []
    for path, m in model.named_modules():
        if not isinstance(m, nn.Sequential):
            continue
        run: list[str] = []
        for name, child in [*m.named_children(), ("", None)]:
            if child is not None and type(child) in _SUPPORTED and _ok(child):
                run.append(name)
                continue
            if any(type(m.get_submodule(n)) is nn.Conv2d for n in run):
                found.append((path, run))
            run = []
    return found


def _ok(m: nn.Module) -> bool:
    if isinstance(m, nn.Conv2d):
        return m.padding_mode == "zeros" and not isinstance(m.padding, str)
    if isinstance(m, nn.BatchNorm2d):
        return not m.training and m.track_running_stats
    return True


def measure_blocked(model: nn.Module, inputs: tuple[Any, ...], *, dtype: torch.dtype | None = None,
                    cache: Any = None, rounds: int = 5,
                    signature: str | None = None,
                    device: torch.device | None = None) -> BlockedReport:
    """Time each chain of ``model`` (as planned) against the same chain in mkldnn tensors;
    the plan's ``blocked`` record (cached whole under the plan's ``signature``, see
    ``memory.plan_signature``: a second plan of the same model runs nothing)."""
    ok, why = available()
    if not ok:
        return BlockedReport(False, why)
    device = device_of(inputs, model) if device is None else device
    if not seam(device).host:
        return BlockedReport(False, f"mkldnn tensors are CPU-only; the model runs on "
                                    f"{device.type}")
    if dtype is not None:
        return BlockedReport(True, f"not measured under autocast ({dtype}): mkldnn modules are "
                                   "measured in fp32 only")
    found = chains(model)
    if not found:
        return BlockedReport(True, _NO_CHAIN)
    whole_key = None
    if cache is not None and signature is not None:
        whole_key = json.dumps(["mkldnn-plan", measured_on(device), torch.__version__,
                                signature, rounds])
        cached = cache.get(whole_key, lambda r: isinstance(r, dict)
                           and isinstance(r.get("chains"), list)
                           and all(isinstance(c, dict) for c in r["chains"]))
        if cached is not None:
            cached["chains"] = [{**c, "source": "cache"} for c in cached["chains"]]
            return BlockedReport.from_dict(cached)
    firsts = {f"{path}:{names[0]}": model.get_submodule(path).get_submodule(names[0])
              for path, names in found}
    seen = first_inputs(model, inputs, firsts, dtype=None, device=device)
    out: list[dict[str, Any]] = []
    done: set[str] = set()
    for path, names in found:
        seq = model.get_submodule(path) if path else model
        x = seen.get(f"{path}:{names[0]}")
        if x is None or x.dtype != torch.float32 or x.dim() != 4:
            continue
        mods = [seq.get_submodule(n) for n in names]
        key = json.dumps(["mkldnn", measured_on(device), torch.__version__,
                          [repr(m) for m in mods], list(x.shape), list(x.stride()), rounds])
        if key in done:
            continue
        done.add(key)
        if len(out) >= MAX_CHAINS:
            break
        entry: dict[str, Any] = {"module": path, "children": names, "input_shape": list(x.shape),
                                 "ops": [type(m).__name__ for m in mods]}
        record = cache.get(key, lambda r: isinstance(r, dict)) if cache is not None else None
        if record is None:
            record = _measure(mods, x, rounds)
            if cache is not None and "error" not in record:
                cache.put(key, record)
            entry["source"] = "measured"
        else:
            entry["source"] = "cache"
        entry.update(record)
        out.append(entry)
    wins = [c for c in out if c.get("ratio", 0.0) > 1.0]
    note = (f"{len(wins)} of {len(out)} chains faster in mkldnn tensors; measured only, not "
            "applied (opaque tensors would need every consumer rewritten)" if out
            else _NO_CHAIN)
    record = {"available": True, "note": note, "chains": out, "applied": False}
    if whole_key is not None and not any("error" in c for c in out):
        cache.put(whole_key, record)
    return BlockedReport.from_dict(record)


_NO_CHAIN = ("no chain of supported ops (Conv2d, BatchNorm2d, ReLU, MaxPool2d in an "
             "nn.Sequential) found")


def _measure(mods: list[nn.Module], x: torch.Tensor, rounds: int) -> dict[str, Any]:
    import warnings

    from torch.utils import mkldnn as mkldnn_utils

    planned = nn.Sequential(*mods)
    try:
        dense = copy.deepcopy(planned)
        dense._apply(lambda t: t.contiguous())  # to_mkldnn reorders from plain NCHW weights
        with warnings.catch_warnings():  # its modules use the deprecated jit.script_method
            warnings.simplefilter("ignore", FutureWarning)
            blocked = mkldnn_utils.to_mkldnn(dense)
        with torch.no_grad():
            want = planned(x.clone())
            got = blocked(x.to_mkldnn()).to_dense()
    except Exception as exc:  # an op without an mkldnn kernel here: a fact to report
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}

    def run_planned() -> Any:
        with torch.no_grad():
            return planned(x)

    def run_blocked() -> Any:
        with torch.no_grad():
            return blocked(x.to_mkldnn()).to_dense()

    result = interleaved({"planned": run_planned, "mkldnn": run_blocked}, rounds=rounds,
                         warmup=1, repeat=3)
    if not (result["planned"].ok and result["mkldnn"].ok):
        return {"error": result["mkldnn"].error or result["planned"].error}
    # ratio: median of per-round planned / mkldnn times (> 1: mkldnn faster)
    return {"seconds": {"planned": result["planned"].min, "mkldnn": result["mkldnn"].min},
            "ratio": result.speedup("mkldnn"), "max_error": worst_error(want, got, None)[0]}
