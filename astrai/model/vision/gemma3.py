"""Gemma 3's vision side: an image (astrai.model.vision.gemma3_processor) through a SigLIP tower,
its patch grid average-pooled to mm_tokens_per_image features, each normed by Gemma's (1 + w)
RMSNorm and projected into the language model's embeddings, one per `<image_soft_token>`.

In the prompt an image is `<start_of_image>`, expanded as Gemma3Processor expands it:
`\\n\\n<start_of_image>`, the soft tokens, `<end_of_image>\\n\\n`. The soft tokens of one image
attend to each other in the language model (transformers' token_type_ids mask), so the image is
bidirectional (TiledImage.bidirectional).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.model.vision.encoder import VisionConfig
from astrai.model.vision.gemma3_processor import Gemma3ImageProcessor
from astrai.model.vision.siglip import SiglipVisionTower
from astrai.model.vision.tiled_image import TiledImage

# transformers' SiglipVisionConfig defaults, which published configs rely on.
SIGLIP_DEFAULTS = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# transformers' Gemma3Config defaults: mm_tokens_per_image and the three image tokens.
GEMMA3_DEFAULTS = {
    "mm_tokens_per_image": 256,
    "boi_token_index": 255_999,
    "eoi_token_index": 256_000,
    "image_token_index": 262_144,
}
START_OF_IMAGE, END_OF_IMAGE = "<start_of_image>", "<end_of_image>"


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x normed in fp32, scaled by 1 + weight, then cast back (transformers'
    Gemma3RMSNorm; the language model's norms get their 1 added at load instead)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(nn.Module):
    """Patch features [n, side * side, dim] -> [n, tokens, text_dim]: average-pooled over
    kernel x kernel blocks of the patch grid, normed, then multiplied by
    mm_input_projection_weight [dim, text_dim]."""

    def __init__(self, vision_dim: int, text_dim: int, eps: float, side: int, kernel: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_dim, text_dim))
        self.mm_soft_emb_norm = UnitOffsetRMSNorm(vision_dim, eps)
        self.side, self.kernel = side, kernel

    def forward(self, features: Tensor) -> Tensor:
        n, _, dim = features.shape
        grid = features.transpose(1, 2).reshape(n, dim, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)  # [n, tokens, dim]
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3Vision(nn.Module):
    """Images -> the embeddings that replace their `<image_soft_token>` tokens.

    image_token_id is the placeholder a prompt holds for an image (`<start_of_image>`); each
    image stands for tokens_per_image soft tokens within the layout text Gemma3Processor
    writes around them.
    """

    def __init__(self, hf: dict[str, Any], processor: Gemma3ImageProcessor):
        super().__init__()
        vision = VisionConfig.from_hf(
            hf.get("vision_config") or {}, ("siglip_vision_model",), SIGLIP_DEFAULTS
        )
        settings = {**GEMMA3_DEFAULTS, **{k: hf[k] for k in GEMMA3_DEFAULTS if k in hf}}
        tokens = settings["mm_tokens_per_image"]
        side = vision.patches_per_side
        tokens_per_side = int(tokens**0.5)
        if tokens_per_side**2 != tokens or side % tokens_per_side:
            raise ConfigError(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the vision "
                f"tower's {side} patches per side (each token pools a square of patches)"
            )
        if processor.size != vision.image_size:
            raise ConfigError(
                f"preprocessor_config.json resizes images to {processor.size} pixels, but the "
                f"vision tower takes {vision.image_size}x{vision.image_size} images"
            )
        self.image_token_id = settings["boi_token_index"]
        self.placeholder_ids = (self.image_token_id,)  # what a chat's image part renders as
        self.image_part_ends_line = False  # Gemma 3's template runs on into the next part
        self.soft_token_id = settings["image_token_index"]
        self.tokens_per_image = tokens
        self.processor = processor
        positions = torch.arange(vision.num_patches, device="cpu")  # the loader builds on meta
        self.vision_tower = SiglipVisionTower(vision, positions)
        self.multi_modal_projector = Gemma3Projector(
            vision.hidden_size,
            hf["text_config"]["hidden_size"],
            vision.layer_norm_eps,
            side,
            side // tokens_per_side,
        )

    def tile(self, image: Image.Image) -> TiledImage:
        """The image as one tile of tokens_per_image soft tokens, within Gemma 3's layout."""
        return TiledImage(
            self.processor(image)[None],
            (f"\n\n{START_OF_IMAGE}", f"{END_OF_IMAGE}\n\n"),
            self.tokens_per_image,
            image_token=self.soft_token_id,
            bidirectional=True,
        )

    def encode_images(self, pixel_values: list[Tensor]) -> list[Tensor]:
        """Each image's embeddings [tokens_per_image, text_dim]: encode's, one batch for all."""
        return list(self.encode(torch.stack(pixel_values)))

    @torch.inference_mode()
    def encode(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [n_images, 3, size, size] -> embeddings [n_images, tokens_per_image,
        text_dim] in the projection's dtype."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))
