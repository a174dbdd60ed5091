"""The transformer encoder that CLIP and SigLIP vision towers share, as explicit tensor code:
its settings (config.json's vision_config) and its pre-norm layers of bidirectional attention
and an MLP.

Parameters are named as transformers names them in both towers, so a checkpoint's layers load
by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.config import ConfigError


def quick_gelu(x: Tensor) -> Tensor:
    """OpenAI CLIP's GELU approximation, x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def tanh_gelu(x: Tensor) -> Tensor:
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh), SigLIP's activation."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "gelu_pytorch_tanh": tanh_gelu}


@dataclass(frozen=True)
class VisionConfig:
    """The settings of a vision tower (config.json's vision_config)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    hidden_act: str
    layer_norm_eps: float

    @classmethod
    def from_hf(
        cls, hf: dict[str, Any], model_types: tuple[str, ...], defaults: Mapping[str, Any]
    ) -> VisionConfig:
        """The settings of a vision_config whose model_type is one of model_types; defaults
        stand for the settings a checkpoint leaves out (transformers' defaults for the tower,
        which published configs rely on)."""
        model_type = hf.get("model_type", model_types[0])
        if model_type not in model_types:
            raise ConfigError(
                f"vision_config.model_type {model_type!r} is not supported here; this model's "
                f"vision tower loads as {', '.join(model_types)}"
            )
        fields = {**defaults, **{name: hf[name] for name in cls.__dataclass_fields__ if name in hf}}
        missing = [name for name in cls.__dataclass_fields__ if name not in fields]
        if missing:
            raise ConfigError(f"vision_config lacks {missing}; the vision tower needs them")
        config = cls(**fields)
        if config.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_act {config.hidden_act!r} is not supported; astrai's "
                f"vision towers run {sorted(ACTIVATIONS)}"
            )
        if not isinstance(config.image_size, int) or not isinstance(config.patch_size, int):
            raise ConfigError(
                f"vision_config's image_size {config.image_size!r} and patch_size "
                f"{config.patch_size!r} must be ints (square images and patches)"
            )
        return config

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            nn.Linear(dim, dim) for _ in range(4)
        )

    def forward(self, x: Tensor) -> Tensor:
        n, tokens, dim = x.shape
        q, k, v = (
            proj(x).view(n, tokens, self.n_heads, -1).transpose(1, 2)  # [n, heads, tokens, hd]
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(n, tokens, dim))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    """n_layers encoder layers, applied in order."""

    def __init__(self, config: VisionConfig, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(n_layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
