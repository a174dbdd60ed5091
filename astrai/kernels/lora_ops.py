"""LoRA's low-rank products for every row of a step in one call per adapted linear, each row
under its own adapter (Punica's SGMV idea), on the CPU's C kernel (csrc/lora.c).

The adapters' A and B^T lie stacked per linear, one block of columns a slot; which slot and
scaling each row takes are the step's input (StepRows), set once per step as the page tables
are, so a recorded call replays with each step's rows. CUDA and dtypes the kernel does not
read (fp16) take astrai.model.lora's grouped PyTorch products instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from astrai.kernels import native
from astrai.kernels.graph import launch
from astrai.kernels.native import kernel_op


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

    path: the kernel's CPU path (native.lora.paths()); the widest this CPU runs by default.
    """
    if len(rows.slots) != x.shape[0]:
        raise ValueError(f"the step set {len(rows.slots)} rows' adapters, x has {x.shape[0]} rows")
    path = path or native.lora.paths()[-1]
    # Copied out here, where a recording sees the copy (and refuses to replay it).
    x = x.contiguous()
    torch.ops.astrai.add_lora(out, x, a, bt, rows.addresses, slot_ranks, max_rank, path)
