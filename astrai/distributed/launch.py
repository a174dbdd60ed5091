"""load_sharded: a tensor-parallel model, each rank loading only its share of the weights."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from astrai.config import ConfigError
from astrai.distributed.executor import serve_steps
from astrai.distributed.group import (
    TensorParallelGroup,
    join,
    rank_device,
    spawn,
    under_torchrun,
    watch_parent,
)
from astrai.distributed.sharding import TensorShard, check_shardable
from astrai.model import AutoModel
from astrai.model.families import config_from_gguf, read_config
from astrai.model.transformer import Transformer

# How long a rank waits for the others in a collective (start-up, a step's all-reduce).
DEFAULT_TIMEOUT = 120.0


def load_sharded(
    path: str | Path,
    size: int,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    dequantize: bool = False,
    quantization: str | None = None,
) -> Transformer:
    """Rank 0's shard of the model at path, its group started: size - 1 spawned workers, or
    the torchrun processes (where a rank other than 0 serves steps until rank 0 stops it, then
    exits). The model's tensor_parallel is the group; the engine built on it closes it.

    Every rank reads only its share of each sharded tensor, from the safetensors files or the
    GGUF file (whose quantized linears each rank keeps in blocks: rows of them, or columns cut
    at block boundaries). dequantize and quantization are AutoModel.from_pretrained's, applied
    to each rank's share.
    """
    path = Path(path)
    if path.suffix == ".gguf":
        from astrai.model.weights.gguf import open_gguf, shard_problems

        config = config_from_gguf(open_gguf(path), path)
        problems = [] if dequantize else shard_problems(path, size)
        if problems:
            raise ConfigError(
                f"tensor_parallel_size={size} cannot split {path.name}'s quantized blocks: "
                + "; ".join(problems)
                + ". Pick another tensor_parallel_size, or load it with --dequantize."
            )
    else:
        config = read_config(path)
    check_shardable(config, size)
    options = {"dtype": dtype, "dequantize": dequantize, "quantization": quantization}
    device = torch.device(device)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != size:
            raise ConfigError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes for "
                f"tensor_parallel_size {size}; give --nproc-per-node times --nnodes = {size}"
            )
        group = join(rank, size, "env://", rank_device(device, rank), timeout)
        if rank != 0:
            run_rank(group, path, options)
            sys.exit(0)
    else:
        workers, init_method = spawn(worker_main, size, timeout, size, path, options, device)
        group = join(0, size, init_method, rank_device(device, 0), timeout, workers)
    try:
        model = load_shard(group, path, options)
    except BaseException:
        group.close()
        raise
    model.tensor_parallel = group
    return model


def load_shard(group: TensorParallelGroup, path: Path, options: dict) -> Transformer:
    """This rank's shard (options: AutoModel.from_pretrained's), its embedding's and
    row-parallel layers' partial outputs summed across the group; returns once every rank has
    loaded its own."""
    shard = TensorShard(group.rank, group.size)
    model = AutoModel.from_pretrained(path, device=group.device, shard=shard, **options)
    for module in model.modules():  # the embedding, each layer, OLMo 2's q/k norms
        if hasattr(module, "sum_partials"):
            module.sum_partials = group.all_reduce
    group.barrier()
    return model


def run_rank(group: TensorParallelGroup, path: Path, options: dict) -> None:
    """A worker rank's life: load its shard, serve steps, leave the group."""
    try:
        serve_steps(group, load_shard(group, path, options))
    finally:
        group.close()


def worker_main(
    rank: int, init_method: str, timeout: float, size: int, path: Path, options: dict, device
) -> None:
    """The entry point of a spawned worker."""
    watch_parent()
    run_rank(join(rank, size, init_method, rank_device(device, rank), timeout), path, options)
