import os

# Before torch loads libgomp: waiting OpenMP threads sleep instead of spinning. When other jobs
# share the two cores, spinning makes 2-thread runs 10-20x slower (resnet18, 32 px, batch 2:
# 1.06 s vs 0.075 s per forward at load average 9); alone, it changes nothing a test checks.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor's caches do not tell a kernel compiled under ATEN_CPU_CAPABILITY from one compiled
# without it: on an AVX-512 CPU, kernels cached by a plain run and read back under
# ATEN_CPU_CAPABILITY=avx2 raised SystemError or computed other values. A run with the
# capability held keeps a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    import tempfile

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor-{os.environ['ATEN_CPU_CAPABILITY']}"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores here; keep torch from oversubscribing them when tests run alongside other work
# (one thread per pytest-xdist worker: the workers share the cores).
_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
torch.set_num_threads(1 if _WORKER else min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """The machine reads quiet: what a test checks must not depend on what else runs on this
    machine. Its load reads 0.5, and the planner's costs and cache take only rounds spread
    10x as noisy (real rounds beside other jobs spread 1-18x, so a cached cost would be
    measured again at random; a test of the noise rules injects a clock with 30x rounds, or
    its own load reading)."""
    from memlayout.plan.costs import cache
    from memlayout.plan.costs import measure as costs

    def noisy(spread: float | None) -> bool:
        return spread is not None and spread > 10.0

    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    monkeypatch.setattr(costs, "noisy", noisy)
    monkeypatch.setattr(cache, "noisy", noisy)


@pytest.fixture
def one_member_group(tmp_path):
    """A gloo group of this process alone: for code that needs a process group (FSDP's
    fully_shard, collectives) without torchrun."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and the memlayout backend's report empty before and after the test
    (``pytestmark = pytest.mark.usefixtures("fresh_dynamo")`` in a module that compiles)."""
    import torch._dynamo

    import memlayout

    torch._dynamo.reset()
    memlayout.backend_report(clear=True)
    yield
    torch._dynamo.reset()

