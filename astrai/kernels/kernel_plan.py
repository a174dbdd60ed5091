"""Which path each linear of an engine takes, chosen by timing and owned by that engine.

A linear product y = x W^T + b runs on the CPU along one of several paths (linear_ops.py for
dense W, quant_ops.py for W in GGUF blocks), and a C kernel's path has settings of its own:
which CPU instructions it uses (its ISA) and how far ahead in W it prefetches. Which wins
depends on the machine, the dtype and the rows, so an engine times them on its model's own
weights when it is built (tuning.tune_kernels) and keeps the answers in a KernelPlan. Its
executor makes the plan active on the thread that runs a step (KernelPlan.active), and each
linear reads its choice from the active plan: two engines in one process, a draft model and
its target, or two batch_invariant settings each run on their own choices. A recorded step
keeps the settings it was recorded with, as arguments of its kernel calls.

Outside any engine's step (a model called directly) the untuned plan applies: the kernel for
few rows, a GEMM beyond. ASTRAI_LINEAR_PATH=kernel|gemm|upcast|downcast forces one path wherever
it can run, in every plan built while it is set.

The timing parts both kinds of linear share live here too: the row buckets, the race of
candidates (fastest), the pass over a model's weights (time_pass), and the choice of a kernel's
ISA and then its prefetch distance (fastest_isa, fastest_prefetch).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

import torch
from torch import Tensor

from astrai.config import ACTIVATION_PRECISIONS
from astrai.kernels import native

SKINNY_MAX_ROWS = 64
# Rows at which paths are timed; a product of r rows takes the path timed at the first bucket
# >= r. Two beyond the kernel's limit stand for prefill-sized products, a short prompt's and a
# long one's chunk (up to max_num_batched_tokens), as a path's cost per call (a quantized W's
# decoding for a GEMM) weighs differently at each.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, SKINNY_MAX_ROWS, 256, 1024)
# Rows of x a kernel's CPU paths are timed at: a decode step's one, and a speculative check's
# few, where the paths part (at one row they all wait on memory, and any can win by noise).
ISA_TIMED_ROWS = (1, 4)
# How far ahead in W's stream a kernel's prefetch is timed at, in bytes, with the chosen CPU
# path: the best distance depends on the machine's memory and prefetchers.
PREFETCH_DISTANCES = (1024, 2048, 4096)
DEFAULT_PREFETCH = 2048
# The most weight bytes a few-row timing pass reads: beyond the largest L3s (480 MB seen).
STREAMED_BYTES = 1 << 30
# The kernel's rows do not depend on the batch; another path must beat it by this much.
KERNEL_PREFERENCE = 1.1

# Activation precision (int8x2, int8) -> the terms the quantized kernel quantizes each row of x
# into.
ACTIVATION_TERMS = dict(zip(ACTIVATION_PRECISIONS, (2, 1), strict=True))
DEFAULT_ACTIVATION_PRECISION = ACTIVATION_PRECISIONS[0]


class LinearPath(StrEnum):
    KERNEL = "kernel"
    GEMM = "gemm"
    UPCAST = "upcast"
    DOWNCAST = "downcast"


def forced_path() -> LinearPath | None:
    """The path ASTRAI_LINEAR_PATH forces, if set."""
    value = os.environ.get("ASTRAI_LINEAR_PATH")
    if not value:
        return None
    try:
        return LinearPath(value)
    except ValueError:
        choices = ", ".join(p.value for p in LinearPath)
        raise ValueError(f"ASTRAI_LINEAR_PATH={value!r}: use one of {choices}") from None


@dataclass(frozen=True)
class LinearChoice:
    """How the products of one kind of linear (dense or quantized) and one dtype run: the path
    at each of ROW_BUCKETS, and the C kernel's ISA (its CPU path) and prefetch distance."""

    paths: tuple[LinearPath, ...]
    isa: str
    prefetch: int = DEFAULT_PREFETCH

    @classmethod
    def everywhere(cls, path: LinearPath, isa: str, prefetch: int = DEFAULT_PREFETCH):
        """One path at every row bucket."""
        return cls((path,) * len(ROW_BUCKETS), isa, prefetch)

    def path(self, rows: int) -> LinearPath:
        """The path of the first row bucket that holds rows (the last beyond them all)."""
        for bucket, path in zip(ROW_BUCKETS, self.paths, strict=True):
            if rows <= bucket:
                return path
        return self.paths[-1]

    def as_dict(self) -> dict[int, LinearPath]:
        """{row bucket: path}"""
        return dict(zip(ROW_BUCKETS, self.paths, strict=True))


def untuned_paths(dtype: torch.dtype) -> tuple[LinearPath, ...]:
    """Before any timing: the kernel up to its rows, then for bf16 the upcast GEMM, which is
    never far behind a native bf16 GEMM and far ahead of an emulated one."""
    large = LinearPath.UPCAST if dtype == torch.bfloat16 else LinearPath.GEMM
    return tuple(LinearPath.KERNEL if b <= SKINNY_MAX_ROWS else large for b in ROW_BUCKETS)


def widest_quantized_isa() -> str:
    """The quantized kernel's widest CPU path this machine runs: its choice before timing."""
    return native.quant_linear.isas()[-1] if native.quant_linear is not None else "scalar"


def untuned_choice(quantized: bool, dtype: torch.dtype, forced: LinearPath | None) -> LinearChoice:
    """The choice of a plan that timed nothing: forced's path, else untuned_paths; the dense
    kernel's portable bf16 path, the quantized kernel's widest."""
    isa = widest_quantized_isa() if quantized else "vec8"
    if forced is not None:
        return LinearChoice.everywhere(forced, isa)
    return LinearChoice(untuned_paths(dtype), isa)


_active = threading.local()  # .plan: the plan of the step running on this thread, if any


@dataclass(frozen=True)
class KernelPlan:
    """One engine's kernel choices: per dtype of x, the dense linears' and the quantized
    linears' (LinearChoice), and the settings they were chosen under.

    batch_invariant keeps quantized linears on their kernel at every row bucket (tuning has
    applied it to `quantized`); activation_precision (a key of ACTIVATION_TERMS) is how the
    quantized kernel rounds x; forced_path is ASTRAI_LINEAR_PATH's when the plan was made.
    """

    batch_invariant: bool = True
    activation_precision: str = DEFAULT_ACTIVATION_PRECISION
    forced_path: LinearPath | None = None
    dense: Mapping[torch.dtype, LinearChoice] = field(default_factory=dict)
    quantized: Mapping[torch.dtype, LinearChoice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.activation_precision not in ACTIVATION_TERMS:
            choices = ", ".join(ACTIVATION_TERMS)
            raise ValueError(
                f"activation precision {self.activation_precision!r}: use one of {choices}"
            )

    @property
    def activation_terms(self) -> int:
        return ACTIVATION_TERMS[self.activation_precision]

    def dense_choice(self, dtype: torch.dtype) -> LinearChoice:
        return self.dense.get(dtype) or untuned_choice(False, dtype, self.forced_path)

    def quantized_choice(self, dtype: torch.dtype) -> LinearChoice:
        return self.quantized.get(dtype) or untuned_choice(True, dtype, self.forced_path)

    def active(self) -> _Activation:
        """Make this the plan the linears read on this thread while inside (with ...:)."""
        return _Activation(self)


class _Activation:
    """KernelPlan.active's context. A class rather than a generator: every step enters one,
    after the weights went through the cache, where a generator-based context manager costs
    several times as much (benchmarks/README.md)."""

    __slots__ = ("plan", "before")

    def __init__(self, plan: KernelPlan) -> None:
        self.plan = plan
        self.before: KernelPlan | None = None

    def __enter__(self) -> KernelPlan:
        self.before = getattr(_active, "plan", None)
        _active.plan = self.plan
        return self.plan

    def __exit__(self, *exc_info) -> None:
        _active.plan = self.before


def active_plan() -> KernelPlan:
    """The plan of the step running on this thread; outside one, the untuned plan."""
    plan = getattr(_active, "plan", None)
    return plan if plan is not None else KernelPlan(forced_path=forced_path())


def time_pass(
    weights: Sequence, dtype: torch.dtype, rows: int, limit: float, product: Callable
) -> float:
    """Seconds for one pass of rows x every weight by product(out, x, w); inf once it passes
    limit. Each W has a .shape [out_features, in_features]."""
    generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
    inputs = {
        w.shape[1]: torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in weights
    }
    outs: list[Tensor] = [torch.empty(rows, w.shape[0], dtype=dtype) for w in weights]
    start = time.perf_counter()
    for w, out in zip(weights, outs, strict=True):
        product(out, inputs[w.shape[1]], w)
        if time.perf_counter() - start > limit:
            return float("inf")
    return time.perf_counter() - start


def streamed_weights(weights: Sequence, nbytes: Callable) -> list:
    """The first weights, as many as a step reads, until nbytes(w) sum past STREAMED_BYTES."""
    streamed, size = [], 0
    for w in weights:
        if size >= STREAMED_BYTES:
            break
        streamed.append(w)
        size += nbytes(w)
    return streamed


def fastest(timings: dict, preferred: object, runs: int = 2) -> object:
    """The key of the fastest of timings' callables (each limit -> seconds), run alternately
    so that one slow moment does not decide; preferred wins ties within KERNEL_PREFERENCE. A
    lone candidate is not timed."""
    if len(timings) == 1:
        return next(iter(timings))
    best = dict.fromkeys(timings, float("inf"))
    for _ in range(runs):
        for key, timing in timings.items():
            best[key] = min(best[key], timing(min(best.values()) * KERNEL_PREFERENCE))
    if preferred in best:
        best[preferred] /= KERNEL_PREFERENCE
    return min(best, key=best.get)


def _passes(
    kernel_pass: Callable, isa: str, distance: int, rows: Sequence[int], limit: float
) -> float:
    seconds = 0.0
    for n in rows:
        seconds += kernel_pass(isa, distance, n, limit - seconds)
    return seconds


def fastest_isa(isas: Sequence[str], preferred: str, kernel_pass: Callable) -> str:
    """A C kernel's fastest of isas (its CPU paths) over a pass of each of ISA_TIMED_ROWS at
    DEFAULT_PREFETCH, preferred winning ties; kernel_pass(isa, distance, rows, limit) times
    one pass (seconds, inf past limit)."""
    timings = {i: partial(_passes, kernel_pass, i, DEFAULT_PREFETCH, ISA_TIMED_ROWS) for i in isas}
    return fastest(timings, preferred)


def fastest_prefetch(isa: str, kernel_pass: Callable, rows: Sequence[int]) -> int:
    """The kernel's fastest of PREFETCH_DISTANCES on isa, over a pass of each of rows."""
    timings = {d: partial(_passes, kernel_pass, isa, d, rows) for d in PREFETCH_DISTANCES}
    return int(fastest(timings, DEFAULT_PREFETCH))
