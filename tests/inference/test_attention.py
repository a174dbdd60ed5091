"""CacheView: paged attention against a dense reference, with the C kernel and with SDPA."""

from __future__ import annotations

import math
import os
from functools import partial

import numpy as np
import pytest
import torch
from kernel_switch import kernel_or_fallback, requires_compiler

from astrai.inference.attention import CacheView, DecodeGroup, DeviceCacheView
from astrai.inference.executor import HostToDevice
from astrai.inference.kv_cache import PagedCache
from astrai.inference.step_batch import StepBatch
from astrai.kernels import PagedDecode, native, triton_attention
from astrai.model.transformer import LayerAttention

# Gemma-like layers beside the plain one: a sliding window shorter than most contexts here, a
# scale other than 1/sqrt(head_dim), and soft-capped logits (small, so the cap bites).
LAYER_KINDS = {
    "full": {},
    "window-5": {"window": 5},
    "softcap-window-3": {"window": 3, "softcap": 0.5, "scale": 0.3},
}


# A window that a long decode's keys outrun, so that its first key is not the sequence's.
LONG_KINDS = {"full": {}, "window-200": {"window": 200}, "softcap": {"softcap": 0.5}}


def layer_attention(index: int, head_dim: int, kind: str = "full") -> LayerAttention:
    settings = {"scale": head_dim**-0.5, **{**LAYER_KINDS, **LONG_KINDS}[kind]}
    return LayerAttention(index=index, **settings)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    layer: LayerAttention | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions start.. over the full k/v [ctx, kvh, hd], with
    the layer's scale, window and soft-cap (default: plain, 1/sqrt(head_dim)); key_ends [n]:
    each query sees the keys before its key end instead of those up to its own position."""
    n, n_heads, head_dim = q.shape
    layer = layer or LayerAttention(index=0, scale=1 / math.sqrt(head_dim))
    group = n_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, hd]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * layer.scale  # [heads, n, ctx]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    query_pos = torch.arange(start, start + n)[:, None]
    key_pos = torch.arange(k.shape[1])[None, :]
    hidden = key_pos > query_pos if key_ends is None else key_pos >= key_ends[:, None]
    if layer.window is not None:
        hidden |= key_pos <= query_pos - layer.window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def random_kv(n_layers, lengths, n_kv_heads, head_dim, generator):
    """Per layer, per task id: random K (or V) [length, n_kv_heads, head_dim]."""
    return [
        {
            t: torch.randn(length, n_kv_heads, head_dim, generator=generator)
            for t, length in lengths.items()
        }
        for _ in range(n_layers)
    ]


@pytest.fixture(params=["c-kernel", "sdpa", "triton"])
def decode_attention(request, monkeypatch):
    """Run a test with each attention path: the CPU's C kernel, then gather + SDPA, then the
    CUDA path's Triton kernels (on CPU tensors under Triton's interpreter without a GPU)."""
    if request.param == "triton":
        if not triton_attention.available:
            pytest.skip("triton is not installed")
        return request.param
    return kernel_or_fallback(request, monkeypatch, "paged_attention")


def path_device(path: str) -> str:
    """Where a path's tensors live: the Triton kernels run on the GPU where there is one."""
    return "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"


def batch_of(cache: PagedCache, seqs, key_ends=None) -> StepBatch:
    """The StepBatch of seqs, each (task_id, start, n), over cache's page tables."""
    return StepBatch.build(seqs, [], cache.tasks.pages, cache.page_size, key_ends=key_ends)


def cpu_view(cache: PagedCache, seqs, key_ends=None) -> CacheView:
    return CacheView(cache.kv, batch_of(cache, seqs, key_ends))


def make_view(path, cache, seqs, n_heads, key_ends=None):
    """The view a step of seqs attends through on the path: the CPU's, or the CUDA path's
    (whose cache the first view moves to the GPU where there is one)."""
    if path != "triton":
        return cpu_view(cache, seqs, key_ends)
    device = torch.device(path_device(path))
    kv = cache.kv
    if kv.k_cache.device != device:
        kv.k_cache, kv.v_cache = kv.k_cache.to(device), kv.v_cache.to(device)
    batch = batch_of(cache, seqs, key_ends)
    return DeviceCacheView.build(kv, batch, n_heads, HostToDevice(device))


def run_pass(
    cache, full_k, full_v, seqs, n_heads, generator, kind="full", dtype=None, path="c-kernel",
    key_ends=None,
):  # fmt: skip
    """Run one pass of seqs through a view on every layer; check each against dense attention.

    q, k and v go in dtype (default: the cache's); the reference is fp32 attention over those
    values, k and v rounded to the cache's dtype as it stores them. Every layer attends as
    LAYER_KINDS[kind] says, each row up to its key end where key_ends [num_tokens] gives them.
    Returns the view, so a test can see which decode backend it used."""
    dtype = dtype or cache.kv.k_cache.dtype
    interpreted = path == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted and torch.bfloat16 in (dtype, cache.kv.k_cache.dtype):
        pytest.skip("Triton's interpreter (NumPy) computes bf16 wrongly; the GPU check runs it")
    view = make_view(path, cache, seqs, n_heads, key_ends)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's one rounding
    for layer in range(cache.kv.k_cache.shape[0]):
        k = torch.cat([full_k[layer][t][s : s + n] for t, s, n in seqs])
        v = torch.cat([full_v[layer][t][s : s + n] for t, s, n in seqs])
        q = torch.randn(k.shape[0], n_heads, k.shape[2], generator=generator).to(dtype)
        attention = layer_attention(layer, k.shape[2], kind)
        device = path_device(path)
        out = view(attention, q.to(device), k.to(device, dtype), v.to(device, dtype)).cpu()
        assert out.dtype == dtype
        row = 0
        for task_id, start, n in seqs:
            ctx = start + n if key_ends is None else int(key_ends[row : row + n].max())
            k_seq, v_seq = (
                full[layer][task_id][:ctx].to(dtype).to(cache.kv.k_cache.dtype).float()
                for full in (full_k, full_v)
            )
            ends = None if key_ends is None else torch.from_numpy(key_ends[row : row + n])
            expected = dense_attention(
                q[row : row + n].float(), k_seq, v_seq, start, attention, ends
            )
            torch.testing.assert_close(
                out[row : row + n].float(), expected, atol=tolerance, rtol=tolerance
            )
            row += n
    return view


@requires_compiler
def test_decode_kernel_is_built_where_a_compiler_is():
    assert native.paged_attention is not None, "pip install should have built it"


@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads", "page_size"), [(4, 2, 4), (4, 4, 4), (6, 1, 4), (4, 2, 3)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(LAYER_KINDS))
def test_mixed_batch_matches_dense_causal_attention(
    n_heads, n_kv_heads, page_size, dtype, kind, decode_attention
):
    generator = torch.Generator().manual_seed(0)
    n_layers, head_dim = 2, 8
    cache = PagedCache(n_layers, n_kv_heads, head_dim, n_pages=40, page_size=page_size, dtype=dtype)
    # task id -> (tokens already in cache, new tokens this pass)
    plan = {0: (10, 1), 1: (0, 7), 2: (3, 1), 3: (5, 6), 4: (0, 1), 5: (8, 4), 6: (15, 1)}
    full_len = {t: s + n for t, (s, n) in plan.items()}
    full_k, full_v = (
        random_kv(n_layers, full_len, n_kv_heads, head_dim, generator) for _ in range(2)
    )
    # Allocate a page at a time round-robin so page tables interleave in the pool.
    for pages in range(1, -(-max(full_len.values()) // page_size) + 1):
        for task_id, length in full_len.items():
            assert cache.allocate(task_id, min(length, pages * page_size))

    check = partial(run_pass, cache, full_k, full_v, n_heads=n_heads, generator=generator)
    check([(t, 0, s) for t, (s, _) in plan.items() if s > 0], kind=kind, path=decode_attention)
    mixed = [(0, 10, 1), (1, 0, 7), (2, 3, 1), (3, 5, 6), (4, 0, 1), (5, 8, 4), (6, 15, 1)]
    view = check(mixed, kind=kind, path=decode_attention)
    if decode_attention != "triton":
        assert isinstance(view.paged_decode, PagedDecode) == (decode_attention == "c-kernel")
        assert all(isinstance(group, DecodeGroup) for group in view.decode_groups)
        assert bool(view.decode_groups) == (decode_attention == "sdpa")
    shuffled = [mixed[i] for i in (3, 6, 1, 0, 5, 2, 4)]
    check(shuffled, kind=kind, path=decode_attention)


@pytest.mark.parametrize("kind", list(LAYER_KINDS))
def test_rows_of_an_image_see_its_later_keys(kind, decode_attention):
    """StepBatch.key_ends (a Gemma 3 image's tokens see each other): a row sees the keys up to
    its key end, its window still counted from its own position; in a chunk from 0, one after
    cached keys, beside a decode."""
    generator = torch.Generator().manual_seed(4)
    n_layers, n_heads, n_kv_heads, head_dim, page_size = 2, 4, 2, 8, 4
    full_len = {0: 14, 1: 13, 2: 6}
    full_k, full_v = (
        random_kv(n_layers, full_len, n_kv_heads, head_dim, generator) for _ in range(2)
    )
    cache = PagedCache(n_layers, n_kv_heads, head_dim, n_pages=20, page_size=page_size)
    for task_id, length in full_len.items():
        assert cache.allocate(task_id, length)
    check = partial(
        run_pass, cache, full_k, full_v, n_heads=n_heads, generator=generator, kind=kind,
        path=decode_attention,
    )  # fmt: skip
    check([(1, 0, 6), (2, 0, 5)])
    # task 0: positions 0..13, an image at 3..9; task 1: positions 6..12, an image at 7..10
    seqs = [(0, 0, 14), (1, 6, 7), (2, 5, 1)]
    key_ends = np.concatenate([np.arange(1, 15), np.arange(7, 14), [6]])
    key_ends[3:10] = 10
    key_ends[14 + 1 : 14 + 5] = 11
    check(seqs, key_ends=key_ends)


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "page_size"), [(4, 2, 4), (6, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(LAYER_KINDS))
def test_steps_of_decodes_alone_store_their_kv(
    n_heads, n_kv_heads, page_size, dtype, kind, decode_attention
):
    """A step with no prompt chunk leaves storing the decodes' K/V to the kernel, if it runs."""
    generator = torch.Generator().manual_seed(2)
    n_layers, head_dim, steps = 2, 8, 3
    prompt_len = {0: 9, 1: 1, 2: 16, 3: 4}
    full_len = {t: n + steps for t, n in prompt_len.items()}
    full_k, full_v = (
        random_kv(n_layers, full_len, n_kv_heads, head_dim, generator) for _ in range(2)
    )
    cache = PagedCache(n_layers, n_kv_heads, head_dim, n_pages=30, page_size=page_size, dtype=dtype)
    for task_id, length in full_len.items():
        assert cache.allocate(task_id, length)
    check = partial(run_pass, cache, full_k, full_v, n_heads=n_heads, generator=generator)
    check([(t, 0, n) for t, n in prompt_len.items()], kind=kind, path=decode_attention)
    for step in range(steps):
        # Each token is new to the cache: attending before storing it would read a zero key.
        decodes = [(t, n + step, 1) for t, n in prompt_len.items()]
        view = check(decodes, kind=kind, path=decode_attention)
        if decode_attention != "triton":
            assert isinstance(view.paged_decode, PagedDecode) == (decode_attention == "c-kernel")


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(6, 2), (3, 1)])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
    ids=["fp32", "fp32-fp16", "bf16", "fp16"],
)
@pytest.mark.parametrize("kind", list(LONG_KINDS))
def test_long_decodes_match_dense_attention_alone_and_in_a_batch(
    n_heads, n_kv_heads, dtype, cache_dtype, kind, decode_attention
):
    """Decodes of more keys than the C kernel takes in one part (128): 128 keys (one part),
    129 (a part of one key), 300 and 700, over dense attention; and, on the C kernel, each
    decode's output alone equal, bit for bit, to its row of the batch of all four (how its keys
    are cut into parts may not depend on what else runs; SDPA's groups promise no such thing)."""
    if decode_attention == "triton":
        pytest.skip("interpreted, these contexts take minutes; the short ones check Triton's")
    generator = torch.Generator().manual_seed(6)
    n_layers, head_dim, page_size = 1, 16, 16
    context = {0: 128, 1: 129, 2: 300, 3: 700}
    full_k, full_v = (
        random_kv(n_layers, context, n_kv_heads, head_dim, generator) for _ in range(2)
    )
    cache = PagedCache(
        n_layers, n_kv_heads, head_dim, n_pages=90, page_size=page_size, dtype=cache_dtype
    )
    for pages in range(1, -(-max(context.values()) // page_size) + 1):
        for task_id, length in context.items():
            assert cache.allocate(task_id, min(length, pages * page_size))
    check = partial(run_pass, cache, full_k, full_v, n_heads=n_heads, generator=generator)
    check([(t, 0, n - 1) for t, n in context.items()], path=decode_attention)
    decodes = [(t, n - 1, 1) for t, n in context.items()]
    check(decodes, kind=kind, path=decode_attention, dtype=dtype)
    if decode_attention != "c-kernel":
        return
    attention = layer_attention(0, head_dim, kind)
    q = torch.randn(len(decodes), n_heads, head_dim, generator=generator).to(dtype)
    k, v = (torch.cat([full[0][t][-1:] for t in context]).to(dtype) for full in (full_k, full_v))
    together = cpu_view(cache, decodes)(attention, q, k, v)
    for row, decode in enumerate(decodes):
        alone = cpu_view(cache, [decode])(attention, *(t[row : row + 1] for t in (q, k, v)))
        assert torch.equal(alone, together[row : row + 1]), f"decode {decode} alone differs"


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float16),
        (torch.float16, torch.float16),
    ],
    ids=["fp32-bf16", "fp32-fp16", "bf16-fp16", "fp16-fp16"],
)
@pytest.mark.parametrize("kind", ["full", "softcap-window-3"])
def test_a_cache_of_another_dtype_holds_rounded_kv(dtype, cache_dtype, kind, decode_attention):
    """q, k and v of the model's dtype over a cache of kv_cache_dtype: prompt chunks, mixed
    steps and steps of decodes alone (where the kernel rounds what it stores) all attend over
    K/V rounded to the cache's dtype, and nothing else is rounded."""
    generator = torch.Generator().manual_seed(3)
    n_layers, n_heads, n_kv_heads, head_dim, page_size = 2, 4, 2, 16, 4
    prompt_len, steps = {0: 9, 1: 1, 2: 6}, 2
    full_len = {t: n + steps + 3 for t, n in prompt_len.items()}
    full_k, full_v = (
        random_kv(n_layers, full_len, n_kv_heads, head_dim, generator) for _ in range(2)
    )
    cache = PagedCache(
        n_layers, n_kv_heads, head_dim, n_pages=20, page_size=page_size, dtype=cache_dtype
    )
    for task_id, length in full_len.items():
        assert cache.allocate(task_id, length)
    check = partial(
        run_pass, cache, full_k, full_v, n_heads=n_heads, generator=generator, kind=kind,
        dtype=dtype, path=decode_attention,
    )  # fmt: skip
    check([(t, 0, n) for t, n in prompt_len.items()])
    for step in range(steps):
        view = check([(t, n + step, 1) for t, n in prompt_len.items()])
        if decode_attention != "triton":
            assert isinstance(view.paged_decode, PagedDecode) == (decode_attention == "c-kernel")
    # a mixed step: a chunk that reads its earlier keys from the cache beside two decodes
    mixed = [(0, 9 + steps, 3), (1, 1 + steps, 1), (2, 6 + steps, 1)]
    check(mixed)


def test_prefix_hit_reads_the_shared_pages():
    generator = torch.Generator().manual_seed(1)
    n_heads, kvh, hd, ps = 4, 2, 8, 4
    cache = PagedCache(1, kvh, hd, n_pages=16, page_size=ps)
    prompt = list(range(10))
    full_k = [{0: torch.randn(10, kvh, hd, generator=generator)}]
    full_v = [{0: torch.randn(10, kvh, hd, generator=generator)}]
    assert cache.allocate(0, 10)
    run_pass(cache, full_k, full_v, [(0, 0, 10)], n_heads, generator)
    cache.commit(0, prompt, 10)
    cache.free(0)

    # Task 1 has the same prompt: its first 8 tokens come from the cache, the rest is computed.
    assert cache.match_prefix(1, prompt) == 8
    full_k[0][1], full_v[0][1] = full_k[0][0], full_v[0][0]
    assert cache.allocate(1, 10)
    run_pass(cache, full_k, full_v, [(1, 8, 2)], n_heads, generator)


def test_view_keeps_the_cache_dtype():
    generator = torch.Generator().manual_seed(2)
    cache = PagedCache(1, 2, 8, n_pages=8, page_size=4, dtype=torch.bfloat16)
    assert cache.allocate(0, 6) and cache.allocate(1, 3)
    seqs = [(0, 0, 5), (1, 0, 1)]
    q, k, v = (torch.randn(6, h, 8, generator=generator) for h in (4, 2, 2))
    out = cpu_view(cache, seqs)(layer_attention(0, 8), q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    expected = torch.cat(
        [dense_attention(q[:5], k[:5], v[:5], 0), dense_attention(q[5:], k[5:], v[5:], 0)]
    )
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_decodes_attend_heads_that_lie_apart():
    """q/k/v whose heads are not side by side in memory are copied for the kernel, and the
    copies live through its call."""
    generator = torch.Generator().manual_seed(3)
    cache = PagedCache(1, 2, 8, n_pages=8, page_size=4)
    assert cache.allocate(0, 6)
    prompt_q, prompt_k, prompt_v = (torch.randn(5, h, 8, generator=generator) for h in (4, 2, 2))
    cpu_view(cache, [(0, 0, 5)])(layer_attention(0, 8), prompt_q, prompt_k, prompt_v)
    q, k, v = (torch.randn(1, h, 16, generator=generator)[..., :8] for h in (4, 2, 2))
    assert q.stride(1) == 16
    out = cpu_view(cache, [(0, 5, 1)])(layer_attention(0, 8), q, k, v)
    full_k, full_v = torch.cat((prompt_k, k)), torch.cat((prompt_v, v))
    torch.testing.assert_close(out, dense_attention(q, full_k, full_v, 5))


def test_view_refuses_positions_without_pages():
    cache = PagedCache(1, 1, 4, n_pages=8, page_size=4)
    assert cache.allocate(0, 4)
    with pytest.raises(ValueError, match="allocate before the forward pass"):
        cpu_view(cache, [(0, 4, 1)])


def test_decode_kernel_refuses_new_kv_of_another_dtype_than_q():
    """The kernel reads q, k and v as one dtype (the cache's may differ): a mismatch among
    them is refused, never misread."""
    if native.paged_attention is None:
        pytest.skip("the C extension paged_attention was not built")
    cache = PagedCache(1, 2, 8, n_pages=8, page_size=4)
    assert cache.allocate(0, 3)
    q, k, v = (torch.randn(1, h, 8) for h in (4, 2, 2))
    with pytest.raises(ValueError, match="must share one of"):
        cpu_view(cache, [(0, 2, 1)])(layer_attention(0, 8), q.bfloat16(), k, v)


def test_decode_kernel_widens_every_fp16_value_exactly():
    """Each of the 65536 fp16 values (subnormals, infinities and NaNs included) as the one
    value a decode attends to: its output is that value, widened to fp32 exactly."""
    if native.paged_attention is None:
        pytest.skip("the C extension paged_attention was not built")
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    n = len(values) // 8  # decodes of one key each, head_dim 8
    k_cache = torch.zeros(1, n, 1, 1, 8, dtype=torch.float16)
    v_cache = values.view(1, n, 1, 1, 8).clone()
    decode = PagedDecode(
        k_cache,
        v_cache,
        rows=torch.arange(n),
        block_tables=torch.arange(n)[:, None].contiguous(),
        context_lens=torch.ones(n, dtype=torch.int64),
    )
    out = torch.empty(n, 1, 8)
    decode.kernel_call(0, torch.zeros(n, 1, 8), out, scale=1.0)()
    expected = values.float().view(n, 1, 8)
    assert bool(((out == expected) | (out.isnan() & expected.isnan())).all())


def test_several_decode_rows_of_one_task_see_each_others_new_keys(decode_attention):
    """A speculative check: rows of one task at positions p .. p + 31, each seeing the keys
    of the rows before it. Their slots hold stale K/V (as rejected guesses leave them), so a
    row that attended before the earlier rows' K/V were stored would read garbage."""
    generator = torch.Generator().manual_seed(5)
    n_heads, n_kv_heads, head_dim, context, rows = 4, 2, 16, 40, 32
    cache = PagedCache(1, n_kv_heads, head_dim, n_pages=9, page_size=8)
    assert cache.allocate(0, context + rows)
    cache.kv.k_cache.fill_(1e3)  # stale keys everywhere: only stored ones may be read
    cache.kv.v_cache.fill_(-1e3)
    prompt_k, prompt_v = (
        torch.randn(context, n_kv_heads, head_dim, generator=generator) for _ in range(2)
    )
    device = path_device(decode_attention)
    prompt_q = torch.randn(context, n_heads, head_dim, generator=generator)
    make_view(decode_attention, cache, [(0, 0, context)], n_heads)(
        layer_attention(0, head_dim), *(t.to(device) for t in (prompt_q, prompt_k, prompt_v))
    )
    q = torch.randn(rows, n_heads, head_dim, generator=generator)
    k, v = (torch.randn(rows, n_kv_heads, head_dim, generator=generator) for _ in range(2))
    view = make_view(decode_attention, cache, [(0, context + i, 1) for i in range(rows)], n_heads)
    out = view(layer_attention(0, head_dim), q.to(device), k.to(device), v.to(device)).cpu()
    expected = dense_attention(q, torch.cat((prompt_k, k)), torch.cat((prompt_v, v)), context)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
