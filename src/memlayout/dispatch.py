"""One way to watch aten calls (L1): a thin ``TorchDispatchMode`` that runs every op unchanged
and hands it, with its result, to ``observe``.

The audit's recorder, the data pipeline's copy counter, the coverage matrix's watcher and the
planner's live-bytes count are all this mode with a different ``observe``: none of them may
change what runs, so the running lives here once.

>>> import torch
>>> class Names(ObservingMode):
...     def __init__(self):
...         super().__init__()
...         self.seen = []
...     def observe(self, func, args, kwargs, out):
...         self.seen.append(str(func.overloadpacket))
>>> with Names() as watch:
...     _ = torch.ones(2, 3).relu()
>>> watch.seen
['aten.ones', 'aten.relu']
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class ObservingMode(TorchDispatchMode):
    """Runs each aten call as is, then ``observe(func, args, kwargs, out)``; returns ``out``
    unchanged. Subclasses only read (strides, tags, sizes): they never alter a tensor."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """What to note about one call (``func`` is an ``OpOverload``); the default: nothing."""
