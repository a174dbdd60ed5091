"""A SigLIP vision encoder (Idefics3's and SmolVLM's vision tower) as explicit tensor code: patch
embeddings with learned positions, the encoder CLIP shares, and a final layer norm.

Its parameters are named as transformers names them, so a checkpoint's tower loads by name.
"""

from __future__ import annotations

from torch import Tensor, nn

from astrai.model.vision.encoder import Encoder, VisionConfig


class SiglipEmbeddings(nn.Module):
    """Patches of an image, embedded, each plus the learned embedding of its position.

    position_ids [num_patches] says which position embedding each patch (in row-major order)
    takes; they are the model's to say (Idefics3 buckets them, see idefics3_position_ids).
    """

    def __init__(self, config: VisionConfig, position_ids: Tensor):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            kernel_size=config.patch_size,
            stride=config.patch_size,
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)
        self.position_ids = position_ids

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n_images, channels, size, size] -> [n_images, num_patches, hidden]."""
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [n, hidden, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [n, num_patches, hidden]
        return patches + self.position_embedding(self.position_ids.to(weight.device))


class SiglipVisionTower(nn.Module):
    """The SigLIP vision transformer: embeddings, every encoder layer, the post-norm."""

    def __init__(self, config: VisionConfig, position_ids: Tensor):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config, position_ids)
        self.encoder = Encoder(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n_images, channels, size, size] -> hidden states [n_images, num_patches, hidden]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
