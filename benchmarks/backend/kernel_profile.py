"""Where a compiled inference call (or, with ``train``, a training step: forward and backward)
spends its time, per kernel: Inductor's generated kernels named one by one
(``cpp.enable_kernel_profile``) beside the ATen calls, for one backend. Run it for each
backend and compare the tables: a kernel much slower under one of them, with the same
convolutions, points at a layout between the convolutions.

    python benchmarks/backend/kernel_profile.py inductor inception_v3 bf16
    python benchmarks/backend/kernel_profile.py memlayout inception_v3 bf16
    python benchmarks/backend/kernel_profile.py memlayout shufflenet_v2_x1_0 bf16 train

Each run compiles into a fresh Inductor cache (printed), whose output code holds the kernels'
source and the buffers' strides.
"""

import os
import statistics
import sys
import tempfile
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

import memlayout
from memlayout.dtypes import autocast, parse_dtype
from memlayout.models import load_model


def main(backend_name: str, model_name: str, dtype_name: str, task: str = "infer") -> None:
    cache = tempfile.mkdtemp(prefix=f"kernels-{backend_name}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at compile time
    inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(2)
    torch.manual_seed(0)
    loaded = load_model(f"torchvision:{model_name}", batch=8)
    train = task == "train"
    model, x = loaded.module.train(train), loaded.example_input
    backend = memlayout.backend() if backend_name == "memlayout" else backend_name
    compiled = torch.compile(model, backend=backend)
    dtype = None if dtype_name == "fp32" else parse_dtype(dtype_name)

    def call() -> None:
        with torch.set_grad_enabled(train), autocast(torch.device("cpu"), dtype):
            out = compiled(x)
        if train:
            model.zero_grad(set_to_none=True)
            out.float().square().mean().backward()

    call()
    for _ in range(2):
        call()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    print(f"{backend_name} {model_name} {dtype_name} {task}: median call "
          f"{statistics.median(times) * 1e3:.1f} ms of 5; Inductor cache {cache}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            call()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main(*sys.argv[1:5])
