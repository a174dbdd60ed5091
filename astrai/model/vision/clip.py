"""A CLIP vision encoder (the vision tower of LLaVA-style models) as explicit tensor code.

Its parameters are named as transformers' CLIPVisionTransformer names them, so a checkpoint's
vision tower loads by name. It returns the hidden states after a given number of layers:
LLaVA reads the second-to-last layer's, so the layers after it are never built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from astrai.model.vision.encoder import Encoder, VisionConfig

# CLIP's defaults for the settings llava-hf's configs leave out.
CLIP_DEFAULTS = {"num_channels": 3, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}


def clip_config(hf: dict[str, Any]) -> VisionConfig:
    """The settings of a CLIP vision tower (config.json's vision_config)."""
    return VisionConfig.from_hf(hf, ("clip_vision_model",), CLIP_DEFAULTS)


class ClipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig):
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


class ClipVisionTower(nn.Module):
    """The CLIP vision transformer up to the hidden states after n_layers layers (0: the
    embeddings after the pre-norm); its final post-norm belongs to pooling, which LLaVA skips."""

    def __init__(self, config: VisionConfig, n_layers: int):
        super().__init__()
        self.embeddings = ClipEmbeddings(config)
        # transformers' spelling of the pre-norm's name, which its checkpoints keep.
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = Encoder(config, n_layers)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n_images, channels, size, size] -> hidden states [n_images, 1 + num_patches, hidden]."""
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
