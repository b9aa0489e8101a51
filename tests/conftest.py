import os

import pytest
import torch

# Two cores here; keep torch from oversubscribing them when tests run alongside other work.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
