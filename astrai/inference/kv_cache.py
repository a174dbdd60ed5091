"""The paged KV cache: physical pages, the prefix cache over them, and each task's page table.

PagedCache is the facade the scheduler and executor use. It composes three parts with one job
each -- PagePool (which pages are free, owned or cached), PrefixCache (which page holds the KV of
a given token prefix) and TaskTable (which pages each task reads and writes) -- and owns the K/V
tensors. The model never sees it: it attends through a CacheView (astrai.inference.attention).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


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
    # What the task's KV depends on besides its tokens (its LoRA adapter): the parent key of
    # its first page, so only tasks under the same one share pages.
    root: bytes | None = None


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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros that costs nothing until used on the CPU: calloc hands a large block out as
    the OS's untouched zero pages, where torch.zeros writes every byte (seconds for a pool of
    gigabytes that a short answer never touches)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass(eq=False)
class KVStore:
    """The K/V tensors of a pool of pages, [n_layers, n_pages, page_size, kvh, hd] each: what
    attention reads and writes. The page accounting (PagedCache) lives apart, on rank 0 only."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVStore:
        if n_pages < 1 or page_size < 1:
            raise ValueError(f"need n_pages >= 1 and page_size >= 1, got {n_pages}, {page_size}")
        shape = (n_layers, n_pages, page_size, n_kv_heads, head_dim)
        # Zeros, not empty: attention reads padding slots under a mask, and NaN garbage in them
        # would still poison the softmax.
        return cls(zeros(shape, dtype, device), zeros(shape, dtype, device))

    @property
    def n_pages(self) -> int:
        return self.k_cache.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


class PagedCache:
    """The KV pool of fixed-size pages, shared by tasks through page tables and the prefix
    cache; its K/V tensors are kv, which the executor reads and writes."""

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
        self.kv = KVStore.allocate(
            n_layers, n_kv_heads, head_dim, n_pages, page_size, dtype, device
        )
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

    def match_prefix(self, task_id: int, tokens: Sequence[int], root: bytes | None = None) -> int:
        """Give a new task the cached pages of its longest known prefix computed under root
        (TaskPages.root); return tokens covered.

        The last token is never covered, so the page that receives new KV is the task's own.
        The hit counts toward the hit rate only through count_hit, once the task is admitted.
        """
        if not self.enable_prefix_cache:
            return 0
        entry = self.tasks.open_empty(task_id)
        entry.root = parent = root
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
        return entry.num_cached

    def count_hit(self, lookup_tokens: int, hit_tokens: int) -> None:
        """Add an admitted task's prefix match to the hit rate: match_prefix cannot, since a task
        that does not fit yet has its match undone and redone at every admission attempt."""
        self.lookup_tokens += lookup_tokens
        self.hit_tokens += hit_tokens

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
            parent = entry.keys[-1] if entry.keys else entry.root
            page_tokens = tokens[i * self.page_size : (i + 1) * self.page_size]
            key = self.prefix.page_key(parent, page_tokens)
            self.prefix.add(key, parent, page_tokens, entry.pages[i])
            entry.keys.append(key)

    def truncate(self, task_id: int, num_tokens: int) -> None:
        """Shrink the task's table to the pages that num_tokens slots need: those a speculative
        step took for draft tokens that were rejected. They hold no committed token, so they
        go back to the free pool, never to the prefix cache."""
        entry = self.tasks.open(task_id)
        keep = -(-num_tokens // self.page_size)
        if keep < len(entry.keys) or num_tokens < entry.num_cached:
            raise ValueError(
                f"task {task_id}: cannot truncate to {num_tokens} tokens, {entry.num_cached} "
                "are committed"
            )
        while len(entry.pages) > keep:
            self.pool.decref(entry.pages.pop(), keep=False)

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
        dst.root = src.root
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
