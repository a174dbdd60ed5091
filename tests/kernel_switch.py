"""Running a test on a C kernel and on the PyTorch path an install without a compiler takes,
and on a kernel plan of the test's choosing."""

from __future__ import annotations

import shutil

import pytest
import torch

from astrai.kernels import native
from astrai.kernels.kernel_plan import (
    DEFAULT_ACTIVATION_PRECISION,
    DEFAULT_PREFETCH,
    ROW_BUCKETS,
    KernelPlan,
    LinearChoice,
    LinearPath,
    forced_path,
    untuned_paths,
    widest_quantized_isa,
)

requires_compiler = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


def kernel_or_fallback(request, monkeypatch, extension: str) -> str:
    """For a fixture with params ["c-kernel", <fallback>]: skip the kernel case where the
    extension (an attribute of astrai.kernels.native) was not built, and in the fallback case
    hide it as a compiler-less install does. Returns the param."""
    if request.param == "c-kernel" and getattr(native, extension) is None:
        pytest.skip(f"the C extension {extension} was not built")
    if request.param != "c-kernel":
        monkeypatch.setattr(native, extension, None)
    return request.param


class CountingKernels:
    """The kernel module, recording the name of each kernel call (not of each lookup: a caller
    may look a kernel up once and call it many times)."""

    def __init__(self, kernels, calls: list[str]):
        self.kernels, self.calls = kernels, calls

    def __getattr__(self, name):
        kernel = getattr(self.kernels, name)

        def counted(*args):
            self.calls.append(name)
            return kernel(*args)

        return counted


def forced_plan(
    path: LinearPath | None = None,
    *,
    bf16_path: str = "vec8",
    isa: str | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
) -> KernelPlan:
    """A KernelPlan (make it active to run on it) whose linears of both dtypes take path at
    every row count (None: the one ASTRAI_LINEAR_PATH forces, else their untuned paths): dense
    ones with the kernel's bf16 products on
    bf16_path, quantized ones on the kernel's CPU path isa (None: the widest), both prefetching
    prefetch bytes ahead, quantized x rounded at activation_precision."""
    quantized_isa = isa or widest_quantized_isa()
    path = path or forced_path()

    def choice(kernel_isa: str, dtype: torch.dtype) -> LinearChoice:
        paths = untuned_paths(dtype) if path is None else (path,) * len(ROW_BUCKETS)
        return LinearChoice(paths, kernel_isa, prefetch)

    return KernelPlan(
        activation_precision=activation_precision,
        dense={dtype: choice(bf16_path, dtype) for dtype in native.KERNEL_DTYPES},
        quantized={dtype: choice(quantized_isa, dtype) for dtype in native.KERNEL_DTYPES},
    )
