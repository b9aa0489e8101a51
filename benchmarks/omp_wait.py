"""How OpenMP's wait policy changes a 2-thread forward on a shared machine.

Run twice, each in a fresh process (libgomp reads the variable when torch loads it):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/omp_wait.py
    OMP_WAIT_POLICY=ACTIVE  python benchmarks/omp_wait.py

Prints the median and minimum of 8 forwards of an eager NHWC resnet18 (batch 8, 224 px,
2 threads) and the 1-minute load average when it ran.
"""

import os
import statistics
import time

import torch
import torchvision

torch.set_num_threads(2)
model = torchvision.models.resnet18().eval().to(memory_format=torch.channels_last)
x = torch.randn(8, 3, 224, 224).contiguous(memory_format=torch.channels_last)
with torch.no_grad():
    model(x)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}: "
      f"median {statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, "
      f"load average {os.getloadavg()[0]:.1f}")
