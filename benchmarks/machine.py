"""What this machine can do, measured in the same run as a benchmark: bandwidth and matmul rate."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch


def best_seconds(fn: Callable[[], object], repeats: int = 10, warmup: int = 2) -> float:
    """The fastest of `repeats` timed calls: the least disturbed by other load on the machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Memory bandwidth in bytes/s from a large tensor copy, counting bytes read plus written.

    1 GiB is well past the last-level cache; the source is filled first so its pages are real
    memory, not the kernel's shared zero page.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeats=5)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Memory bandwidth in bytes/s of only reading: a sum over a large tensor, on all threads.

    A decode step only reads its weights. A copy also writes, and the memory system serves
    reads and writes side by side, so the copy's bytes/s can exceed what reading alone reaches.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(src.sum, repeats=5)


def matmul_rate(dtype: torch.dtype, max_size: int = 2048, max_seconds: float = 0.5) -> float:
    """FLOP/s of a square [size, size] @ [size, size] matmul in dtype.

    size doubles from 256 up to max_size while the next size's product (8x the work) would
    still take under max_seconds: large enough to run at the kernel's full rate, but a CPU with
    no fast kernel for dtype (bf16 without AVX-512) is measured in seconds, not many minutes.
    """
    size = 256
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        product = functools.partial(torch.matmul, a, b)
        if size >= max_size or best_seconds(product, repeats=1, warmup=1) * 8 > max_seconds:
            return 2 * size**3 / best_seconds(product, repeats=5, warmup=0)
        size *= 2


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter, except an untied embedding.

    The embedding lookup reads one row; a tied embedding is read whole as the lm_head.
    """
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_weight:
        embedding = model.tok_embeddings.weight
        total -= embedding.numel() * embedding.element_size()
    return total
