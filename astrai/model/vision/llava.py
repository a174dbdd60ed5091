"""LLaVA-1.5's vision side: a CLIP tower read at one layer, its patch features (CLS dropped by
the "default" strategy) projected by a two-layer GELU MLP into the language model's
embeddings, one per `<image>` placeholder token."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.model.vision.clip import ClipVisionTower, clip_config
from astrai.model.vision.image_processor import ClipImageProcessor
from astrai.model.vision.tiled_image import TiledImage

PROJECTOR_ACTIVATIONS = {"gelu": F.gelu}
SELECT_STRATEGIES = ("default", "full")


class LlavaProjector(nn.Module):
    """vision features [..., vision_dim] -> [..., text_dim]: linear, GELU, linear."""

    def __init__(self, vision_dim: int, text_dim: int, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear_2(F.gelu(self.linear_1(features)))


class LlavaVision(nn.Module):
    """Images -> the embeddings that replace their placeholder tokens.

    image_token_id is the placeholder's token id; each image stands for tokens_per_image of
    them in the prompt, as transformers' LlavaProcessor expands one `<image>`. processor turns
    a Pillow image into the pixel values encode takes.
    """

    def __init__(self, hf: dict[str, Any], processor: ClipImageProcessor):
        super().__init__()
        vision = clip_config(hf.get("vision_config") or {})
        layer = hf.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or not -vision.num_hidden_layers - 1 <= layer <= (
            vision.num_hidden_layers
        ):
            raise ConfigError(
                f"vision_feature_layer {layer!r} is not supported; astrai's LLaVA reads one "
                f"layer, an int in [-{vision.num_hidden_layers + 1}, {vision.num_hidden_layers}]"
            )
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ConfigError(
                f"vision_feature_select_strategy {strategy!r} is not supported; use one of "
                f"{SELECT_STRATEGIES}"
            )
        act = hf.get("projector_hidden_act", "gelu")
        if act not in PROJECTOR_ACTIVATIONS:
            raise ConfigError(
                f"projector_hidden_act {act!r} is not supported; astrai's LLaVA projector "
                f"runs {sorted(PROJECTOR_ACTIVATIONS)}"
            )
        if processor.crop_size != (vision.image_size, vision.image_size):
            raise ConfigError(
                f"preprocessor_config.json crops images to {processor.crop_size}, but the "
                f"vision tower takes {vision.image_size}x{vision.image_size}"
            )
        if "image_token_index" not in hf and "image_token_id" not in hf:
            raise ConfigError("config.json names no image_token_index, the `<image>` token id")
        self.image_token_id = int(hf.get("image_token_index", hf.get("image_token_id")))
        self.placeholder_ids = (self.image_token_id,)  # what a chat's image part renders as
        self.image_part_ends_line = True  # LLaVA's templates write `<image>\n`
        # hidden states [0] are the embeddings, [k] the output of layer k.
        n_layers = layer if layer >= 0 else vision.num_hidden_layers + 1 + layer
        self.drops_cls = strategy == "default"
        self.tokens_per_image = vision.num_patches + (0 if self.drops_cls else 1)
        self.processor = processor
        self.vision_tower = ClipVisionTower(vision, n_layers)
        text_dim = hf["text_config"]["hidden_size"]
        bias = hf.get("multimodal_projector_bias", True)
        self.multi_modal_projector = LlavaProjector(vision.hidden_size, text_dim, bias)

    def tile(self, image: Image.Image) -> TiledImage:
        """The image as one tile of tokens_per_image image tokens, with no text around them."""
        return TiledImage(self.processor(image)[None], ("", ""), self.tokens_per_image)

    def encode_images(self, pixel_values: list[Tensor]) -> list[Tensor]:
        """Each tile's embeddings [tokens_per_image, text_dim], its pixel values all of one
        size: encode's, one batch for all."""
        return list(self.encode(torch.stack(pixel_values)))

    @torch.inference_mode()
    def encode(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [n_images, 3, size, size] -> embeddings [n_images, tokens_per_image,
        text_dim] in the projector's dtype."""
        features = self.vision_tower(pixel_values)  # [n, 1 + patches, vision_dim]
        if self.drops_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)
