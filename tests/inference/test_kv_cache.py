"""PagedCache: prefix caching and page accounting, checked by rules and by a state machine."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from astrai.inference import kv_cache as cache_module
from astrai.inference.kv_cache import CacheInvariantError, PagedCache, PrefixCache


def committed(cache: PagedCache, task_id: int, tokens: list[int]) -> int:
    """Match, admit, allocate and commit a task's whole prompt; return the tokens matched."""
    covered = cache.match_prefix(task_id, tokens)
    cache.count_hit(len(tokens), covered)
    assert cache.allocate(task_id, len(tokens))
    cache.commit(task_id, tokens, len(tokens))
    return covered


def test_same_prompt_reuses_pages():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    prompt = list(range(10))
    assert committed(cache, 0, prompt) == 0
    assert committed(cache, 1, prompt) == 8
    assert cache.tasks.pages(1)[:2] == cache.tasks.pages(0)[:2]
    assert cache.tasks.pages(1)[2] != cache.tasks.pages(0)[2]
    assert cache.stats().hit_rate == 8 / 20
    # A prompt that is exactly two pages reuses only one: its last token is always computed.
    assert cache.match_prefix(2, prompt[:8]) == 4
    cache.check_invariants()


def test_a_match_counts_toward_the_hit_rate_only_when_counted():
    """Admission matches, frees and matches again while a task does not fit; only the match
    of the admitted task may count."""
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    prompt = list(range(10))
    committed(cache, 0, prompt)
    for _ in range(3):
        assert cache.match_prefix(1, prompt) == 8
        cache.free(1)
    assert (cache.stats().hit_tokens, cache.stats().lookup_tokens) == (0, 10)
    cache.count_hit(len(prompt), cache.match_prefix(1, prompt))
    assert (cache.stats().hit_tokens, cache.stats().lookup_tokens) == (8, 20)


def test_equal_page_after_different_prefix_is_not_shared():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    first, second = [1, 2, 3, 4, 9, 9, 9, 9, 0], [5, 6, 7, 8, 9, 9, 9, 9, 0]
    committed(cache, 0, first)
    assert committed(cache, 1, second) == 0
    assert set(cache.tasks.pages(0)).isdisjoint(cache.tasks.pages(1))
    # Both pages of 9s are cached, each under its own prefix's key.
    assert cache.match_prefix(2, second) == 8
    assert cache.tasks.pages(2) == cache.tasks.pages(1)[:2]
    assert cache.match_prefix(3, first) == 8
    assert cache.tasks.pages(3) == cache.tasks.pages(0)[:2]


def test_forged_hash_collision_is_rejected(monkeypatch):
    monkeypatch.setattr(PrefixCache, "page_key", staticmethod(lambda parent, tokens: b"same"))
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=2)
    committed(cache, 0, [1, 2, 1, 2, 5])
    assert cache.match_prefix(1, [7, 8, 1, 2, 5]) == 0  # same key, other tokens
    # Page 1's key names page 0, which holds the same tokens but after no prefix at all.
    assert cache.match_prefix(2, [1, 2, 1, 2, 5]) == 2
    cache.check_invariants()


def test_prefix_cache_off_shares_nothing():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=2, enable_prefix_cache=False)
    committed(cache, 0, [1, 2, 3, 4, 5])
    cache.free(0)
    assert cache.match_prefix(1, [1, 2, 3, 4, 5]) == 0
    assert cache.stats().cached == 0
    assert cache.stats().free == 8


def test_freeing_every_task_leaves_no_page_owned_and_caches_full_pages():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=2)
    committed(cache, 0, [1, 2, 3, 4, 5])
    committed(cache, 1, [1, 2, 3, 9, 9])
    for task_id in (0, 1, 0, 42):
        cache.free(task_id)
    stats = cache.stats()
    assert (stats.owned, stats.cached, stats.free) == (0, 3, 5)
    assert cache.owned_pages() == 0
    cache.check_invariants()


def test_allocate_evicts_cached_pages_and_is_all_or_nothing():
    cache = PagedCache(1, 1, 4, n_pages=4, page_size=2)
    committed(cache, 0, [1, 2, 3, 4, 5, 6])
    cache.free(0)
    assert cache.stats().cached == 3
    assert cache.can_allocate(4) and not cache.can_allocate(5)

    assert not cache.allocate(1, 9)  # 5 pages: refused, nothing taken or evicted
    assert cache.tasks.pages(1) == []
    assert cache.stats().cached == 3

    assert cache.allocate(1, 6)  # 1 free page, then the two least recently cached
    assert cache.stats().cached == 1
    # Tail pages are released first, so eviction took the prompt's later pages.
    assert cache.match_prefix(2, [1, 2, 3, 4, 5, 6]) == 2
    cache.check_invariants()


def test_fork_shares_pages_by_refcount():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=2, enable_prefix_cache=False)
    prompt = [1, 2, 3, 4, 5]
    committed(cache, 0, prompt)
    assert cache.fork(0, 1, len(prompt)) == 4
    src_pages = list(cache.tasks.pages(0))
    assert cache.tasks.pages(1) == src_pages[:2]
    assert [cache.pool.refcount[p] for p in src_pages] == [2, 2, 1]
    assert cache.allocate(1, 5)
    assert cache.tasks.pages(1)[2] not in src_pages

    cache.free(0)
    assert cache.tasks.pages(1)[:2] == src_pages[:2]
    assert [cache.pool.refcount[p] for p in src_pages[:2]] == [1, 1]
    assert src_pages[2] in cache.pool.free
    cache.check_invariants()
    cache.free(1)
    assert cache.stats().free == 8


def test_pages_for_budget(monkeypatch):
    # One page: K and V for 2 layers x 16 tokens x 2 heads x 8 dims in fp32 = 4096 bytes.
    shape = dict(n_layers=2, n_kv_heads=2, head_dim=8, page_size=16, device="cpu")
    assert PagedCache.pages_for_budget(10 * 4096 + 100, dtype=torch.float32, **shape) == 10
    assert PagedCache.pages_for_budget(10 * 4096, dtype=torch.bfloat16, **shape) == 20
    monkeypatch.setattr(cache_module, "free_memory", lambda device: 100 * 4096)
    assert PagedCache.pages_for_budget(0.5, dtype=torch.float32, **shape) == 50
    assert PagedCache.pages_for_budget(1, dtype=torch.float32, **shape) == 100
    with pytest.raises(ValueError, match="less than one KV page"):
        PagedCache.pages_for_budget(4000, dtype=torch.float32, **shape)
    with pytest.raises(ValueError, match="fraction of free memory"):
        PagedCache.pages_for_budget(0, dtype=torch.float32, **shape)


def test_free_memory_reads_the_host():
    assert cache_module.free_memory("cpu") > 0


def test_check_invariants_finds_a_leak():
    cache = PagedCache(1, 1, 4, n_pages=4, page_size=2)
    assert cache.allocate(0, 3)
    cache.pool.refcount[cache.tasks.pages(0)[0]] += 1
    with pytest.raises(CacheInvariantError, match="refcount"):
        cache.check_invariants()


PAGE_SIZE = 2
N_PAGES = 8
TOKEN = st.integers(0, 2)  # a small alphabet, so prompts share pages often


class PagedCacheMachine(RuleBasedStateMachine):
    """Random task lifecycles over a tiny pool, checked against a model of what pages hold.

    The model records, for every page a task wrote, the token prefix its KV stands for; every
    page a task reads must stand for that task's own prefix, whoever wrote it.
    """

    tasks = Bundle("tasks")

    @initialize(enable_prefix_cache=st.booleans())
    def setup(self, enable_prefix_cache):
        self.cache = PagedCache(
            1, 1, 1, N_PAGES, PAGE_SIZE, enable_prefix_cache=enable_prefix_cache
        )
        self.next_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}  # tokens whose KV the task has
        self.tables: dict[int, list[int]] = {}  # last page table seen
        self.written: dict[int, tuple[int, ...]] = {}  # page -> the prefix its KV stands for

    def new_task(self, tokens):
        task_id = self.next_id
        self.next_id += 1
        self.tokens[task_id] = list(tokens)
        self.computed[task_id] = 0
        self.tables[task_id] = []
        return task_id

    @rule(target=tasks, tokens=st.lists(TOKEN, min_size=1, max_size=9))
    def add_task(self, tokens):
        task_id = self.new_task(tokens)
        covered = self.cache.match_prefix(task_id, tokens)
        self.cache.count_hit(len(tokens), covered)
        assert covered % PAGE_SIZE == 0 and covered < len(tokens)
        self.computed[task_id] = covered
        return task_id

    def allocate(self, task_id, target) -> bool:
        needed = self.cache.pages_needed(task_id, target)
        before = (self.cache.stats(), list(self.cache.tasks.pages(task_id)))
        possible = self.cache.can_allocate(needed)
        ok = self.cache.allocate(task_id, target)
        assert ok == possible
        pages = self.cache.tasks.pages(task_id)
        if ok:
            assert len(pages) * PAGE_SIZE >= target
        else:
            assert needed > before[0].free + before[0].cached
            assert (self.cache.stats(), pages) == before, "a refused allocation took pages"
        return ok

    @rule(task_id=tasks, extra=st.integers(1, 6))
    def reserve(self, task_id, extra):
        """Allocate ahead of computing, as admission does for a prompt."""
        if task_id in self.tokens:
            tokens = self.tokens[task_id]
            self.allocate(task_id, min(len(tokens), self.computed[task_id] + extra))

    @rule(task_id=tasks, chunk=st.integers(1, 8))
    def step(self, task_id, chunk):
        """Compute the next chunk of a task's tokens, as a forward pass would, and commit it."""
        if task_id not in self.tokens:
            return
        tokens, done = self.tokens[task_id], self.computed[task_id]
        end = min(len(tokens), done + chunk)
        if not self.allocate(task_id, end):
            return
        pages = self.cache.tasks.pages(task_id)
        for pos in range(done, end):
            page = pages[pos // PAGE_SIZE]
            assert self.cache.pool.refcount[page] == 1, "a task writes into a shared page"
            self.written[page] = tuple(tokens[: pos + 1])
        self.cache.commit(task_id, tokens, end)
        self.computed[task_id] = end

    @rule(tokens=st.lists(TOKEN, min_size=1, max_size=9))
    def serve(self, tokens):
        """A whole short request: admit, compute the prompt in one pass, finish."""
        task_id = self.add_task(tokens)
        self.step(task_id, len(tokens))
        self.finish(task_id)

    @rule(task_id=tasks, new=st.lists(TOKEN, min_size=1, max_size=3))
    def append_tokens(self, task_id, new):
        if task_id in self.tokens and self.computed[task_id] == len(self.tokens[task_id]):
            self.tokens[task_id] += new  # decoded tokens, their KV not yet computed

    @rule(target=tasks, src=tasks)
    def fork(self, src):
        if src not in self.tokens:
            return multiple()
        task_id = self.new_task(self.tokens[src])
        covered = self.cache.fork(src, task_id, self.computed[src])
        assert covered % PAGE_SIZE == 0 and covered <= max(0, self.computed[src] - 1)
        self.computed[task_id] = covered
        return task_id

    @rule(task_id=consumes(tasks))
    def finish(self, task_id):
        self.cache.free(task_id)
        for table in (self.tokens, self.computed, self.tables):
            table.pop(task_id, None)
        assert self.cache.tasks.pages(task_id) == []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt(self, data):
        """Free a task and re-admit it under the same id, as preemption by recompute does."""
        task_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(task_id)
        self.tables[task_id] = []
        self.computed[task_id] = self.cache.match_prefix(task_id, self.tokens[task_id])

    @invariant()
    def pages_are_accounted_for(self):
        cache, stats = self.cache, self.cache.stats()
        assert stats.free + stats.owned + stats.cached == N_PAGES
        holders = [0] * N_PAGES
        for task_id, previous in self.tables.items():
            pages = list(cache.tasks.pages(task_id))
            assert pages[: len(previous)] == previous, "a live task's page table changed"
            self.tables[task_id] = pages
            for page in pages:
                holders[page] += 1
            for i in range(self.computed[task_id] // PAGE_SIZE):
                expected = tuple(self.tokens[task_id][: (i + 1) * PAGE_SIZE])
                assert self.written.get(pages[i]) == expected, "a task reads another's KV"
        assert cache.pool.refcount == holders
        assert stats.owned == sum(1 for n in holders if n > 0)
        assert stats.hit_tokens <= stats.lookup_tokens
        cache.check_invariants()


PagedCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_paged_cache_state_machine = PagedCacheMachine.TestCase


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_large_pool_takes_no_memory_until_its_pages_are_written():
    """The pool is sized for a full batch of full-length sequences, capped by the memory
    budget, and a short answer touches a few pages: allocating must not write them all."""
    before = resident_bytes()
    cache = PagedCache(8, 4, 64, n_pages=8192, page_size=16)  # 2 x 1 GiB
    assert cache.kv.k_cache.nbytes == 1 << 30
    assert resident_bytes() - before < 64 << 20
    assert not cache.kv.k_cache[:, ::997].any() and not cache.kv.v_cache[:, ::997].any()
