"""CacheView, the attention backend the model sees for one forward pass over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from astrai.inference.kv_cache import KVStore
from astrai.inference.step_batch import StepBatch
from astrai.kernels.paged_attention import PagedDecode
from astrai.kernels.triton_attention import paged_attention, query_block, store_kv
from astrai.model.transformer import LayerAttention, attend


class CacheView:
    """The model's attention backend for one forward pass over a StepBatch on the CPU (or any
    device without Triton).

    The constructor resolves every index once -- write slots, page tables, each prompt chunk's
    pages -- and the masks are made once per sliding window, so a layer's call is tensor work
    only. Where the C kernel runs (a CPU cache), a layer's call is one kernel call for every
    row, a prompt's rows too: it stores the step's new K/V, then attends each row over its
    pages in place, summing in one order whatever shares the step, so greedy output does not
    depend on chunking, prefix-cache hits or the batch. Elsewhere it writes the new K/V,
    attends the decodes (one SDPA call per group of gathered pages), then one SDPA call per
    prompt chunk. The pages of a sliding layer's keys that lie outside its window
    are kept: other layers still read them, and so does the prefix cache. A cache of another
    dtype than the model's (kv_cache_dtype) holds K/V rounded to its dtype, and every path
    attends over those rounded values in the model's dtype, so a prompt's result is the same
    whether its keys come from the cache or not.
    """

    def __init__(self, kv: KVStore, batch: StepBatch):
        device = kv.k_cache.device
        self.k_cache, self.v_cache = kv.k_cache, kv.v_cache
        # [num_tokens] the model's rope positions, one per flattened token
        self.positions = torch.from_numpy(batch.positions).to(device)
        self.paged_decode: PagedDecode | None = None
        self.decode_groups: list[DecodeGroup] = []
        self.chunks: list[PromptChunk] = []
        if PagedDecode.supports(kv.k_cache):
            # Every row, a prompt's too, on the kernel, which sums a row's scores and values in
            # one order whatever else is in the step: a token's result is then the same
            # whether it is prefilled with the whole prompt, in a later chunk, after a prefix
            # cache hit, alone or in a batch (SDPA's rounding changes with the rows it is given).
            # It stores the rows' K/V itself, at the slots their tables and positions give.
            self.paged_decode = PagedDecode(
                kv.k_cache,
                kv.v_cache,
                rows=torch.from_numpy(np.arange(len(batch.positions), dtype=np.int64)),
                block_tables=torch.from_numpy(batch.row_tables),
                context_lens=self.positions + 1,
                key_ends=None if batch.key_ends is None else torch.from_numpy(batch.key_ends),
            )
            return
        self.slot_mapping = torch.from_numpy(batch.slots).to(device)
        starts, lens, offsets = batch.starts, batch.lengths, batch.first_rows
        block_table, table_lengths = batch.block_tables, batch.table_lengths
        decodes = np.flatnonzero(lens == 1)
        if len(decodes):
            for group in group_by_context(table_lengths[decodes].tolist(), decodes.tolist()):
                n_pages = int(table_lengths[group].max())
                self.decode_groups.append(
                    DecodeGroup.build(
                        kv,
                        rows=None
                        if len(group) == len(batch.row_seqs)
                        else torch.from_numpy(offsets[group]).to(device),
                        tables=torch.from_numpy(block_table[group, :n_pages]).to(device),
                        positions=torch.from_numpy(starts[group]).to(device),
                    )
                )

        self.chunks = [
            PromptChunk(
                rows=slice(int(offsets[i]), int(offsets[i]) + n),
                start=start,
                device=device,
                # a chunk from position 0 sees only its own new K/V, so it needs no pages
                pages=None
                if start == 0
                else torch.from_numpy(block_table[i, : table_lengths[i]]).to(device),
                key_ends=None
                if batch.key_ends is None
                else torch.from_numpy(batch.key_ends[offsets[i] : offsets[i] + n]).to(device),
            )
            for i, (start, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True))
            if n > 1
        ]

    @property
    def kernel_step(self) -> torch.Tensor | None:
        """For decodes alone on the C kernel, the step's decodes as the kernel reads them
        (PagedDecode.step): a replayed step copies them into its own, which the calls it bound
        once read (bind with step); None for any other step, whose calls are bound afresh."""
        if self.paged_decode is not None and not self.chunks:
            return self.paged_decode.step
        return None

    def bind(
        self,
        layer: LayerAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        step: torch.Tensor | None = None,
    ) -> Callable[[], object]:
        """The layer's attention as a call that writes into out [num_tokens, heads, hd]; for
        decodes alone on the C kernel, the kernel call itself (it stores all their K/V, then
        attends), reading the decodes from step if given (see kernel_step)."""
        if self.kernel_step is not None:
            return self._kernel_call(layer, q, out, k, v, step)
        return partial(self._attend, layer, q, k, v, out)

    def _kernel_call(
        self, layer: LayerAttention, q, out, k=None, v=None, step=None
    ) -> Callable[[], None]:
        return self.paged_decode.kernel_call(
            layer.index, q, out, k, v, scale=layer.scale, window=layer.window,
            softcap=layer.softcap, step=step,
        )  # fmt: skip

    def __call__(
        self, layer: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k, v [num_tokens, kvh, hd] to the cache; attend q [num_tokens, heads, hd]."""
        out = q.new_empty(q.shape)
        self.bind(layer, q, k, v, out)()
        return out

    def _attend(self, layer: LayerAttention, q, k, v, out) -> None:
        """bind's call where chunks or decode groups take part: q, k, v and out as bind's."""
        k_layer, v_layer = self.k_cache[layer.index], self.v_cache[layer.index]
        kv_heads, head_dim = k_layer.shape[-2:]  # k_layer: [pages, ps, kvh, hd]
        k, v = k.to(k_layer.dtype), v.to(k_layer.dtype)  # no copy when the dtypes agree
        k_layer.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, k)
        v_layer.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, v)
        if self.paged_decode is not None:
            self._kernel_call(layer, q, out)()
        for group in self.decode_groups:
            group.attend(layer, k_layer, v_layer, q, out)
        for chunk in self.chunks:
            rows, n_keys = chunk.rows, chunk.start + chunk.rows.stop - chunk.rows.start
            if chunk.pages is None:
                k_seq, v_seq = k[rows], v[rows]  # [n, kvh, hd]
            else:
                k_seq = k_layer[chunk.pages].flatten(0, 1)[:n_keys]  # [start + n, kvh, hd]
                v_seq = v_layer[chunk.pages].flatten(0, 1)[:n_keys]
            o_seq = attend(
                q[rows].transpose(0, 1)[None],
                k_seq.to(q.dtype).transpose(0, 1)[None],
                v_seq.to(q.dtype).transpose(0, 1)[None],
                chunk.mask(layer.window),
                layer,
            )
            out[rows] = o_seq[0].transpose(0, 1)


def visible_keys(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    window: int | None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """True where a query at query_pos [..., 1] sees the key at key_pos [n_keys]: at or before
    it (before its key end [..., 1], where it has one), and within its window if it has one."""
    visible = key_pos <= query_pos if key_ends is None else key_pos < key_ends
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


@dataclass
class PromptChunk:
    """A prompt chunk of a step: its rows in the batch, its first position, the pages of its
    keys (None when it starts at 0: its keys are its own new K/V), and where each row's keys
    end (None: at its own; StepBatch.key_ends)."""

    rows: slice
    start: int
    device: torch.device
    pages: torch.Tensor | None
    key_ends: torch.Tensor | None = None
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[n, start + n] True where a query sees a key, made once per window; None for plain
        causal attention over the chunk's own keys."""
        if window not in self.masks:
            n = self.rows.stop - self.rows.start
            key_pos = torch.arange(self.start + n, device=self.device)
            query_pos = torch.arange(self.start, self.start + n, device=self.device)[:, None]
            causal_alone = self.start == 0 and window is None and self.key_ends is None
            key_ends = None if self.key_ends is None else self.key_ends[:, None]
            self.masks[window] = (
                None if causal_alone else visible_keys(query_pos, key_pos, window, key_ends)
            )
        return self.masks[window]


# What one more decode group costs against one more gathered page per decode (an index_select,
# an SDPA call and the scatter back weigh about as much as gathering and attending 16 pages).
GROUP_COST_PAGES = 16


def group_by_context(n_pages: Sequence[int], ids: Sequence[int]) -> list[list[int]]:
    """Split decodes into groups of similar context length, cheapest in gathered pages.

    A group pads every decode to its longest context, so one group for all would gather and
    attend over max(n_pages) pages per decode. Sorted by length, the split that minimises
    padded pages plus GROUP_COST_PAGES per group is found by dynamic programming.
    """
    order = sorted(range(len(ids)), key=n_pages.__getitem__)
    lengths = [n_pages[i] for i in order]
    # best[j]: cost of grouping the j shortest; cut[j]: where the last of those groups starts
    best, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        best[j], cut[j] = min(
            (best[i] + GROUP_COST_PAGES + (j - i) * lengths[j - 1], i) for i in range(j)
        )
    groups, j = [], len(order)
    while j:
        groups.append([ids[k] for k in sorted(order[cut[j] : j])])  # in batch order
        j = cut[j]
    return groups[::-1]


@dataclass
class DecodeGroup:
    """Decodes attended by one SDPA call over their pages, gathered into reused buffers."""

    rows: torch.Tensor | None  # [n] their rows in the batch; None: all rows, in order
    pages: torch.Tensor  # [n * n_pages] page ids, padded with page 0
    positions: torch.Tensor  # [n, 1] each decode's query position
    key_pos: torch.Tensor  # [n_pages * page_size] the positions of the gathered keys
    k: torch.Tensor  # [n * n_pages, page_size, kvh, hd] gather buffers, reused by every layer
    v: torch.Tensor
    # per window: [n, 1, 1, n_pages * page_size] True for the keys each query sees
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        kv: KVStore,
        rows: torch.Tensor | None,
        tables: torch.Tensor,
        positions: torch.Tensor,
    ) -> DecodeGroup:
        """tables [n, n_pages] padded with page 0; positions [n]: each decode's query position."""
        key_pos = torch.arange(tables.shape[1] * kv.page_size, device=tables.device)
        # Allocating megabytes per layer costs more than the copy into them.
        k = kv.k_cache.new_empty((tables.numel(), *kv.k_cache.shape[2:]))
        return cls(
            rows=rows,
            pages=tables.flatten(),
            positions=positions[:, None],
            key_pos=key_pos,
            k=k,
            v=torch.empty_like(k),
        )

    def attend(
        self,
        layer: LayerAttention,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        q: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Write this group's attention outputs into out [num_tokens, heads, hd]."""
        n = len(self.positions)
        if layer.window not in self.masks:
            visible = visible_keys(self.positions, self.key_pos, layer.window)
            self.masks[layer.window] = visible[:, None, None, :]
        kv_heads, head_dim = k_layer.shape[-2:]
        torch.index_select(k_layer, 0, self.pages, out=self.k)
        torch.index_select(v_layer, 0, self.pages, out=self.v)
        k = self.k.view(n, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)  # [n, kvh, ctx, hd]
        v = self.v.view(n, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        # The query heads sharing a KV head become that head's query rows, so GQA needs no
        # repeated K/V: q [n, kvh, heads // kvh, hd].
        q = q if self.rows is None else q.index_select(0, self.rows)
        o = attend(q.view(n, kv_heads, -1, head_dim), k, v, self.masks[layer.window], layer)
        o = o.reshape(n, -1, head_dim)
        if self.rows is None:
            out.copy_(o)
        else:
            out.index_copy_(0, self.rows, o)


def ragged_layout(
    batch: StepBatch, block_q: int, pad_seqs: int = 0, table_width: int | None = None
) -> dict[str, np.ndarray]:
    """A StepBatch as the int64 arrays a CUDA step uploads (a recorded step refills its buffer
    with them in this order).

    pad_seqs sequences of no tokens follow the batch's, each owning one row (a recorded step's
    padding: token 0, slot -1, nothing stored, output zeros); table_width pads every page table
    to that many pages.
    """
    padding = np.zeros(pad_seqs, dtype=np.int64)
    starts = np.concatenate((batch.starts, padding))
    lens = np.concatenate((batch.lengths, padding))
    owned = np.maximum(lens, 1)
    rows = np.concatenate(([0], np.cumsum(owned)[:-1]))
    width = table_width or batch.block_tables.shape[1]
    block_tables = np.zeros((len(starts), width), dtype=np.int64)
    block_tables[: batch.n_seqs, : batch.block_tables.shape[1]] = batch.block_tables
    blocks_per_seq = -(-owned // block_q)
    block_seq = np.repeat(np.arange(len(starts)), blocks_per_seq)
    first_block = np.cumsum(blocks_per_seq) - blocks_per_seq  # each sequence's first block
    block_first = (np.arange(len(block_seq)) - np.repeat(first_block, blocks_per_seq)) * block_q
    return {
        "token_ids": np.concatenate((batch.token_ids, padding)),
        "positions": np.concatenate((batch.positions, padding)),
        "key_ends": np.concatenate((batch.visible_ends, padding)),
        "rope_lengths": np.concatenate((batch.rope_lengths, padding + 1)),
        "slot_mapping": np.concatenate((batch.slots, padding - 1)),
        "seq_starts": starts,
        "seq_rows": rows,
        "seq_lens": lens,
        "block_seq": block_seq,
        "block_first": block_first,
        "block_tables": block_tables,
    }


class DeviceCacheView:
    """The attention backend on CUDA: each layer stores its new K/V with one kernel, then
    attends every row of the batch -- prompt chunks and decode rows -- with another, over the
    pages in place (astrai.kernels.triton_attention). The rows' K/V are all stored before any
    attends, so a chunk reads its own keys from the cache, rounded to its dtype, as decodes do.

    Its tensors are the uploaded ragged_layout; a recorded step builds one view over static
    buffers and refills them before each replay.
    """

    def __init__(self, kv: KVStore, fields: dict[str, torch.Tensor], block_q: int):
        self.k_cache, self.v_cache = kv.k_cache, kv.v_cache
        self.fields = fields
        self.block_q = block_q
        self.positions = fields["positions"]
        self.rope_lengths = fields["rope_lengths"]
        self.token_ids = fields["token_ids"]

    @classmethod
    def build(
        cls,
        kv: KVStore,
        batch: StepBatch,
        n_heads: int,
        upload: Callable[[dict[str, np.ndarray]], dict[str, torch.Tensor]],
        **extra: np.ndarray,
    ) -> DeviceCacheView:
        """The view of one eager step: its layout built on the host and uploaded at once, with
        any extra arrays the step needs on the device (in view.fields)."""
        group = n_heads // kv.k_cache.shape[3]
        block_q = query_block(group, int(batch.lengths.max()))
        return cls(kv, upload({**ragged_layout(batch, block_q), **extra}), block_q)

    def __call__(
        self, layer: LayerAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_layer, v_layer = self.k_cache[layer.index], self.v_cache[layer.index]
        fields = self.fields
        store_kv(k, v, k_layer, v_layer, fields["slot_mapping"])
        out = q.new_empty(q.shape)
        paged_attention(
            q, k_layer, v_layer, out, fields["block_tables"], fields["seq_starts"],
            fields["seq_rows"], fields["seq_lens"], fields["block_seq"], fields["block_first"],
            fields["key_ends"], self.block_q, layer.scale, layer.window, layer.softcap,
        )  # fmt: skip
        return out
