"""Tensor parallelism on torch.distributed: Megatron-style sharded layers, rank 0 scheduling."""

from astrai.distributed.executor import TensorParallelExecutor
from astrai.distributed.group import TensorParallelGroup
from astrai.distributed.launch import load_sharded
from astrai.distributed.sharding import TensorShard, check_shardable

__all__ = [
    "TensorParallelExecutor",
    "TensorParallelGroup",
    "TensorShard",
    "check_shardable",
    "load_sharded",
]
