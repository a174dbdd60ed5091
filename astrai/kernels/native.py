"""The C extensions (each None where the install had no C compiler), the rule every kernel
call shares, and how astrai's ops are registered with torch.

Code reads the extensions as attributes of this module at call time, so a test can hide one
(`monkeypatch.setattr(native, "fused_ops", None)`) and get exactly what a compiler-less install
runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import Tensor


def _load(name: str):
    try:
        return importlib.import_module(f"astrai.kernels.{name}")
    except ImportError:  # installed without a C compiler: the PyTorch paths run instead
        return None


skinny_linear = _load("_skinny_linear")
fused_ops = _load("_fused_ops")
paged_attention = _load("_paged_attention")
quant_linear = _load("_quant_linear")
lora = _load("_lora")

KERNEL_DTYPES = (torch.float32, torch.bfloat16)

_LIBRARY = torch.library.Library("astrai", "FRAGMENT")


def kernel_op(
    name: str, fake: Callable | None = None, mutates_args: tuple[str, ...] = ()
) -> Callable:
    """Register the decorated function as the op astrai::name (its schema read from its type
        hints), with fake computing only the output's shape for fake tensors and torch.compile
    (an op that returns nothing needs none).

        Not torch.library.custom_op: that wraps the function to keep torch._dynamo out of it, and
        the wrapper imports torch._dynamo (about a second, with sympy) on the process's first call
        of the op, which every engine's first step would pay. Here a call runs the function as it
        is.
    """

    def register(fn: Callable) -> Callable:
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        if fake is not None:
            torch.library.register_fake(f"astrai::{name}", fake, lib=_LIBRARY)
        return fn

    return register


def cpu_kernel_may_take(x: Tensor, *others: Tensor | None) -> bool:
    """Whether x and the others (None skipped) may go to a C kernel: fp32 or bf16 of one dtype
    on the CPU, and no gradient to track (the kernels have no backward).

    Called for every op of every eager step, so it is cheap tests first.
    """
    if x.dtype not in KERNEL_DTYPES or not x.is_cpu:
        return False
    grad = torch.is_grad_enabled() and x.requires_grad
    for t in others:
        if t is None:
            continue
        if t.dtype != x.dtype or not t.is_cpu:
            return False
        grad = grad or (torch.is_grad_enabled() and t.requires_grad)
    return not grad
