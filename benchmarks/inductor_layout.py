"""Does Inductor override the plan's strides? (evidence for memlayout.plan.compilers.compiled)

A plan with every node NCHW / NCDHW (the solver is forced to it), compiled with Inductor's
defaults and with ``layout_optimization`` off; printed: the strides of each convolution's
output in the code Inductor generated. Run: ``.venv/bin/python benchmarks/inductor_layout.py``.
"""
import re
import warnings

import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import memlayout
from memlayout.plan import api
from memlayout.plan.solve.mincut import Solution

warnings.filterwarnings("ignore")
real = api.solve_min_cut
api.solve_min_cut = lambda p: Solution({k: p.pins.get(k, 0) for k in real(p).labels}, 0)
for rank, net, x in [
    (4, nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)).eval(), torch.randn(2, 3, 32, 32)),
    (5, nn.Sequential(nn.Conv3d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv3d(16, 16, 3, padding=1)).eval(), torch.randn(2, 3, 4, 16, 16)),
]:
    opt = memlayout.optimize(net, x, measure=False, guard=False, memory=False, padding=False, blocked=False)
    print(f"rank {rank}: plan formats", sorted({n.format for n in opt.plan.nodes}))
    for lo in (True, False):
        torch._dynamo.reset()
        with torch.no_grad():
            _, codes = run_and_get_code(torch.compile(opt, options={"layout_optimization": lo}), x)
        strides = re.findall(r"assert_tensor_metadata\(buf\d+, \(([^)]*)\), \(([^)]*)\), torch.float32, 'torch.ops.aten.convolution", "\n".join(codes))
        print(f"  layout_optimization={lo}: convolution outputs (shape; strides):", strides)
