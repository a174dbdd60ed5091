"""Both ends of a tensor-parallel step: rank 0's executor broadcasts each step's plan once, and
every worker runs the same forward on its shard and its own KV pool.

A worker's KV pool holds its share of the KV heads in the same pages as rank 0's: rank 0 does
all the page accounting and sends each sequence's page table with the step, so the workers
keep no scheduling state at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from astrai.config import ACTIVATION_PRECISIONS
from astrai.inference.executor import ExecutorFailedError, ImageRows, ModelExecutor
from astrai.inference.kv_cache import PagedCache
from astrai.kernels.quant_ops import DEFAULT_ACTIVATION_PRECISION

STOP_MESSAGE, KV_POOL, STEP = 0, 1, 2  # the kinds of rank 0's messages, a header's first int
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # as KV_POOL names them


class StepChannel(Protocol):
    """What both ends of a step use of the tensor-parallel group (astrai.distributed.group's
    TensorParallelGroup, which builds rank 0's executor): rank 0's messages to the workers, the
    gather of the logits' columns, and the group's failure."""

    failure: str | None

    def send(self, header: list[int], body: torch.Tensor | None = None) -> None: ...

    def receive_header(self) -> list[int]: ...

    def receive_body(self, size: int) -> torch.Tensor: ...

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None: ...


class TensorParallelExecutor(ModelExecutor):
    """Rank 0's ModelExecutor: each forward first sends the step to the workers.

    Few-row steps are recorded and replayed on every rank as without tensor parallelism: the
    all-reduce is an astrai op, so a step graph keeps it as one of its calls.
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
            cache,
            max_batch_size=max_batch_size,
            batch_invariant=batch_invariant,
            activation_precision=activation_precision,
        )
        self.group = group
        dtype = KV_DTYPES.index(cache.k_cache.dtype)
        precision = ACTIVATION_PRECISIONS.index(activation_precision)
        group.send(
            [KV_POOL, cache.n_pages, cache.page_size, dtype, int(batch_invariant)],
            torch.tensor([precision]),
        )

    def forward(
        self,
        seqs: Sequence[tuple[int, int, int]],
        token_ids: list[int],
        rows: np.ndarray,
        spans: Sequence[int],
        hidden_rows: np.ndarray | None = None,
        images: ImageRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ModelExecutor.forward's; the hidden states are rank 0's own (its norm and residual
        stream are the whole model's), so the workers compute only the logits. images is never
        set: load_sharded loads no vision encoder, so no prompt has images."""
        assert images is None, "tensor-parallel steps carry no image embeddings"
        page_size = self.cache.page_size
        tables = [
            self.cache.tasks.pages(task_id)[: -(-(start + n) // page_size)]
            for task_id, start, n in seqs
        ]
        # The ranks run each step in lockstep: a rank that fails one leaves the others waiting
        # in a collective, so no step can follow it.
        try:
            self.group.send(*pack_step(seqs, token_ids, tables, rows, spans))
            logits, hidden = super().forward(seqs, token_ids, rows, spans, hidden_rows, images)
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


def pack_step(
    seqs: Sequence[tuple[int, int, int]],
    token_ids: list[int],
    tables: list[list[int]],
    rows: np.ndarray,
    spans: Sequence[int],
) -> tuple[list[int], torch.Tensor]:
    """(header, body) of a step: the body holds token ids, seqs, their spans, each table's
    length, the tables and the logits rows back to back, as int64."""
    n_pages = sum(len(table) for table in tables)
    header = [STEP, len(token_ids), len(seqs), n_pages, len(rows)]
    body = np.concatenate(
        [
            np.asarray(token_ids, dtype=np.int64),
            np.asarray(seqs, dtype=np.int64).reshape(-1),
            np.asarray(spans, dtype=np.int64),
            np.asarray([len(table) for table in tables], dtype=np.int64),
            np.asarray([page for table in tables for page in table], dtype=np.int64),
            rows.astype(np.int64),
        ]
    )
    return header, torch.from_numpy(body)


def unpack_step(header: list[int], body: torch.Tensor):
    """pack_step's inverse: (seqs, token_ids, tables, rows, spans)."""
    _, n_tokens, n_seqs, _, _ = header
    values = body.numpy()
    token_ids, values = values[:n_tokens].tolist(), values[n_tokens:]
    seqs = [tuple(seq) for seq in values[: 3 * n_seqs].reshape(n_seqs, 3).tolist()]
    spans, values = values[3 * n_seqs : 4 * n_seqs].tolist(), values[4 * n_seqs :]
    lengths, values = values[:n_seqs], values[n_seqs:]
    ends = np.cumsum(lengths)
    tables = [
        values[end - length : end].tolist() for end, length in zip(ends, lengths, strict=True)
    ]
    rows = values[ends[-1] if len(ends) else 0 :]
    return seqs, token_ids, tables, rows, spans


def step_body_size(header: list[int]) -> int:
    _, n_tokens, n_seqs, n_pages, n_rows = header
    return n_tokens + 5 * n_seqs + n_pages + n_rows


class PlannedPages:
    """A worker's page tables: those of the step at hand, as rank 0 sent them."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def pages(self, task_id: int) -> list[int]:
        return self.tables[task_id]


def serve_steps(group: StepChannel, model: torch.nn.Module) -> None:
    """A worker's loop: run every step rank 0 sends on this rank's shard, until STOP."""
    executor = None
    while True:
        header = group.receive_header()
        if header[0] == STOP_MESSAGE:
            return
        if header[0] == KV_POOL:
            _, n_pages, page_size, dtype, batch_invariant = header
            precision = ACTIVATION_PRECISIONS[int(group.receive_body(1)[0])]
            config = model.config
            cache = PagedCache(
                config.n_layers,
                config.n_kv_heads,
                config.head_dim,
                n_pages,
                page_size,
                dtype=KV_DTYPES[dtype],
                device=next(model.parameters()).device,
                enable_prefix_cache=False,
            )
            cache.tasks = PlannedPages()
            executor = ModelExecutor(
                model,
                cache,
                batch_invariant=bool(batch_invariant),
                activation_precision=precision,
            )
            continue
        seqs, token_ids, tables, rows, spans = unpack_step(
            header, group.receive_body(step_body_size(header))
        )
        executor.cache.tasks.tables = {
            task_id: table for (task_id, _, _), table in zip(seqs, tables, strict=True)
        }
        gathered_logits(group, executor.forward(seqs, token_ids, rows, spans)[0])
