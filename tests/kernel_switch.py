"""Running a test on a C kernel and on the PyTorch path an install without a compiler takes."""

from __future__ import annotations

import shutil

import pytest

from astrai.kernels import native

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
