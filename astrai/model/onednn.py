"""fp32 linears on oneDNN's GEMM, for serving on CPU.

PyTorch runs fp32 F.linear on MKL. Measured on a 2-core AMD EPYC (AVX2) with a
SmolLM2-135M-shaped model, MKL's small-batch GEMMs from DRAM are slow: a decode step of 64
sequences spent 348 ms in MKL against 157 ms in oneDNN (`benchmarks/README.md`). The results
differ from MKL's only in summation order (max abs diff ~1e-6 on unit-scale outputs).

Packing copies each weight into oneDNN's own tensor and drops the dense one, so a packed model
is for inference only: it cannot be saved, trained or moved to another device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class OneDnnLinear(nn.Module):
    """y = x W^T + b with W held as a oneDNN tensor; x and y are ordinary dense tensors."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed_weight", weight.detach().to_mkldnn(), persistent=False)
        packed_bias = None if bias is None else bias.detach().to_mkldnn()
        self.register_buffer("packed_bias", packed_bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(rows, self.packed_weight, self.packed_bias).to_dense()
        return y.view(*x.shape[:-1], self.out_features)


def can_pack(model: nn.Module) -> bool:
    """oneDNN packing applies to fp32 models on the CPU, when PyTorch was built with it."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of the model, and its lm_head, by a OneDnnLinear, in place.

    A tied model keeps its embedding (the lookup needs the dense table) and gains a packed
    copy of it as the lm_head. Packing a packed model changes nothing.
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, OneDnnLinear(child.weight, child.bias))
    if model.output is None:
        model.output = OneDnnLinear(model.tok_embeddings.weight, None)
