"""What can run a model (``memlayout.compile``'s candidates) or one Dynamo graph (the
``torch.compile`` backend), by one name each. The values are what records and reports show and
what stored races are keyed by.

>>> Runner.PLAN_COMPILED.value, f"{Runner.INDUCTOR_OWN}", Runner("eager") is Runner.PLAN_EAGER
('planned', 'inductor', True)
"""

from __future__ import annotations

import enum


class Runner(str, enum.Enum):
    #: the plan compiled by Inductor with its layout optimization off: the plan stands
    PLAN_COMPILED = "planned"
    #: the original compiled by Inductor with the settings given: Inductor decides layouts
    INDUCTOR_OWN = "inductor"
    #: the same with Inductor's freezing: weights folded and prepacked
    INDUCTOR_FROZEN = "inductor+freezing"
    #: the plan run eagerly
    PLAN_EAGER = "eager"
    #: the original run eagerly, as given
    ORIGINAL_EAGER = "eager (as given)"
    #: the original converted by a peer runtime (``memlayout.runtimes.ADAPTERS``)
    OPENVINO = "openvino"
    ONNXRUNTIME = "onnxruntime"
    MKLDNN = "mkldnn"

    def __str__(self) -> str:
        return self.value


#: the peer runtimes, in ``memlayout.runtimes.ADAPTERS``' order
RUNTIME_RUNNERS = (Runner.OPENVINO, Runner.ONNXRUNTIME, Runner.MKLDNN)

__all__ = ["RUNTIME_RUNNERS", "Runner"]
