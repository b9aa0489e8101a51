"""What can run a model or one Dynamo graph, by one name each: the guard's candidates
(``optimize``), ``memlayout.compile``'s and the ``torch.compile`` backend's. The values are
what records and reports show and what stored races are keyed by; each says which is which:
``planned`` is the plan run eagerly (what ``optimize`` returns), ``planned+inductor`` the plan
compiled with its layouts standing, ``inductor`` the original with Inductor choosing layouts.

>>> Runner.PLAN_COMPILED.value, f"{Runner.INDUCTOR_OWN}", Runner("planned") is Runner.PLAN_EAGER
('planned+inductor', 'inductor', True)
"""

from __future__ import annotations

import enum


class Runner(str, enum.Enum):
    #: the plan run eagerly: the user's module tree, steered (``optimize``'s result)
    PLAN_EAGER = "planned"
    #: the plan compiled by Inductor with its layout optimization off: the plan stands
    PLAN_COMPILED = "planned+inductor"
    #: the original compiled by Inductor with the settings given: Inductor decides layouts
    INDUCTOR_OWN = "inductor"
    #: the same with Inductor's freezing: weights folded and prepacked
    INDUCTOR_FROZEN = "inductor+freezing"
    #: the original run eagerly, as given
    ORIGINAL_EAGER = "eager (as given)"
    #: the original run eagerly with every activation and weight in one format (the guard's
    #: whole-model alternatives to the plan)
    ALL_CONTIGUOUS = "all_contiguous"
    ALL_CHANNELS_LAST = "all_channels_last"
    #: the original converted by a peer runtime (``memlayout.runtimes.ADAPTERS``)
    OPENVINO = "openvino"
    ONNXRUNTIME = "onnxruntime"
    MKLDNN = "mkldnn"

    def __str__(self) -> str:
        return self.value


#: the peer runtimes, in ``memlayout.runtimes.ADAPTERS``' order
RUNTIME_RUNNERS = (Runner.OPENVINO, Runner.ONNXRUNTIME, Runner.MKLDNN)

__all__ = ["RUNTIME_RUNNERS", "Runner"]
