"""Idefics3's and SmolVLM's vision side: each tile of an image (astrai.model.vision.
idefics3_processor) through a SigLIP tower, its patch features pixel-shuffled (each
scale_factor x scale_factor block of patches becomes one feature) and projected into the
language model's embeddings, one per `<image>` token of the tile."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.model.vision.encoder import VisionConfig
from astrai.model.vision.idefics3_processor import Idefics3ImageProcessor
from astrai.model.vision.siglip import SiglipVisionTower
from astrai.model.vision.tiled_image import TiledImage

VISION_MODEL_TYPES = ("idefics3_vision", "smolvlm_vision")
# transformers' Idefics3VisionConfig defaults, which published configs rely on.
IDEFICS3_VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
DEFAULT_IMAGE_TOKEN_ID = 128257  # transformers' Idefics3Config default


def idefics3_position_ids(side: int) -> Tensor:
    """The position of each patch of a full side x side tile, as Idefics3's embeddings compute
    it: each patch's fractional coordinate bucketed by float32 boundaries, which for some
    sides (19, 25, 29, ...) repeats one position and skips another. [side * side] int64."""
    # On the CPU whatever device the model is built on (loaders build it on meta).
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device="cpu")
    coords = torch.arange(side, dtype=torch.float32, device="cpu") * (1.0 / side)
    buckets = torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


class Idefics3Projection(nn.Module):
    """The connector's linear map, under the name checkpoints give it (modality_projection.proj);
    Idefics3Connector applies it."""

    def __init__(self, in_dim: int, text_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, text_dim, bias=False)


class Idefics3Connector(nn.Module):
    """Patch features [n, side * side, dim] -> [n, (side / s)^2, text_dim]: each s x s block
    of patches concatenated (pixel shuffle, in transformers' order), then projected."""

    def __init__(self, vision_dim: int, text_dim: int, scale_factor: int):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = Idefics3Projection(vision_dim * scale_factor**2, text_dim)

    def forward(self, features: Tensor) -> Tensor:
        n, seq, dim = features.shape
        side, s = int(seq**0.5), self.scale_factor
        x = features.view(n, side, side // s, dim * s)  # s neighbours along a row
        x = x.transpose(1, 2).reshape(n, side // s, side // s, dim * s * s)
        x = x.transpose(1, 2).reshape(n, seq // (s * s), dim * s * s)
        return self.modality_projection.proj(x)


class Idefics3Vision(nn.Module):
    """Images -> the embeddings that replace their `<image>` tokens.

    Each image is tiled by processor; every tile stands for tokens_per_image `<image>` tokens
    (image_token_id) in the prompt, within the layout text the processor gives.
    """

    def __init__(self, hf: dict[str, Any], processor: Idefics3ImageProcessor):
        super().__init__()
        vision = VisionConfig.from_hf(
            hf.get("vision_config") or {}, VISION_MODEL_TYPES, IDEFICS3_VISION_DEFAULTS
        )
        scale = hf.get("scale_factor", 2)
        side = vision.patches_per_side
        if not isinstance(scale, int) or scale < 1 or side % scale:
            raise ConfigError(
                f"scale_factor {scale!r} must be a positive int that divides the tile's "
                f"{side} patches per side"
            )
        if processor.tile_size != vision.image_size:
            raise ConfigError(
                f"preprocessor_config.json cuts {processor.tile_size}-pixel tiles "
                f"(max_image_size), but the vision tower takes {vision.image_size}x"
                f"{vision.image_size} images"
            )
        self.image_token_id = int(hf.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID))
        self.placeholder_ids = (self.image_token_id,)  # what a chat's image part renders as
        self.image_part_ends_line = True
        self.tokens_per_image = (side // scale) ** 2
        self.processor = processor
        self.vision_model = SiglipVisionTower(vision, idefics3_position_ids(side))
        text_dim = hf["text_config"]["hidden_size"]
        self.connector = Idefics3Connector(vision.hidden_size, text_dim, scale)

    def tile(self, image: Image.Image) -> TiledImage:
        """The image's tiles, each for tokens_per_image image tokens, and their layout."""
        return self.processor(image, self.tokens_per_image)

    def encode_images(self, pixel_values: list[Tensor]) -> list[Tensor]:
        """Each tile's embeddings [tokens_per_image, text_dim]: encode's, one batch for all."""
        return list(self.encode(torch.stack(pixel_values)))

    @torch.inference_mode()
    def encode(self, pixel_values: Tensor) -> Tensor:
        """Tiles [n_tiles, 3, size, size] -> embeddings [n_tiles, tokens_per_image, text_dim]
        in the projection's dtype."""
        return self.connector(self.vision_model(pixel_values))
