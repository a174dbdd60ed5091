"""StepBatch: the one description of a forward pass's ragged batch.

The executor builds it once from a step's chunks; every attention backend reads it (the C
kernel and SDPA through CacheView, Triton through ragged_layout), and tensor-parallel workers
receive it as it is (pack, unpack), so no step is described twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass
class ImageRows:
    """The rows of a step that hold image placeholder tokens, and the image embeddings
    [len(rows), dim] that take the place of their token embeddings."""

    rows: torch.Tensor  # [n] int64
    embeddings: torch.Tensor

    def place(self, h: torch.Tensor) -> None:
        """Write the image embeddings into the step's embeddings h [num_tokens, dim]."""
        h.index_copy_(0, self.rows, self.embeddings.to(h.dtype))


def _int64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass(eq=False)
class StepBatch:
    """A ragged batch of sequences, each n new tokens at positions start .. start + n - 1 of
    one task, their rows back to back; the host arrays (int64) every backend reads.

    A sequence's page table runs up to its last new position; block_tables pads the tables
    with page 0 to the longest. Positions, slots and rope lengths are worked out once, when
    first read.
    """

    token_ids: np.ndarray  # [num_tokens] the sequences' new tokens back to back
    starts: np.ndarray  # [n_seqs] each sequence's first new position
    lengths: np.ndarray  # [n_seqs] its new tokens (at least 1)
    spans: np.ndarray  # [n_seqs] its prompt's length, which rope may depend on (model.rope)
    block_tables: np.ndarray  # [n_seqs, max pages] page ids, padded with page 0
    table_lengths: np.ndarray  # [n_seqs] the pages of each table
    page_size: int
    logit_rows: np.ndarray  # the rows whose logits the step returns
    hidden_rows: np.ndarray | None = None  # the rows whose final hidden states it returns
    # The embeddings that replace image placeholder tokens'; a step with images is not sent
    # to tensor-parallel workers (load_sharded loads no vision encoder).
    images: ImageRows | None = None
    # [3, num_tokens] each row's M-RoPE positions, where a sequence of the step has a prompt
    # with images on a model with M-RoPE (Task.mrope); None: rope turns by positions.
    mrope_positions: np.ndarray | None = None
    # [num_tokens] the position each row sees keys before, where a sequence of the step
    # computes the tokens of an image that attend to each other (PromptImage.bidirectional):
    # the image's end for its rows, position + 1 for the others; None: every row is causal.
    key_ends: np.ndarray | None = None

    @classmethod
    def build(
        cls,
        seqs: Sequence[tuple[int, int, int]],
        token_ids: Sequence[int],
        pages: Callable[[int], list[int]],
        page_size: int,
        spans: Sequence[int] = (),
        logit_rows: Sequence[int] | np.ndarray = (),
        hidden_rows: np.ndarray | None = None,
        images: ImageRows | None = None,
        mrope_positions: np.ndarray | None = None,
        key_ends: np.ndarray | None = None,
    ) -> StepBatch:
        """The batch of seqs, each (task_id, start, n), whose tasks' page tables pages gives;
        spans default to 0 (no rope dependence). Refused if a task holds too few pages."""
        tables = []
        for task_id, start, n in seqs:
            table = pages(task_id)
            n_pages = -(-(start + n) // page_size)
            if start < 0 or n < 1 or n_pages > len(table):
                raise ValueError(
                    f"task {task_id}: positions {start}..{start + n - 1} need {n_pages} pages "
                    f"but it holds {len(table)}; allocate before the forward pass"
                )
            tables.append(table[:n_pages])
        block_tables = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int64)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = table
        return cls(
            token_ids=_int64(token_ids),
            starts=_int64([start for _, start, _ in seqs]),
            lengths=_int64([n for *_, n in seqs]),
            spans=_int64(spans) if len(spans) else np.zeros(len(seqs), dtype=np.int64),
            block_tables=block_tables,
            table_lengths=_int64([len(table) for table in tables]),
            page_size=page_size,
            logit_rows=_int64(logit_rows),
            hidden_rows=hidden_rows,
            images=images,
            mrope_positions=mrope_positions,
            key_ends=key_ends,
        )

    @classmethod
    def empty(cls, page_size: int) -> StepBatch:
        """A batch of no sequences (what a recorded CUDA step pads from)."""
        return cls.build((), (), lambda task_id: [], page_size)

    @property
    def n_seqs(self) -> int:
        return len(self.starts)

    @property
    def decodes_only(self) -> bool:
        """Every sequence one token, nothing pooled, rope turned by positions: the step a
        recorded graph can replay."""
        no_hidden = self.hidden_rows is None or not len(self.hidden_rows)
        plain = self.images is None and self.mrope_positions is None
        return self.one_row_each and no_hidden and plain

    @cached_property
    def one_row_each(self) -> bool:
        """Whether every sequence feeds one token (a step of decodes): row i is sequence i."""
        return int(self.lengths.max(initial=1)) == 1

    @cached_property
    def logits_of_every_row(self) -> bool:
        """Whether logit_rows are every row in order (a step of decodes): no rows to pick."""
        num_tokens = self.n_seqs if self.one_row_each else int(self.lengths.sum())
        return self.logit_rows.tolist() == list(range(num_tokens))

    @cached_property
    def first_rows(self) -> np.ndarray:
        """[n_seqs] each sequence's first row."""
        return np.cumsum(self.lengths) - self.lengths

    @cached_property
    def row_seqs(self) -> np.ndarray:
        """[num_tokens] the sequence of each row."""
        return np.repeat(np.arange(self.n_seqs), self.lengths)

    @cached_property
    def positions(self) -> np.ndarray:
        """[num_tokens] each row's position."""
        if self.one_row_each:
            return self.starts
        seq = self.row_seqs
        return np.arange(len(seq)) - self.first_rows[seq] + self.starts[seq]

    @property
    def row_tables(self) -> np.ndarray:
        """[num_tokens, max pages] each row's sequence's page table."""
        return self.block_tables if self.one_row_each else self.block_tables[self.row_seqs]

    @cached_property
    def slots(self) -> np.ndarray:
        """[num_tokens] the KV slot each row's K/V is written to: page * page_size + offset."""
        pages = self.row_tables[np.arange(len(self.positions)), self.positions // self.page_size]
        return pages * self.page_size + self.positions % self.page_size

    @property
    def visible_ends(self) -> np.ndarray:
        """[num_tokens] the position each row sees keys before: key_ends, else position + 1."""
        return self.positions + 1 if self.key_ends is None else self.key_ends

    @property
    def rope_positions(self) -> np.ndarray:
        """What rope turns each row by: mrope_positions [3, num_tokens], else positions."""
        return self.positions if self.mrope_positions is None else self.mrope_positions

    @property
    def rope_lengths(self) -> np.ndarray:
        """[num_tokens] the length each row rotates for: max(position + 1, its span)."""
        return np.maximum(self.positions + 1, self.spans[self.row_seqs])

    def pack(self) -> tuple[list[int], torch.Tensor]:
        """(header, body) of the batch for tensor-parallel workers: the body holds the int64
        arrays back to back, the header their sizes. Workers compute the logits only (rank 0's
        hidden states are the whole model's), so hidden rows and images are not sent."""
        assert self.images is None, "tensor-parallel steps carry no image embeddings"
        assert self.mrope_positions is None, "tensor-parallel steps carry no M-RoPE positions"
        assert self.key_ends is None, "tensor-parallel steps carry no image key ends"
        header = [
            len(self.token_ids),
            self.n_seqs,
            self.block_tables.shape[1],
            len(self.logit_rows),
        ]
        arrays = [self.token_ids, self.starts, self.lengths, self.spans, self.block_tables]
        arrays += [self.table_lengths, self.logit_rows]
        return header, torch.from_numpy(np.concatenate([_int64(a) for a in arrays]))

    @staticmethod
    def body_size(header: Sequence[int]) -> int:
        """The int64 values in the body that header (pack's) announces."""
        n_tokens, n_seqs, width, n_logits = header
        return n_tokens + n_seqs * (4 + width) + n_logits

    @classmethod
    def unpack(cls, header: Sequence[int], body: torch.Tensor, page_size: int) -> StepBatch:
        """pack's inverse."""
        n_tokens, n_seqs, width, n_logits = header
        sizes = [n_tokens, n_seqs, n_seqs, n_seqs, n_seqs * width, n_seqs, n_logits]
        arrays = np.split(body.numpy(), np.cumsum(sizes)[:-1])
        token_ids, starts, lengths, spans, tables, table_lengths, logit_rows = arrays
        return cls(
            token_ids=token_ids,
            starts=starts,
            lengths=lengths,
            spans=spans,
            block_tables=tables.reshape(n_seqs, width),
            table_lengths=table_lengths,
            page_size=page_size,
            logit_rows=logit_rows,
        )
