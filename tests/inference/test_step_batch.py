"""StepBatch: a step's ragged layout worked out once, and sent to tensor-parallel workers whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from astrai.inference.kv_cache import PagedCache
from astrai.inference.step_batch import ImageRows, StepBatch


@pytest.fixture
def batch() -> StepBatch:
    """A prompt chunk of 3 tokens at 6..8 (task 0) and a decode at position 4 (task 1), pages
    of 4: task 0 holds pages 0, 1, 2 and task 1 pages 3, 4."""
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    assert cache.allocate(0, 9) and cache.allocate(1, 5)
    seqs = [(0, 6, 3), (1, 4, 1)]
    return StepBatch.build(seqs, [7, 8, 9, 5], cache.tasks.pages, 4, [7, 2], [2, 3])


def test_the_layout_is_worked_out_from_the_page_tables(batch):
    assert batch.block_tables.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert batch.table_lengths.tolist() == [3, 2]
    assert batch.positions.tolist() == [6, 7, 8, 4]
    assert batch.slots.tolist() == [1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 4 * 4 + 0]
    # a row rotates for its position + 1 tokens, or its prompt's length if longer
    assert batch.rope_lengths.tolist() == [7, 8, 9, 5]
    assert batch.row_tables.tolist() == [[0, 1, 2]] * 3 + [[3, 4, 0]]
    assert not batch.decodes_only and not batch.one_row_each
    assert not batch.logits_of_every_row  # rows 2 and 3 of 0..3


def test_a_step_of_decodes_reads_its_rows_as_its_sequences():
    """One token a sequence: row i is sequence i, its position its start, its table its own;
    logits of every row in order need no rows picked, in any other order or number they do."""
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    assert cache.allocate(0, 9) and cache.allocate(1, 5)

    def decodes(logit_rows):
        return StepBatch.build(
            [(0, 8, 1), (1, 4, 1)], [7, 5], cache.tasks.pages, 4, [7, 2], logit_rows
        )

    batch = decodes([0, 1])
    assert batch.one_row_each and batch.decodes_only and batch.logits_of_every_row
    assert batch.positions.tolist() == [8, 4] and batch.slots.tolist() == [2 * 4, 4 * 4]
    assert batch.row_tables is batch.block_tables
    assert [decodes(rows).logits_of_every_row for rows in ([1, 0], [1], [])] == [False] * 3


def test_a_worker_receives_the_batch_as_it_was_sent(batch):
    header, body = batch.pack()
    assert StepBatch.body_size(header) == body.numel()
    received = StepBatch.unpack(header, body.clone(), page_size=4)
    for name in ("token_ids", "starts", "lengths", "spans", "block_tables", "table_lengths"):
        np.testing.assert_array_equal(getattr(received, name), getattr(batch, name))
    np.testing.assert_array_equal(received.logit_rows, batch.logit_rows)
    np.testing.assert_array_equal(received.slots, batch.slots)


def test_a_batch_with_images_is_not_sent(batch):
    batch.images = ImageRows(torch.tensor([0]), torch.zeros(1, 8))
    with pytest.raises(AssertionError, match="no image embeddings"):
        batch.pack()


def test_positions_without_pages_are_refused():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    assert cache.allocate(0, 4)
    with pytest.raises(ValueError, match="positions 4..4 need 2 pages but it holds 1"):
        StepBatch.build([(0, 4, 1)], [1], cache.tasks.pages, 4)
