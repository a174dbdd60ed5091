"""The Llama-family model and its loader."""

from astrai.model.automodel import AutoModel
from astrai.model.checkpoint import CheckpointError
from astrai.model.transformer import AttentionBackend, DenseCausalAttention, Transformer

__all__ = [
    "AttentionBackend",
    "AutoModel",
    "CheckpointError",
    "DenseCausalAttention",
    "Transformer",
]
