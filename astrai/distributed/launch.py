"""The ranks' entry points: load_sharded, rank 0's tensor-parallel model and the group its ranks
form, and run_worker, a torchrun rank's life as a worker; each rank loads only its share of the
weights."""

from __future__ import annotations

import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ShardedModel:
    """Rank 0's shard of a tensor-parallel model and the process group of its ranks: what an
    InferenceEngine of tensor_parallel_size = group.size runs, which closes the group."""

    model: Transformer
    group: TensorParallelGroup


def load_sharded(
    path: str | Path,
    size: int,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    dequantize: bool = False,
    quantization: str | None = None,
) -> ShardedModel:
    """Rank 0's shard of the model at path, its group started: size - 1 spawned workers, or
    the other torchrun processes, each of which calls run_worker with the same arguments.

    Every rank reads only its share of each sharded tensor, from the safetensors files or the
    GGUF file (whose quantized linears each rank keeps in blocks: rows of them, or columns cut
    at block boundaries). dequantize and quantization are AutoModel.from_pretrained's, applied
    to each rank's share.
    """
    path = Path(path)
    options = _checked_options(path, size, dtype, dequantize, quantization)
    device = torch.device(device)
    if under_torchrun():
        rank = _torchrun_rank(size)
        if rank != 0:
            raise ConfigError(
                f"load_sharded is rank 0's; this process is torchrun's rank {rank}, a worker: "
                "call astrai.distributed.run_worker with the same arguments there (it serves "
                "rank 0's steps and returns when rank 0's engine closes)"
            )
        group = join(0, size, "env://", rank_device(device, 0), timeout)
    else:
        workers, init_method = spawn(worker_main, size, timeout, size, path, options, device)
        group = join(0, size, init_method, rank_device(device, 0), timeout, workers)
    try:
        return ShardedModel(load_shard(group, path, options), group)
    except BaseException:
        group.close()
        raise


def run_worker(
    path: str | Path,
    size: int,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    timeout: float = DEFAULT_TIMEOUT,
    dequantize: bool = False,
    quantization: str | None = None,
) -> None:
    """A torchrun rank other than 0, given load_sharded's arguments: join the group, load this
    rank's shard, serve rank 0's steps on it; returns once rank 0's engine has closed."""
    path = Path(path)
    options = _checked_options(path, size, dtype, dequantize, quantization)
    if not is_torchrun_worker():
        raise ConfigError(
            "run_worker is a torchrun worker rank's (a RANK other than 0); rank 0, or a process "
            "started without torchrun, calls load_sharded, which spawns its own workers"
        )
    rank = _torchrun_rank(size)
    group = join(rank, size, "env://", rank_device(torch.device(device), rank), timeout)
    run_rank(group, path, options)


def is_torchrun_worker() -> bool:
    """Whether torchrun started this process as a rank other than 0 (one for run_worker)."""
    return under_torchrun() and int(os.environ["RANK"]) != 0


def _torchrun_rank(size: int) -> int:
    """This process's rank in torchrun's group, which must have size processes."""
    if int(os.environ["WORLD_SIZE"]) != size:
        raise ConfigError(
            f"torchrun started {os.environ['WORLD_SIZE']} processes for "
            f"tensor_parallel_size {size}; give --nproc-per-node times --nnodes = {size}"
        )
    return int(os.environ["RANK"])


def _checked_options(
    path: Path, size: int, dtype, dequantize: bool, quantization: str | None
) -> dict:
    """AutoModel.from_pretrained's options for each rank's share, once the model at path is
    known to split into size ranks (a ConfigError before any rank joins, if not)."""
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
    return {"dtype": dtype, "dequantize": dequantize, "quantization": quantization}


def load_shard(group: TensorParallelGroup, path: Path, options: dict) -> Transformer:
    """This rank's shard (options: AutoModel.from_pretrained's), built with the group's
    all-reduce in the layers that make partial sums; returns once every rank has loaded its
    own."""
    shard = TensorShard(group.rank, group.size, group.all_reduce)
    model = AutoModel.from_pretrained(path, device=group.device, shard=shard, **options)
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
