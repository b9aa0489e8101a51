"""Two processes under torchrun, and the warnings that would mean a gradient layout mismatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# What torch says when gradients and DDP buckets disagree in layout (reducer.cpp), and ours.
LAYOUT_WARNINGS = ("Grad strides do not match", "bucket view", "gradient layout contract")


TIMEOUT = 240


def torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "always", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
