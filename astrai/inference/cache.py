"""The paged KV cache: physical pages, the prefix cache over them, and each task's page table.

PagedCache is the facade the scheduler and executor use. It composes three parts with one job
each -- PagePool (which pages are free, owned or cached), PrefixCache (which page holds the KV of
a given token prefix) and TaskTable (which pages each task reads and writes) -- and owns the K/V
tensors. CacheView is all the model sees of it: the attention backend for one forward pass.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

try:
    from astrai.inference import _paged_attention
except ImportError:  # installed without a C compiler: decodes gather their pages for SDPA
    _paged_attention = None


class CacheInvariantError(RuntimeError):
    """The page accounting is inconsistent: a bug in the cache or in the code that drives it."""


@dataclass
class CacheStats:
    """A snapshot of page usage and of how much prompt the prefix cache saved."""

    n_pages: int
    free: int
    owned: int
    cached: int
    hit_tokens: int
    lookup_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PagePool:
    """Physical pages and their life cycle: free -> owned (refcount > 0) -> cached or free.

    A page whose last owner lets go stays cached when the prefix cache knows its contents: it
    keeps its KV for later hits, but is the first to go, least recently released first, when an
    allocation finds no free page.
    """

    def __init__(self, n_pages: int):
        self.refcount = [0] * n_pages
        self.free = list(range(n_pages - 1, -1, -1))  # a stack that hands out page 0 first
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first

    def available(self) -> int:
        return len(self.free) + len(self.lru)

    def evict(self) -> int:
        """Turn the least recently cached page into a free one and return it."""
        page, _ = self.lru.popitem(last=False)
        self.free.append(page)
        return page

    def take(self, n: int) -> list[int]:
        """Hand n free pages to one owner; the caller evicts first when fewer are free."""
        pages = [self.free.pop() for _ in range(n)]
        for page in pages:
            self.refcount[page] = 1
        return pages

    def incref(self, page: int) -> None:
        if self.refcount[page] == 0:
            del self.lru[page]  # a prefix hit brings a cached page back into use
        self.refcount[page] += 1

    def decref(self, page: int, keep: bool) -> None:
        """Drop one owner; the last one leaves the page cached if keep, else free."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if keep:
                self.lru[page] = None
            else:
                self.free.append(page)


@dataclass(frozen=True)
class PrefixEntry:
    """What a registered page holds: one full page of tokens following the prefix parent_key."""

    key: bytes
    parent_key: bytes | None
    tokens: tuple[int, ...]


class PrefixCache:
    """Chained page keys -> the physical page holding that prefix's KV.

    The key of page i hashes the key of page i-1 with page i's token ids, so a page is found
    only after the whole prefix before it matched. A hit also compares the entry's parent key
    and token ids with the request's: a colliding hash is a miss, never another prompt's KV.
    """

    def __init__(self):
        self.pages: dict[bytes, int] = {}
        self.entries: dict[int, PrefixEntry] = {}

    @staticmethod
    def page_key(parent_key: bytes | None, tokens: Sequence[int]) -> bytes:
        digest = hashlib.blake2b(parent_key or b"", digest_size=16)
        digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
        return digest.digest()

    def get(self, key: bytes, parent_key: bytes | None, tokens: Sequence[int]) -> int | None:
        page = self.pages.get(key)
        entry = self.entries.get(page)
        if entry is None or entry.parent_key != parent_key or entry.tokens != tuple(tokens):
            return None
        return page

    def add(self, key: bytes, parent_key: bytes | None, tokens: Sequence[int], page: int) -> None:
        """Register page under key; when the key is taken the page it already names stays."""
        if key not in self.pages and page not in self.entries:
            self.pages[key] = page
            self.entries[page] = PrefixEntry(key, parent_key, tuple(tokens))

    def remove(self, page: int) -> None:
        entry = self.entries.pop(page, None)
        if entry is not None:
            del self.pages[entry.key]

    def __contains__(self, page: int) -> bool:
        return page in self.entries


@dataclass
class TaskPages:
    """One task's share of the cache."""

    pages: list[int] = field(default_factory=list)  # position p lives in pages[p // page_size]
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its leading full pages
    num_cached: int = 0  # tokens whose KV is in its pages, as of the last match, fork or commit


class TaskTable:
    """Task id -> its TaskPages."""

    def __init__(self):
        self.tasks: dict[int, TaskPages] = {}

    def pages(self, task_id: int) -> list[int]:
        """The task's page table (empty for an unknown task); callers must not mutate it."""
        entry = self.tasks.get(task_id)
        return entry.pages if entry is not None else []

    def open(self, task_id: int) -> TaskPages:
        return self.tasks.setdefault(task_id, TaskPages())

    def open_empty(self, task_id: int) -> TaskPages:
        """The entry of a task about to receive shared pages, which it must not hold yet."""
        entry = self.open(task_id)
        if entry.pages:
            raise ValueError(f"task {task_id} already holds pages; free it first")
        return entry


def free_memory(device: torch.device | str) -> int:
    """Bytes free for the KV pool on device: CUDA's free memory, or MemAvailable on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PagedCache:
    """The KV pool of fixed-size pages, shared by tasks through page tables and the prefix cache."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        enable_prefix_cache: bool = True,
    ):
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"need n_pages >= 1 and page_size >= 1, got {n_pages}, {page_size}")
        shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
        # Zeros, not empty: attention reads padding slots under a mask, and NaN garbage in them
        # would still poison the softmax.
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.n_pages = n_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = PagePool(n_pages)
        self.prefix = PrefixCache()
        self.tasks = TaskTable()
        self.hit_tokens = 0
        self.lookup_tokens = 0

    @staticmethod
    def pages_for_budget(
        kv_cache_memory: float,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> int:
        """Pages that fit in kv_cache_memory: bytes if > 1, else a fraction of free memory."""
        page_bytes = 2 * n_layers * page_size * n_kv_heads * head_dim * dtype.itemsize
        if kv_cache_memory > 1:
            budget = int(kv_cache_memory)
        elif kv_cache_memory > 0:
            budget = int(kv_cache_memory * free_memory(device))
        else:
            raise ValueError(
                "kv_cache_memory must be a number of bytes (> 1) or a fraction of free memory "
                f"in (0, 1], got {kv_cache_memory!r}"
            )
        if budget < page_bytes:
            raise ValueError(
                f"kv_cache_memory={kv_cache_memory!r} gives {budget} bytes, less than one KV page "
                f"({page_bytes} bytes for {page_size} tokens); give the KV cache more memory"
            )
        return budget // page_bytes

    def match_prefix(self, task_id: int, tokens: Sequence[int]) -> int:
        """Give a new task the cached pages of its longest known prefix; return tokens covered.

        The last token is never covered, so the page that receives new KV is the task's own.
        """
        if not self.enable_prefix_cache:
            return 0
        entry = self.tasks.open_empty(task_id)
        parent = None
        for i in range((len(tokens) - 1) // self.page_size):
            page_tokens = tokens[i * self.page_size : (i + 1) * self.page_size]
            key = self.prefix.page_key(parent, page_tokens)
            page = self.prefix.get(key, parent, page_tokens)
            if page is None:
                break
            self.pool.incref(page)
            entry.pages.append(page)
            entry.keys.append(key)
            parent = key
        entry.num_cached = len(entry.pages) * self.page_size
        self.lookup_tokens += len(tokens)
        self.hit_tokens += entry.num_cached
        return entry.num_cached

    def pages_needed(self, task_id: int, num_tokens: int) -> int:
        """Pages the task must add to its table to hold num_tokens slots."""
        return max(0, -(-num_tokens // self.page_size) - len(self.tasks.pages(task_id)))

    def can_allocate(self, n_pages: int) -> bool:
        return self.pool.available() >= n_pages

    def capacity(self, task_id: int) -> int:
        """Token slots the task could hold without anyone being preempted: its own pages plus
        every free or cached one."""
        return (len(self.tasks.pages(task_id)) + self.pool.available()) * self.page_size

    def allocate(self, task_id: int, num_tokens: int) -> bool:
        """Grow the task's table to hold num_tokens slots, evicting cached pages if need be.

        All or nothing: when the pool is short nothing is taken and the answer is False.
        """
        needed = self.pages_needed(task_id, num_tokens)
        if not self.can_allocate(needed):
            return False
        while len(self.pool.free) < needed:
            self.prefix.remove(self.pool.evict())
        self.tasks.open(task_id).pages.extend(self.pool.take(needed))
        return True

    def commit(self, task_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Record that the KV of tokens[:num_computed] is written; register its new full pages.

        A page whose contents are already cached elsewhere stays unregistered rather than being
        swapped for the cached copy under the running task.
        """
        entry = self.tasks.open(task_id)
        if num_computed > min(len(tokens), len(entry.pages) * self.page_size):
            raise ValueError(
                f"task {task_id}: {num_computed} tokens computed, but it has {len(tokens)} "
                f"tokens and {len(entry.pages) * self.page_size} slots"
            )
        entry.num_cached = num_computed
        if not self.enable_prefix_cache:
            return
        for i in range(len(entry.keys), num_computed // self.page_size):
            parent = entry.keys[-1] if entry.keys else None
            page_tokens = tokens[i * self.page_size : (i + 1) * self.page_size]
            key = self.prefix.page_key(parent, page_tokens)
            self.prefix.add(key, parent, page_tokens, entry.pages[i])
            entry.keys.append(key)

    def fork(self, src_task_id: int, dst_task_id: int, num_tokens: int) -> int:
        """Share src's full pages covering up to num_tokens (but never the last) with a new dst.

        This is how n samples of one prompt share its KV; the caller forks once src's KV for
        those tokens is written. Returns the tokens covered.
        """
        src = self.tasks.tasks.get(src_task_id, TaskPages())
        dst = self.tasks.open_empty(dst_task_id)
        n_shared = min(len(src.pages), max(0, num_tokens - 1) // self.page_size)
        for page in src.pages[:n_shared]:
            self.pool.incref(page)
        dst.pages = src.pages[:n_shared]
        dst.keys = src.keys[:n_shared]
        dst.num_cached = n_shared * self.page_size
        return dst.num_cached

    def free(self, task_id: int) -> None:
        """Release the task's pages; those the prefix cache knows stay cached."""
        entry = self.tasks.tasks.pop(task_id, None)
        if entry is None:
            return
        # Tail first: the LRU then evicts a prefix's later pages before the earlier ones that
        # every longer match must pass through.
        for page in reversed(entry.pages):
            self.pool.decref(page, keep=page in self.prefix)

    def view(self, seqs: Sequence[tuple[int, int, int]]) -> CacheView:
        """The attention backend for one pass over seqs = [(task_id, start_pos, num_new)]."""
        return CacheView(self, seqs)

    def owned_pages(self) -> int:
        return self.n_pages - self.pool.available()

    def stats(self) -> CacheStats:
        return CacheStats(
            n_pages=self.n_pages,
            free=len(self.pool.free),
            owned=self.owned_pages(),
            cached=len(self.pool.lru),
            hit_tokens=self.hit_tokens,
            lookup_tokens=self.lookup_tokens,
        )

    def check_invariants(self) -> None:
        """Raise CacheInvariantError unless every page is in exactly one consistent state."""
        holders = Counter(page for entry in self.tasks.tasks.values() for page in entry.pages)
        free, lru, prefix = set(self.pool.free), self.pool.lru, self.prefix
        problems = []
        if len(free) != len(self.pool.free):
            problems.append("a page is on the free list twice")
        for page, refcount in enumerate(self.pool.refcount):
            states = [("free", page in free), ("cached", page in lru), ("owned", refcount > 0)]
            states = [name for name, is_in in states if is_in]
            if len(states) != 1:
                problems.append(f"page {page} is {' and '.join(states) or 'in no state'}")
            if refcount != holders[page]:
                problems.append(f"page {page} has refcount {refcount}, {holders[page]} holders")
            if page in lru and page not in prefix:
                problems.append(f"cached page {page} has no prefix entry")
            del holders[page]
        if holders:
            problems.append(f"task tables hold pages outside the pool: {sorted(holders)}")
        if len(prefix.pages) != len(prefix.entries):
            problems.append("prefix keys and prefix entries differ in number")
        for page, entry in prefix.entries.items():
            if prefix.pages.get(entry.key) != page or page in free:
                problems.append(f"page {page} has a stale prefix entry")
            if prefix.page_key(entry.parent_key, entry.tokens) != entry.key:
                problems.append(f"the prefix key of page {page} is not its tokens' key")
        for task_id, entry in self.tasks.tasks.items():
            capacity = len(entry.pages) * self.page_size
            if not len(entry.keys) * self.page_size <= entry.num_cached <= capacity:
                problems.append(
                    f"task {task_id}: {entry.num_cached} cached tokens do not fit between its "
                    f"{len(entry.keys)} keyed pages and {len(entry.pages)} pages"
                )
        if problems:
            raise CacheInvariantError("; ".join(problems))


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
