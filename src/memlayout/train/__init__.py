"""Training with planned and channels-last layouts (L2 ``train/``): the reference loop behind
``memlayout train`` (one process or torchrun/DDP), a DDP wrapper that fixes layouts before
gradient buckets exist, layout-neutral atomic checkpoints, and ``torch.export``.

>>> from memlayout.train import TrainConfig
>>> TrainConfig("torchvision:resnet18", "data").layout
'nhwc'
"""

from memlayout.train.checkpoint import (
    atomic_save,
    load_checkpoint,
    load_neutral_state_dict,
    load_optimizer_state,
    neutral_optimizer_state,
    neutral_state_dict,
)
from memlayout.train.ddp import (
    DistInfo,
    convert_sync_batchnorm,
    grad_layout_mismatches,
    init_distributed,
    wrap_ddp,
)
from memlayout.train.export import export_model
from memlayout.train.loop import (
    IntervalLog,
    LayoutComparison,
    TrainConfig,
    Trainer,
    TrainResult,
    compare_layouts,
    train,
)
from memlayout.train.synthetic import make_synthetic

__all__ = [
    "DistInfo",
    "IntervalLog",
    "LayoutComparison",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "atomic_save",
    "compare_layouts",
    "convert_sync_batchnorm",
    "export_model",
    "grad_layout_mismatches",
    "init_distributed",
    "load_checkpoint",
    "load_neutral_state_dict",
    "load_optimizer_state",
    "make_synthetic",
    "neutral_optimizer_state",
    "neutral_state_dict",
    "train",
    "wrap_ddp",
]
