"""Both ends of a tensor-parallel step: rank 0's executor broadcasts each step's plan once, and
every worker runs the same forward on its shard and its own KV pool.

A worker's KV store holds its share of the KV heads in the same pages as rank 0's: rank 0 does
all the page accounting and sends each step's StepBatch as it is, page tables and all, so the
workers keep no scheduling state at all.
"""

from __future__ import annotations

from typing import Protocol

import torch

from astrai.config import ACTIVATION_PRECISIONS
from astrai.inference.executor import ExecutorFailedError, ModelExecutor
from astrai.inference.kv_cache import KVStore, PagedCache
from astrai.inference.step_batch import StepBatch
from astrai.kernels.kernel_plan import DEFAULT_ACTIVATION_PRECISION

STOP_MESSAGE, KV_POOL, STEP = 0, 1, 2  # the kinds of rank 0's messages, a header's first int
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # as KV_POOL names them


class StepChannel(Protocol):
    """What both ends of a step use of the tensor-parallel group (astrai.distributed.group's
    TensorParallelGroup): rank 0's messages to the workers, the gather of the logits' columns,
    and the group's failure."""

    failure: str | None

    def send(self, header: list[int], body: torch.Tensor | None = None) -> None: ...

    def receive_header(self) -> list[int]: ...

    def receive_body(self, size: int) -> torch.Tensor: ...

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None: ...


class TensorParallelExecutor(ModelExecutor):
    """Rank 0's ModelExecutor: each forward first sends the step to the workers.

    On the CPU few-row steps are recorded and replayed on every rank as without tensor
    parallelism: the all-reduce is an astrai op, so a step graph keeps it as one of its calls.
    On CUDA every rank runs its steps eagerly: no rank captures CUDA graphs, whose NCCL
    all-reduces the ranks would have to capture and replay together (EngineConfig refuses
    cuda_graphs=True with tensor parallelism).
    """

    def __init__(
        self,
        group: StepChannel,
        model: torch.nn.Module,
        cache: PagedCache,
        max_batch_size: int = 256,
        batch_invariant: bool = True,
        activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
    ) -> None:
        super().__init__(
            model,
            cache.kv,
            cache.tasks.pages,
            max_batch_size=max_batch_size,
            batch_invariant=batch_invariant,
            activation_precision=activation_precision,
        )
        self.group = group
        dtype = KV_DTYPES.index(cache.kv.k_cache.dtype)
        precision = ACTIVATION_PRECISIONS.index(activation_precision)
        group.send(
            [KV_POOL, cache.n_pages, cache.page_size, dtype, int(batch_invariant)],
            torch.tensor([precision]),
        )

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ModelExecutor.forward's; the hidden states are rank 0's own (its norm and residual
        stream are the whole model's), so the workers compute only the logits. A batch never
        has images: load_sharded loads no vision encoder."""
        # The ranks run each step in lockstep: a rank that fails one leaves the others waiting
        # in a collective, so no step can follow it.
        try:
            header, body = batch.pack()
            self.group.send([STEP, *header], body)
            logits, hidden = super().forward(batch)
            return gathered_logits(self.group, logits), hidden
        except Exception as exc:
            # Noted on the group, so close() does not wait on workers stuck in this step.
            self.group.failure = self.group.failure or f"a tensor-parallel step failed: {exc}"
            raise ExecutorFailedError(self.group.failure) from exc


def gathered_logits(group: StepChannel, logits: torch.Tensor) -> torch.Tensor | None:
    """The whole vocabulary's logits on rank 0 from every rank's columns (None elsewhere); a
    step with no logits rows, as every rank knows from its plan, gathers nothing."""
    if not len(logits):
        return logits
    return group.gather_columns(logits)


def serve_steps(group: StepChannel, model: torch.nn.Module) -> ModelExecutor | None:
    """A worker's loop: run every step rank 0 sends on this rank's shard, until STOP; returns
    the executor the steps ran on (None if rank 0 sent none), with its KernelPlan."""
    executor = None
    while True:
        header = group.receive_header()
        if header[0] == STOP_MESSAGE:
            return executor
        if header[0] == KV_POOL:
            _, n_pages, page_size, dtype, batch_invariant = header
            precision = ACTIVATION_PRECISIONS[int(group.receive_body(1)[0])]
            config = model.config
            kv = KVStore.allocate(
                config.n_layers,
                config.n_kv_heads,
                config.head_dim,
                n_pages,
                page_size,
                dtype=KV_DTYPES[dtype],
                device=next(model.parameters()).device,
            )
            executor = ModelExecutor(
                model, kv, batch_invariant=bool(batch_invariant), activation_precision=precision
            )
            continue
        sizes = header[1:]
        body = group.receive_body(StepBatch.body_size(sizes))
        batch = StepBatch.unpack(sizes, body, executor.kv.page_size)
        gathered_logits(group, executor.forward(batch)[0])
