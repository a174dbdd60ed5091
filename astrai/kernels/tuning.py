"""An engine's KernelPlan, timed on its model's own linears."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from astrai.kernels.kernel_plan import DEFAULT_ACTIVATION_PRECISION, KernelPlan, forced_path
from astrai.kernels.linear_ops import Linear, tune_linears
from astrai.kernels.quant_ops import QuantizedLinear, tune_quant_linears


def tune_kernels(
    model: nn.Module,
    batch_invariant: bool = True,
    activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
) -> KernelPlan:
    """The plan for running model on the CPU under these settings and ASTRAI_LINEAR_PATH: its
    dense linears' and its quantized linears' paths, each timed on their weights for x of the
    model's dtype (once per machine: the tuning cache keeps the answers)."""
    plan = KernelPlan(batch_invariant, activation_precision, forced_path())
    dense = [m.weight for m in model.modules() if isinstance(m, Linear)]
    if dense:
        plan = replace(plan, dense={dense[0].dtype: tune_linears(dense, plan.forced_path)})
    quantized = [m.weight for m in model.modules() if isinstance(m, QuantizedLinear)]
    if quantized:
        choice = tune_quant_linears(
            quantized, model.dtype, batch_invariant, activation_precision, plan.forced_path
        )
        plan = replace(plan, quantized={model.dtype: choice})
    return plan
