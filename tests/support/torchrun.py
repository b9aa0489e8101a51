"""Two processes under torchrun, and the warnings that would mean a gradient layout mismatch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# What torch says when gradients and DDP buckets disagree in layout (reducer.cpp), and ours.
LAYOUT_WARNINGS = ("Grad strides do not match", "bucket view", "gradient layout contract")


TIMEOUT = 240


def torchrun(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "always", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)


def run_worker(script: str, tmp_path: Path) -> tuple[str, list[dict]]:
    """``script`` run by two ranks from ``tmp_path`` (this repository importable), each writing
    ``result-{rank}.json``: the log, and the two results. Fails the test when a rank fails."""
    (tmp_path / "worker.py").write_text(script)
    res = torchrun(str(tmp_path / "worker.py"), cwd=tmp_path,
                   env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    return log, [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]


def graph_record(r: Any) -> dict[str, Any]:
    """A backend ``GraphRecord`` as a worker writes it into its result."""
    return {"graph": r.graph, "planned": r.planned, "ran": r.ran, "rank": r.rank,
            "decided_by": r.decided_by, "measured": r.measured, "cached": r.cached,
            "digest": r.digest, "fallback": r.fallback, "verification": r.verification,
            "convolutions": [[c.where, c.planned] for c in r.convolutions]}


def finish_rank(out: dict[str, Any]) -> None:
    """A worker's last step: its result written to ``result-{rank}.json`` (what
    :func:`run_worker` reads), the ranks met, the process group closed."""
    import torch.distributed as dist

    with open(f"result-{dist.get_rank()}.json", "w") as fh:
        json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()
