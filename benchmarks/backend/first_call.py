"""The first call of one compiled training step in a fresh process, for the cached-compile
comparison: run it alternately for each backend, with the cost cache and Inductor's FX graph
cache warm from an earlier run, and compare the printed times.

    python benchmarks/backend/first_call.py memlayout mobilenet_v3_large bf16
    python benchmarks/backend/first_call.py inductor mobilenet_v3_large bf16
"""

import sys
import time

import torch
import torchvision

import memlayout
from memlayout.dtypes import autocast, parse_dtype


def main(backend_name: str, model_name: str, dtype_name: str) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torchvision.models.get_model(model_name).train()
    x = torch.randn(8, 3, 224, 224)
    backend = memlayout.backend() if backend_name == "memlayout" else backend_name
    compiled = torch.compile(model, backend=backend)
    dtype = None if dtype_name == "fp32" else parse_dtype(dtype_name)
    start = time.perf_counter()
    with autocast(torch.device("cpu"), dtype):
        out = compiled(x)
    out.float().square().mean().backward()
    print(f"{backend_name} {model_name} {dtype_name}: first call "
          f"{time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main(*sys.argv[1:4])
