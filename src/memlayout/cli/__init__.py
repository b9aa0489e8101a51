"""The ``memlayout`` command (L3): one verb per capability; parse -> call -> render.

Every verb checks all its flags before any work starts (one error line, exit code 2), states
the conditions before it times anything, and leaves the rendering to the renderer beside the
data (``audit.render``, ``bench.render``, ``coverage.render``, ``data.render``,
``train.render``, ``inspection``). The subsystems behind a verb (the planner, bench, coverage,
data, train) are imported inside it: each pulls in more (torch.fx and scipy, matplotlib,
OpInfo, PIL, torch.distributed), and ``memlayout --help`` should not wait for them. One module
per verb; ``common`` holds what they share.
"""

from memlayout.cli import audit, bench, cache, coverage, data, inspect, optimize, train  # noqa: F401  (each registers its verb)
from memlayout.cli.app import app

__all__ = ["app"]
