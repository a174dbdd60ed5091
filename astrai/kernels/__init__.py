"""astrai's native code and the one way to reach it.

csrc/ holds the C sources (built at install, optional: without a compiler every op takes its
PyTorch path). Each op here is a typed entry point with one rule for when its kernel may run,
registered as a torch.library custom op so torch.compile and fake tensors see it. No other
package touches a data pointer.
"""

from astrai.kernels.fused_ops import (
    add_rms_norm,
    apply_rope,
    gelu_tanh_and_mul,
    rms_norm,
    silu_and_mul,
)
from astrai.kernels.graph import Arena, StepGraph, data_addresses, launch_opaque
from astrai.kernels.kernel_plan import SKINNY_MAX_ROWS, KernelPlan, LinearChoice, LinearPath
from astrai.kernels.layers import Embedding, Linear, TiedTable
from astrai.kernels.linear_ops import linear, tune_linears
from astrai.kernels.paged_attention import PagedDecode
from astrai.kernels.tuning import tune_kernels

__all__ = [
    "SKINNY_MAX_ROWS",
    "Arena",
    "Embedding",
    "KernelPlan",
    "Linear",
    "LinearChoice",
    "LinearPath",
    "PagedDecode",
    "StepGraph",
    "TiedTable",
    "add_rms_norm",
    "data_addresses",
    "launch_opaque",
    "apply_rope",
    "gelu_tanh_and_mul",
    "linear",
    "rms_norm",
    "silu_and_mul",
    "tune_kernels",
    "tune_linears",
]
