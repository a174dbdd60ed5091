"""An engine's KernelPlan, timed on its model's own linears."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor, nn

from astrai.kernels.kernel_plan import DEFAULT_ACTIVATION_PRECISION, KernelPlan, forced_path
from astrai.kernels.layers import Linear
from astrai.kernels.linear_ops import tune_linears
from astrai.kernels.quant_ops import ConcatenatedWeight, QuantizedWeight, tune_quant_linears


def tune_kernels(
    model: nn.Module,
    batch_invariant: bool = True,
    activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
) -> KernelPlan:
    """The plan for running model on the CPU under these settings and ASTRAI_LINEAR_PATH: its
    dense linears' and its quantized linears' paths, each timed on their weights for x of the
    model's dtype (once per machine: the tuning cache keeps the answers)."""
    plan = KernelPlan(batch_invariant, activation_precision, forced_path())
    dense, quantized = _linear_weights(model)
    if dense:
        plan = replace(plan, dense={dense[0].dtype: tune_linears(dense, plan.forced_path)})
    if quantized:
        choice = tune_quant_linears(
            quantized, model.dtype, batch_invariant, activation_precision, plan.forced_path
        )
        plan = replace(plan, quantized={model.dtype: choice})
    return plan


def _linear_weights(model: nn.Module) -> tuple[list[Tensor], list[QuantizedWeight]]:
    """(the dense Ws, the Ws in blocks) of model's linears, in the order a step multiplies by
    them, a fused projection's parts one by one; a tied head that reads its embedding's dense
    table is in neither."""
    dense, quantized = [], []
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        weight = module.weight
        if isinstance(weight, Tensor):
            dense.append(weight)
        elif isinstance(weight, ConcatenatedWeight):
            quantized.extend(weight.parts)
        elif isinstance(weight, QuantizedWeight):
            quantized.append(weight)
    return dense, quantized
