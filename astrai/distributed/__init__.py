"""Tensor parallelism on torch.distributed: Megatron-style sharded layers, rank 0 scheduling."""

from astrai.distributed.executor import TensorParallelExecutor
from astrai.distributed.group import TensorParallelGroup
from astrai.distributed.launch import ShardedModel, is_torchrun_worker, load_sharded, run_worker
from astrai.distributed.sharding import TensorShard, check_shardable

__all__ = [
    "ShardedModel",
    "TensorParallelExecutor",
    "TensorParallelGroup",
    "TensorShard",
    "check_shardable",
    "is_torchrun_worker",
    "load_sharded",
    "run_worker",
]
