"""Training with planned and channels-last layouts (L2 ``train/``): the reference loop behind
``memlayout train`` (one process or torchrun: DDP or FSDP2), a DDP wrapper that fixes layouts
before gradient buckets exist, ``fully_shard`` per block for planned models on contiguous
weights, layout-neutral atomic checkpoints (sharded under FSDP), and ``torch.export``.

>>> from memlayout.train import TrainConfig
>>> TrainConfig("torchvision:resnet18", "data").layout
'nhwc'
"""

from memlayout.train.checkpoint import (
    atomic_save,
    load_checkpoint,
    load_neutral_state_dict,
    load_optimizer_state,
    load_sharded_model,
    neutral_optimizer_state,
    neutral_state_dict,
)
from memlayout.train.compare import LayoutComparison, compare_layouts
from memlayout.train.config import TrainConfig
from memlayout.train.ddp import (
    DistInfo,
    convert_sync_batchnorm,
    grad_layout_mismatches,
    init_distributed,
    wrap_ddp,
)
from memlayout.train.export import export_model
from memlayout.train.fsdp import shard_groups, wrap_fsdp
from memlayout.train.loop import IntervalLog, Trainer, TrainResult, train
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
    "load_sharded_model",
    "make_synthetic",
    "neutral_optimizer_state",
    "neutral_state_dict",
    "shard_groups",
    "train",
    "wrap_ddp",
    "wrap_fsdp",
]
