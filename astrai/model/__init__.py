"""The Llama-family model and its loader."""

from astrai.model.automodel import AutoModel
from astrai.model.transformer import AttentionBackend, DenseCausalAttention, Transformer
from astrai.model.weights.checkpoint import CheckpointError

__all__ = [
    "AttentionBackend",
    "AutoModel",
    "CheckpointError",
    "DenseCausalAttention",
    "Transformer",
]
