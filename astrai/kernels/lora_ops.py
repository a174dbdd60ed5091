"""LoRA's low-rank products for every row of a step in one call per adapted linear, each row
under its own adapter (Punica's SGMV idea), on the CPU's C kernel (csrc/lora.c).

The adapters' A and B^T lie stacked per linear, one block of columns a slot; which slot and
scaling each row takes are the step's input (StepRows), set once per step as the page tables
are, so a recorded call replays with each step's rows. CUDA and dtypes the kernel does not
read (fp16) take astrai.model.lora's grouped PyTorch products instead.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
from torch import Tensor

from astrai.kernels import native
from astrai.kernels.graph import launch
from astrai.kernels.kernel_plan import fastest
from astrai.kernels.native import kernel_op

# A path is timed on a step of this many rows over up to this many adapters, at full rank.
TIMED_ROWS, TIMED_ADAPTERS, TIMED_CALLS = 8, 4, 20


class StepRows:
    """Each row's adapter slot (-1: none) and scaling for the kernel: a persistent pair of
    addresses (int64 [2]) that set() points at the step's arrays, so a call recorded once
    reads every later step's rows."""

    def __init__(self) -> None:
        self.addresses = torch.zeros(2, dtype=torch.int64)
        self.slots = np.full(0, -1, dtype=np.int64)
        self.scaling = np.zeros(0, dtype=np.float32)

    def set(self, slots: np.ndarray, scaling: np.ndarray) -> None:
        """slots [rows] (int64) and scaling [rows] (fp32) for this step's rows."""
        # Kept here: the kernel reads them through the addresses until the next step's.
        self.slots = np.ascontiguousarray(slots, dtype=np.int64)
        self.scaling = np.ascontiguousarray(scaling, dtype=np.float32)
        self.addresses.numpy()[:] = (self.slots.ctypes.data, self.scaling.ctypes.data)


def kernel_takes(x: Tensor, out: Tensor, a: Tensor, bt: Tensor) -> bool:
    """The kernel's rule: rows of x and out, contiguous stacks and out, all fp32 or all bf16 on
    the CPU (x is made contiguous)."""
    return (
        native.lora is not None
        and x.dim() == 2
        and out.is_contiguous()
        and a.is_contiguous()
        and bt.is_contiguous()
        and native.cpu_kernel_may_take(x, out, a, bt)
    )


@kernel_op("add_lora", mutates_args=("out",))
def _add_lora_op(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    bt: Tensor,
    rows: Tensor,
    slot_ranks: Tensor,
    max_rank: int,
    path: str,
) -> None:
    launch(
        native.lora.add_products,
        out.data_ptr(), x.data_ptr(), a.data_ptr(), bt.data_ptr(), rows.data_ptr(),
        slot_ranks.data_ptr(), x.shape[0], x.shape[1], out.shape[1], len(slot_ranks),
        a.shape[0] // len(slot_ranks), max_rank, x.dtype == torch.bfloat16, path,
    )  # fmt: skip


def add_lora(
    out: Tensor,
    x: Tensor,
    a: Tensor,
    bt: Tensor,
    rows: StepRows,
    slot_ranks: Tensor,
    max_rank: int,
    path: str | None = None,
) -> None:
    """out [rows, out_features] += scaling[r] * (x[r] A_s^T) B_s^T for each row r whose slot s
    is not -1, where A [slots * width, in] and B^T [slots * width, out] hold slot s in their
    columns s * width + p * max_rank + [0, slot_ranks[s]) for each part p (zeros beyond).

    path: the kernel's CPU path (native.lora.paths(); fastest_path times them); the widest
    this CPU runs by default.
    """
    if len(rows.slots) != x.shape[0]:
        raise ValueError(f"the step set {len(rows.slots)} rows' adapters, x has {x.shape[0]} rows")
    path = path or native.lora.paths()[-1]
    # Copied out here, where a recording sees the copy (and refuses to replay it).
    x = x.contiguous()
    torch.ops.astrai.add_lora(out, x, a, bt, rows.addresses, slot_ranks, max_rank, path)


def fastest_path(a: Tensor, bt: Tensor, slots: int, max_rank: int) -> str:
    """The kernel's fastest CPU path on stacks a and bt (of slots slots, max_rank each), timed
    on a step of TIMED_ROWS rows over up to TIMED_ADAPTERS adapters at full rank, as the other
    kernels' paths are chosen: by measuring, the widest winning ties."""
    paths = native.lora.paths()
    rows = StepRows()
    rows.set(np.arange(TIMED_ROWS) % min(slots, TIMED_ADAPTERS), np.ones(TIMED_ROWS, np.float32))
    ranks = torch.full((slots,), max_rank, dtype=torch.int64)
    x = torch.randn(TIMED_ROWS, a.shape[1], generator=torch.Generator().manual_seed(0))
    out = torch.zeros(TIMED_ROWS, bt.shape[1], dtype=a.dtype)
    step = partial(add_lora, out, x.to(a.dtype), a, bt, rows, ranks, max_rank)
    return fastest({path: partial(_seconds, step, path) for path in paths}, paths[-1])


def _seconds(step, path: str, limit: float) -> float:
    """Seconds of TIMED_CALLS calls of step on path (stopped once past limit)."""
    started = time.perf_counter()
    for _ in range(TIMED_CALLS):
        step(path=path)
        if time.perf_counter() - started > limit:
            break
    return time.perf_counter() - started
