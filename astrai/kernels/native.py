"""The C extensions (each None where the install had no C compiler) and the rule every kernel
call shares.

Code reads the extensions as attributes of this module at call time, so a test can hide one
(`monkeypatch.setattr(native, "fused_ops", None)`) and get exactly what a compiler-less install
runs.
"""

from __future__ import annotations

import importlib

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

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


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
