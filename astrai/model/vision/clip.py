"""A CLIP vision encoder (the vision tower of LLaVA-style models) as explicit tensor code.

Its parameters are named as transformers' CLIPVisionTransformer names them, so a checkpoint's
vision tower loads by name. It returns the hidden states after a given number of layers:
LLaVA reads the second-to-last layer's, so the layers after it are never built.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.config import ConfigError


def quick_gelu(x: Tensor) -> Tensor:
    """OpenAI CLIP's GELU approximation, x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu}


@dataclass(frozen=True)
class ClipVisionConfig:
    """The settings of a CLIP vision tower (config.json's vision_config), with CLIP's defaults
    for those a checkpoint leaves out (llava-hf's configs do)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ClipVisionConfig:
        if hf.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ConfigError(
                f"vision_config.model_type {hf.get('model_type')!r} is not supported; astrai's "
                "LLaVA loads CLIP vision towers (clip_vision_model) only"
            )
        fields = {name: hf[name] for name in cls.__dataclass_fields__ if name in hf}
        missing = [
            name
            for name, spec in cls.__dataclass_fields__.items()
            if name not in fields and spec.default is MISSING
        ]
        if missing:
            raise ConfigError(f"vision_config lacks {missing}; the CLIP tower needs them")
        config = cls(**fields)
        if config.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_act {config.hidden_act!r} is not supported; "
                f"astrai's CLIP tower runs {sorted(ACTIVATIONS)}"
            )
        return config

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class ClipEmbeddings(nn.Module):
    def __init__(self, config: ClipVisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            bias=False,
        )
        self.position_embedding = nn.Embedding(config.num_patches + 1, config.hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n_images, channels, size, size] -> [n_images, 1 + num_patches, hidden]."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [n, hidden, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [n, num_patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one image's tokens."""

    def __init__(self, config: ClipVisionConfig):
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


class ClipMLP(nn.Module):
    def __init__(self, config: ClipVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, config: ClipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    def __init__(self, config: ClipVisionConfig, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config) for _ in range(n_layers))


class ClipVisionTower(nn.Module):
    """The CLIP vision transformer up to the hidden states after n_layers layers (0: the
    embeddings after the pre-norm); its final post-norm belongs to pooling, which LLaVA skips."""

    def __init__(self, config: ClipVisionConfig, n_layers: int):
        super().__init__()
        self.embeddings = ClipEmbeddings(config)
        # transformers' spelling of the pre-norm's name, which its checkpoints keep.
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = ClipEncoder(config, n_layers)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n_images, channels, size, size] -> hidden states [n_images, 1 + num_patches, hidden]."""
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x
