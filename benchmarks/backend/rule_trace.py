"""What asking Inductor's layout rule costs the backend: the two ways ``inductor_rule`` traces
a graph to aten, timed interleaved over every graph Dynamo hands over for YOLOv8n's inference
(graph breaks and recompiles; most graphs dynamic after them), with an A/A control.

    python benchmarks/backend/rule_trace.py [ROUNDS]

Prints, per way, the median seconds to trace all the graphs, and the per-round ratios
(median, min-max) of the real-input trace over Dynamo's fake mode, and of Dynamo's fake mode
over itself (A/A). Both ways must give the same rule on every graph (checked first).
Needs the ``models`` extra (ultralytics; random weights, nothing downloaded).
"""

import statistics
import sys

import torch
from torch._inductor.graph import GraphLowering
from ultralytics.nn.tasks import DetectionModel

from memlayout.plan.compilers import backend as b
from memlayout.timing import interleaved

CPU = torch.device("cpu")


def main(rounds: int) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", verbose=False).eval()
    x = torch.rand(2, 3, 64, 64)
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    compiled = torch.compile(model, backend=record)
    with torch.no_grad():
        compiled(x), compiled(torch.rand_like(x))

    def traced(trace):
        return [GraphLowering.decide_layout_opt(trace(gm, ex, dtype=None, device=CPU),
                                                is_inference=True) for gm, ex in graphs]

    fake, real = traced(b._in_dynamos_mode), traced(b._on_real_inputs)
    assert fake == real, (fake, real)
    ways = {"dynamo's fake mode": lambda: traced(b._in_dynamos_mode),
            "dynamo's fake mode again": lambda: traced(b._in_dynamos_mode),
            "real inputs": lambda: traced(b._on_real_inputs)}
    result = interleaved(ways, rounds=rounds, warmup=1, baseline="dynamo's fake mode")
    print(f"{len(graphs)} graphs, {sum(b.is_dynamic(gm) for gm, _ in graphs)} dynamic, "
          f"{rounds} rounds, same rule both ways on every graph")
    for name in ways:
        print(f"  {name:26s} median {statistics.median(result[name].times):.2f} s for all")
    for name in ("real inputs", "dynamo's fake mode again"):
        r = result.per_round(name, "dynamo's fake mode")
        print(f"  {name} / dynamo's fake mode: {statistics.median(r):.2f} "
              f"({min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
