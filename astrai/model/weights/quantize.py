"""Quantize a dense checkpoint's linears into GGUF blocks as it loads (--quantization).

The blocks come from the gguf package's reference quantizer (llama.cpp's rounding, in NumPy),
so a linear holds what llama.cpp's converter would write for that type, and runs on astrai's
quantized kernels. Of the types astrai has kernels for, that quantizer implements Q8_0, Q4_0,
Q4_1 and Q5_0; the K types (Q4_K, Q6_K) it does not, so those come only from a GGUF file.

The loaders put a tensor's blocks into the Linear built for it (Linear.hold), here for both.
"""

from __future__ import annotations

import logging

from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.kernels import Linear
from astrai.kernels.quant_blocks import BLOCK_TYPES
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model.transformer import Transformer

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
# --quantization name -> the block type it quantizes to
QUANTIZATIONS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0}


def quantization_type(name: str) -> GGMLQuantizationType:
    """The block type a quantization name stands for; anything else is a ConfigError naming
    the choices."""
    qtype = QUANTIZATIONS.get(name.lower()) if isinstance(name, str) else None
    if qtype is not None:
        return qtype
    why = ""
    if isinstance(name, str) and name.upper() in {t.name for t in BLOCK_TYPES}:
        why = (
            " (astrai runs its blocks, but the gguf package has no quantizer for it: load a "
            "GGUF file of that type instead)"
        )
    raise ConfigError(
        f"unsupported quantization {name!r}{why}; choose one of {', '.join(QUANTIZATIONS)}"
    )


def quantize_into(
    model: Transformer, name: str, tensor: Tensor, qtype: GGMLQuantizationType
) -> bool:
    """Quantize checkpoint tensor `name` into model while it loads, and say whether that took
    the tensor: a Linear's weight becomes blocks it holds (True); a tied embedding gives the
    head a quantized copy to hold and is loaded dense itself (False), as its rows are looked up,
    not streamed. A linear whose in_features is not a whole number of blocks stays dense."""
    head = name == "tok_embeddings.weight" and model.config.tie_weight
    if not (head or is_linear_weight(model, name)):
        return False
    unit = BLOCK_TYPES[qtype].unit_weights
    if tensor.shape[1] % unit:
        log.info(
            "%s stays dense: its %d input features are not a multiple of %s's %d-weight blocks",
            "the tied head" if head else name.removesuffix(".weight"),
            tensor.shape[1], qtype.name, unit,
        )  # fmt: skip
        return False
    weight = quantized_weight(tensor, qtype)
    if head:
        model.output.hold(weight)
        return False
    model.get_submodule(name.removesuffix(".weight")).hold(weight)
    return True


def quantized_weight(weight: Tensor, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """W [out_features, in_features] (any float dtype) in qtype's blocks, packed for the
    kernel; quantized from fp32, which holds fp16 and bf16 checkpoints exactly."""
    blocks = quantize(weight.detach().float().numpy(), qtype)
    return QuantizedWeight.from_gguf(blocks, qtype, tuple(weight.shape))


def is_linear_weight(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is the weight of a Linear module."""
    return name.endswith(".weight") and isinstance(
        model.get_submodule(name.removesuffix(".weight")), Linear
    )
