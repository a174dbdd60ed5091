"""Paged attention over a ragged batch on the GPU, as two Triton kernels.

One launch stores the step's new K/V into their cache slots; one launch attends every query
of the batch -- prompt chunks and decode rows alike -- over its sequence's pages, read in place
through the page table (no gather). A program takes one block of a sequence's queries for one
KV head: the query heads that share the KV head are rows of the same tile, so GQA reads each
key once per group. Softmax is online (flash-attention style) in fp32.

Triton is optional: `available` is False without it, and a CUDA step needs it. It is imported
only where a GPU could run the kernels, or where TRITON_INTERPRET=1 asks to run them on CPU
tensors (as CI checks them): a CPU process has no use for it and its import time.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

triton = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        import triton.language as tl
    except ImportError:  # PyTorch without Triton: the CPU paths run as they always do
        triton = None

available = triton is not None

# Query rows of one program's tile: the query heads of a KV head times the queries of a block.
TILE_ROWS = 64
# Keys attended per loop iteration: a decode-only step has few programs (one per sequence and
# KV head), each bound by the latency of its loop's loads, so it takes larger strides.
KEY_TILE, DECODE_KEY_TILE = 32, 128


def query_block(group: int, max_new_tokens: int) -> int:
    """Queries per program: 1 for a decode-only step (the group's heads fill the tile), else as
    many as fill TILE_ROWS rows with the group's heads."""
    return 1 if max_new_tokens == 1 else max(1, TILE_ROWS // group)


def tile_rows(group: int, block_q: int) -> int:
    """The tile's row count: a power of two of at least 16 (the matrix units' least)."""
    return max(16, triton.next_power_of_2(group * block_q))


if available:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        stride_k,
        stride_v,
        WIDTH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        if slot >= 0:  # a padding row of a recorded step has slot -1 and stores nothing
            cols = tl.arange(0, BLOCK)
            inside = cols < WIDTH
            k = tl.load(k_ptr + row * stride_k + cols, mask=inside)
            v = tl.load(v_ptr + row * stride_v + cols, mask=inside)
            dest = slot.to(tl.int64) * WIDTH + cols
            tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_tables_ptr,
        seq_starts_ptr,
        seq_rows_ptr,
        seq_lens_ptr,
        block_seq_ptr,
        block_first_ptr,
        key_ends_ptr,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_table,
        scale,
        softcap,
        window,
        PAGE_SIZE: tl.constexpr,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        ROWS: tl.constexpr,
        KEYS: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        block = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq = tl.load(block_seq_ptr + block)
        first = tl.load(block_first_ptr + block)  # the block's first query, within its sequence
        start = tl.load(seq_starts_ptr + seq)  # the position of the sequence's first new token
        n_new = tl.load(seq_lens_ptr + seq)  # 0: a padding row, written as zeros
        row0 = tl.load(seq_rows_ptr + seq)

        r = tl.arange(0, ROWS)
        query = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        in_tile = r < BLOCK_Q * GROUP
        live = in_tile & (query < n_new)
        query_pos = start + query
        d = tl.arange(0, HEAD_PAD)
        d_in = d < HEAD_DIM
        q_offsets = (row0 + query).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_offsets + d[None, :], mask=live[:, None] & d_in[None, :], other=0.0)

        acc = tl.zeros([ROWS, HEAD_PAD], dtype=tl.float32)
        row_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([ROWS], dtype=tl.float32)
        # Keys up to the block's last key end (its last query's own key, or the end of the image
        # a query's tokens see); with a window, from its first query's window on.
        key_end = tl.load(key_ends_ptr + row0 + query, mask=live, other=0)
        end = tl.max(key_end, 0)
        begin = 0
        if HAS_WINDOW:
            begin = tl.maximum(start + first - window + 1, 0) // KEYS * KEYS
        slot_stride = KV_HEADS * HEAD_DIM
        for key0 in range(begin, end, KEYS):
            key = key0 + tl.arange(0, KEYS)
            key_in = key < end
            page = tl.load(block_tables_ptr + seq * stride_table + key // PAGE_SIZE, mask=key_in)
            slot = page.to(tl.int64) * PAGE_SIZE + key % PAGE_SIZE
            kv_offsets = slot[:, None] * slot_stride + kv_head * HEAD_DIM + d[None, :]
            kv_mask = key_in[:, None] & d_in[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            if HAS_SOFTCAP:  # c * tanh(x / c), tanh written with exp (no tl.tanh)
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
            visible = (key[None, :] < key_end[:, None]) & key_in[None, :]
            if HAS_WINDOW:
                visible = visible & (key[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row seeing no key yet
            p = tl.exp(scores - safe_max[:, None])
            rescale = tl.exp(row_max - safe_max)
            row_sum = row_sum * rescale + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * rescale[:, None] + pv
            row_max = new_max
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        owned = in_tile & (query < tl.maximum(n_new, 1))  # a padding sequence owns one row
        o_offsets = (row0 + query).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            out_ptr + o_offsets + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=owned[:, None] & d_in[None, :],
        )


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] to the slots [num_tokens] of one layer's
    caches [pages, page_size, kv_heads, head_dim] (cast to their dtype); slot -1 skips a row."""
    width = k.shape[1] * k.shape[2]
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != k.shape[2]:
            raise ValueError("each row's K/V heads must lie side by side")
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0),
        WIDTH=width, BLOCK=triton.next_power_of_2(width),
    )  # fmt: skip


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    block_tables: Tensor,
    seq_starts: Tensor,
    seq_rows: Tensor,
    seq_lens: Tensor,
    block_seq: Tensor,
    block_first: Tensor,
    key_ends: Tensor,
    block_q: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attend q [num_tokens, heads, head_dim] over one layer's paged caches into out.

    Sequence s has seq_lens[s] new tokens at rows seq_rows[s].. of q, at positions
    seq_starts[s].., its keys at positions 0 .. seq_starts[s] + seq_lens[s] - 1 in the pages
    block_tables[s]. Program b attends queries block_first[b] .. + block_q - 1 of sequence
    block_seq[b]. The query of row r, at position p, sees keys p - window + 1 .. e - 1 (from 0
    without a window), e its key end key_ends[r]: p + 1, or past p for the tokens of an image
    that see each other (StepBatch.key_ends); soft-capped scores are c * tanh(x / c).
    """
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    for t in (q, out):
        if t.stride(2) != 1:
            raise ValueError("q and out must have contiguous head dimensions")
    grid = (block_seq.shape[0], kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_starts, seq_rows, seq_lens, block_seq,
        block_first, key_ends, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale, softcap or 1.0, window or 0,
        PAGE_SIZE=k_cache.shape[1], KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim,
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q,
        ROWS=tile_rows(group, block_q), KEYS=DECODE_KEY_TILE if block_q == 1 else KEY_TILE,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
