"""The attention backend the model sees for one forward pass over the paged KV cache.

CacheView writes each layer's new K/V into the cache's pages and attends every sequence of a
ragged batch over its own pages: decodes on the C kernel that reads the pages in place (or
SDPA over gathered pages), prompt chunks on SDPA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from astrai.inference.kv_cache import PagedCache

try:
    from astrai.inference import _paged_attention
except ImportError:  # installed without a C compiler: decodes gather their pages for SDPA
    _paged_attention = None


class CacheView:
    """The model's attention backend for one forward pass over a ragged batch.

    view() resolves every index once -- write slots, the decodes' page tables, each prompt
    chunk's pages and causal mask -- so each layer's call is tensor work only: write the layer's
    new K/V, attend the decodes (one C kernel call that reads their pages in place for fp32 and
    bf16 on the CPU, else one SDPA call per group of gathered pages), then one SDPA call per
    prompt chunk.
    """

    def __init__(self, cache: PagedCache, seqs: Sequence[tuple[int, int, int]]):
        page_size, device = cache.page_size, cache.k_cache.device
        self.k_cache, self.v_cache = cache.k_cache, cache.v_cache
        tables, offsets, num_tokens = [], [], 0
        for task_id, start, n in seqs:
            pages = cache.tasks.pages(task_id)
            n_ctx_pages = -(-(start + n) // page_size)
            if start < 0 or n < 1 or n_ctx_pages > len(pages):
                raise ValueError(
                    f"task {task_id}: positions {start}..{start + n - 1} need {n_ctx_pages} "
                    f"pages but it holds {len(pages)}; allocate before the forward pass"
                )
            tables.append(pages[:n_ctx_pages])
            offsets.append(num_tokens)
            num_tokens += n
        max_pages = max(len(table) for table in tables)
        padded = [table + [0] * (max_pages - len(table)) for table in tables]
        block_table = torch.tensor(padded, device=device)  # [num_seqs, max_pages]
        starts = torch.tensor([start for _, start, _ in seqs], device=device)
        lens = torch.tensor([n for _, _, n in seqs], device=device)
        first_rows = torch.tensor(offsets, device=device)
        seq_ids = torch.arange(len(seqs), device=device)
        seq_of_row = torch.repeat_interleave(seq_ids, lens, output_size=num_tokens)
        pos = torch.arange(num_tokens, device=device) - first_rows[seq_of_row] + starts[seq_of_row]
        self.positions = pos  # [num_tokens] the model's rope positions, one per flattened token
        self.slot_mapping = block_table[seq_of_row, pos // page_size] * page_size + pos % page_size

        decodes = [i for i, (_, _, n) in enumerate(seqs) if n == 1]
        self.paged_decode: PagedDecode | None = None
        self.decode_groups: list[DecodeGroup] = []
        if decodes and PagedDecode.supports(cache):
            index = torch.tensor(decodes, device=device)
            self.paged_decode = PagedDecode(
                cache,
                rows=first_rows[index],
                block_tables=block_table[index],
                context_lens=starts[index] + 1,
            )
        elif decodes:
            self.decode_groups = [
                DecodeGroup.build(
                    cache,
                    rows=[offsets[i] for i in group],
                    tables=[tables[i] for i in group],
                    positions=[seqs[i][1] for i in group],
                    all_rows=len(group) == num_tokens,
                )
                for group in group_by_context([len(tables[i]) for i in decodes], decodes)
            ]

        # (rows, pages, causal mask offset by start); a chunk from position 0 sees only its own
        # new K/V, so it needs neither pages nor an explicit mask.
        self.chunks: list[tuple[slice, torch.Tensor | None, torch.Tensor | None]] = []
        for i, (_, start, n) in enumerate(seqs):
            if n == 1:
                continue
            rows = slice(offsets[i], offsets[i] + n)
            if start == 0:
                self.chunks.append((rows, None, None))
                continue
            key_pos = torch.arange(start + n, device=device)
            query_pos = torch.arange(start, start + n, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, start + n]
            self.chunks.append((rows, block_table[i, : len(tables[i])], mask))

    def decode_calls(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
    ) -> list[Callable[[], None]] | None:
        """For a step of decodes alone on the C kernel: each layer's attention as a call with
        its arguments resolved, doing what __call__(layer, q, k, v) does but writing into out.
        None for any other step. For a caller whose q, k, v and out stay where they are for
        every layer (the kernel layers): some 40 us of Python a layer saved."""
        if self.paged_decode is None or self.chunks:
            return None
        return [
            self.paged_decode.kernel_call(layer, q, out, k, v)
            for layer in range(self.k_cache.shape[0])
        ]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k, v [num_tokens, kvh, hd] to the cache; attend q [num_tokens, heads, hd]."""
        out = q.new_empty(q.shape)
        if self.paged_decode is not None and not self.chunks:
            # Decodes alone: the kernel stores their K/V as it attends, in one call.
            self.paged_decode.kernel_call(layer_idx, q, out, k, v)()
            return out
        k_layer, v_layer = self.k_cache[layer_idx], self.v_cache[layer_idx]  # [pages, ps, kvh, hd]
        kv_heads, head_dim = k_layer.shape[-2:]
        k_layer.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, k)
        v_layer.view(-1, kv_heads, head_dim).index_copy_(0, self.slot_mapping, v)
        if self.paged_decode is not None:
            self.paged_decode.kernel_call(layer_idx, q, out)()
        for group in self.decode_groups:
            out = group.attend(k_layer, v_layer, q, out)
        for rows, pages, mask in self.chunks:
            if pages is None:
                k_seq, v_seq = k[rows], v[rows]  # [n, kvh, hd]
            else:
                k_seq = k_layer[pages].flatten(0, 1)[: mask.shape[1]]  # [start + n, kvh, hd]
                v_seq = v_layer[pages].flatten(0, 1)[: mask.shape[1]]
            o_seq = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                k_seq.transpose(0, 1)[None],
                v_seq.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            out[rows] = o_seq[0].transpose(0, 1)
        return out


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
    mask: torch.Tensor  # [n, 1, 1, n_pages * page_size] True for keys at or before the query
    k: torch.Tensor  # [n * n_pages, page_size, kvh, hd] gather buffers, reused by every layer
    v: torch.Tensor

    @classmethod
    def build(
        cls,
        cache: PagedCache,
        rows: Sequence[int],
        tables: Sequence[list[int]],
        positions: Sequence[int],
        all_rows: bool,
    ) -> DecodeGroup:
        device = cache.k_cache.device
        n_pages = max(len(table) for table in tables)
        padded = [page for table in tables for page in table + [0] * (n_pages - len(table))]
        key_pos = torch.arange(n_pages * cache.page_size, device=device)
        query_pos = torch.tensor(positions, device=device)
        # Allocating megabytes per layer costs more than the copy into them.
        k = cache.k_cache.new_empty((len(padded), *cache.k_cache.shape[2:]))
        return cls(
            rows=None if all_rows else torch.tensor(rows, device=device),
            pages=torch.tensor(padded, device=device),
            mask=(key_pos <= query_pos[:, None])[:, None, None, :],
            k=k,
            v=torch.empty_like(k),
        )

    def attend(
        self, k_layer: torch.Tensor, v_layer: torch.Tensor, q: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Write this group's attention outputs into out [num_tokens, heads, hd]; return it."""
        n = len(self.mask)
        kv_heads, head_dim = k_layer.shape[-2:]
        torch.index_select(k_layer, 0, self.pages, out=self.k)
        torch.index_select(v_layer, 0, self.pages, out=self.v)
        k = self.k.view(n, -1, kv_heads, head_dim).transpose(1, 2)  # [n, kvh, ctx, hd]
        v = self.v.view(n, -1, kv_heads, head_dim).transpose(1, 2)
        # The query heads sharing a KV head become that head's query rows, so GQA needs no
        # repeated K/V: q [n, kvh, heads // kvh, hd].
        q = q if self.rows is None else q.index_select(0, self.rows)
        o = F.scaled_dot_product_attention(q.view(n, kv_heads, -1, head_dim), k, v, self.mask)
        o = o.reshape(n, -1, head_dim)
        if self.rows is None:
            return o
        return out.index_copy_(0, self.rows, o)


class PagedDecode:
    """All decodes of a step, attended by the C kernel that reads their pages in place.

    For fp32 and bf16 on the CPU when the extension was built (bf16 computed in fp32 and
    rounded once, at the output); it needs no gather buffers and no
    grouping by context length, and each decode's result is independent of the batch. The
    kernel's arguments are resolved to plain ints once per step, so a layer's call costs one
    allocation and one C call.
    """

    def __init__(
        self,
        cache: PagedCache,
        rows: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ):
        """rows [n]: each decode's row in the batch; block_tables [n, max_pages] (padded with
        page 0, contiguous) and context_lens [n]: the keys each sees, its own included."""
        # The kernel reads these through raw pointers: keep the tensors alive with the view.
        self.rows, self.block_tables, self.context_lens = rows, block_tables, context_lens
        k_cache = cache.k_cache  # [n_layers, n_pages, page_size, kvh, hd]
        self.k_cache_ptr, self.v_cache_ptr = k_cache.data_ptr(), cache.v_cache.data_ptr()
        self.layer_bytes = k_cache.stride(0) * k_cache.element_size()
        self.kv_heads, self.head_dim = k_cache.shape[-2:]
        self.dtype, self.is_bf16 = k_cache.dtype, k_cache.dtype == torch.bfloat16
        self.tables_and_sizes = (
            rows.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            len(rows),
            block_tables.shape[1],
            k_cache.shape[2],
        )

    @staticmethod
    def supports(cache: PagedCache) -> bool:
        k = cache.k_cache
        return (
            _paged_attention is not None
            and k.device.type == "cpu"
            and k.dtype in (torch.float32, torch.bfloat16)
            and k.shape[-1] % 8 == 0  # the kernel scores 8 values of head_dim at a time
        )

    def kernel_call(
        self,
        layer_idx: int,
        q: torch.Tensor,
        out: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> Callable[[], None]:
        """The kernel call that writes the decodes' attention outputs into out [num_tokens,
        heads, hd], its arguments resolved to plain ints; it holds q, k, v and out (or their
        heads-contiguous copies), so the memory it points at lives as long as it does.

        With k and v [num_tokens, kvh, hd] the kernel first stores the decodes' rows of them in
        the cache; without, the caller has stored them.
        """
        if q.dtype != self.dtype:  # the kernel reads every tensor as the cache's dtype
            raise ValueError(f"q is {q.dtype} but the KV cache holds {self.dtype}")
        q, k, v = (heads_contiguous(t, self.head_dim) for t in (q, k, v))
        layer_offset = layer_idx * self.layer_bytes
        call = partial(
            _paged_attention.decode,
            out.data_ptr(),
            q.data_ptr(),
            q.stride(0),
            0 if k is None else k.data_ptr(),
            0 if k is None else k.stride(0),
            0 if v is None else v.data_ptr(),
            0 if v is None else v.stride(0),
            self.k_cache_ptr + layer_offset,
            self.v_cache_ptr + layer_offset,
            *self.tables_and_sizes,
            q.shape[1],
            self.kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.is_bf16,
        )
        call.keep_alive = (q, k, v, out)  # heads_contiguous's copies must outlive the call
        return call


def heads_contiguous(t: torch.Tensor | None, head_dim: int) -> torch.Tensor | None:
    """t [rows, heads, head_dim] with each row's heads in one run of floats, as the kernel
    walks them; rows may lie any distance apart."""
    if t is None or (t.stride(2) == 1 and t.stride(1) == head_dim):
        return t
    return t.contiguous()
