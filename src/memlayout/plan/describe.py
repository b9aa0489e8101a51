"""Plain-text lines and rich tables for the plan's issue-#10 records (padding, memory, blocked).

>>> memory_summary({"method": "tensor_lifetime", "original": 2_000_000, "planned": 3_000_000,
...                 "parameters": {"original": 10, "planned": 10}, "budget": None,
...                 "chosen": "planned", "candidates": {}})
'peak activation memory (tensor-lifetime count, one inference forward): planned 3.00 MB vs original 2.00 MB (1.50x)'
"""

from __future__ import annotations

from typing import Any

_METHODS = {"tensor_lifetime": "tensor-lifetime count", "cuda_allocator": "CUDA allocator"}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def memory_summary(memory: dict[str, Any]) -> str:
    """One or two lines: planned vs original peak; weights when they differ; the budget."""
    if not memory:
        return ""
    o, p = memory["original"], memory["planned"]
    ratio = f" ({p / o:.2f}x)" if o else ""
    line = (f"peak activation memory ({_METHODS.get(memory['method'], memory['method'])}, "
            "one inference forward): "
            f"planned {_mb(p)} vs original {_mb(o)}{ratio}")
    params = memory.get("parameters", {})
    if params and params.get("planned") != params.get("original"):
        line += f"; weights {_mb(params['planned'])} vs {_mb(params['original'])}"
    budget = memory.get("budget")
    if budget is not None:
        tried = memory.get("candidates", {})
        if tried:
            others = ", ".join(f"{n} {_mb(r['peak'])}" for n, r in tried.items())
            line += (f"\nmemory budget {_mb(budget)}: chose {memory['chosen']} (fastest predicted "
                     f"that fits; measured peaks: {others})")
        else:
            line += f"\nmemory budget {_mb(budget)}: the fastest plan fits"
    return line


def padding_summary(padding: list[dict[str, Any]]) -> str:
    """One line: how many candidate convolutions were padded, and the time saved."""
    if not padding:
        return ""
    padded = [p for p in padding if p["chosen"] != "unpadded"]
    reverted = [p for p in padding if p.get("reverted")]
    if reverted:
        ratio = reverted[0].get("whole_model")
        measured = "failed" if ratio is None else f"unpadded / padded time {ratio:.3f}"
        return (f"padded channels: {len(reverted)} of {len(padding)} candidate convolutions "
                f"measured faster padded alone, but not the whole model with them padded "
                f"({measured}, median of interleaved rounds): left unpadded")
    if padded:
        saved = sum((p["seconds"]["unpadded"] or 0) - (p["seconds"][p["chosen"]] or 0)
                    for p in padded if p["seconds"].get(p["chosen"]) is not None)
        names = ", ".join(f"{p['module']} {p['chosen']}" for p in padded)
        whole = padded[0].get("whole_model")
        model = "" if whole is None else f"; whole model unpadded / padded {whole:.3f}"
        return (f"padded channels: {len(padded)} of {len(padding)} candidate convolutions "
                f"padded ({names}; measured {saved * 1e3:.3f} ms saved per call{model})")
    return (f"padded channels: 0 of {len(padding)} candidate convolutions padded (padded "
            "variants measured slower, pad and crop included)")


def blocked_summary(blocked: dict[str, Any]) -> str:
    """One line: mkldnn unavailable, or how its chains compared."""
    if not blocked:
        return ""
    if not blocked.get("available"):
        return f"blocked formats (mkldnn): unavailable: {blocked.get('note', '')}"
    ratios = [c["ratio"] for c in blocked.get("chains", []) if c.get("ratio")]
    errors = [c for c in blocked.get("chains", []) if "error" in c]
    text = f"blocked formats (mkldnn): {blocked.get('note', '')}"
    if ratios:
        text += (f"; planned / mkldnn time per chain {min(ratios):.2f}-{max(ratios):.2f}x "
                 "(> 1: mkldnn faster)")
    if errors:
        text += f"; {len(errors)} chains failed in mkldnn ({errors[0]['error']})"
    return text


def padding_table(padding: list[dict[str, Any]]) -> Any:
    """A rich table: per candidate convolution the measured microseconds of each variant."""
    from rich.table import Table

    table = Table(title="padded channels (measured, pad and crop included)")
    for col in ("module", "C in -> out", "input", "unpadded us", "padded variants us", "chosen"):
        table.add_column(col)
    for p in padding:
        s = p["seconds"]

        def us(v: float | None) -> str:
            return "-" if v is None else f"{v * 1e6:.1f}"
        table.add_row(p["module"], f"{p['in_channels']} -> {p['out_channels']}",
                      f"{tuple(p['input_shape'])} {p['input_format']}", us(s.get("unpadded")),
                      " ".join(f"{n} {us(v)}" for n, v in s.items() if n != "unpadded"),
                      p["chosen"])
    return table
