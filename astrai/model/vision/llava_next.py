"""LLaVA-NeXT's vision side: LLaVA-1.5's CLIP tower and MLP projector run on each tile of an image
("anyres", astrai.model.vision.llava_next_processor); the image's tokens take the whole image's
features, then those of the tiles' patches that lie within the image's aspect, row by row, each
row ended by the learned image_newline embedding, as transformers' LlavaNextModel packs them."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.model.vision.clip import clip_config
from astrai.model.vision.llava import LlavaVision
from astrai.model.vision.llava_next_processor import DEFAULT_GRID_PINPOINTS, LlavaNextImageProcessor
from astrai.model.vision.tiled_image import TiledImage


class LlavaNextVision(LlavaVision):
    """Images -> the embeddings that replace their `<image>` tokens.

    An image stands for as many `<image>` tokens as its size gives (feature_rows), as
    transformers' LlavaNextProcessor expands one; tokens_per_image is a tile's share. All its
    tiles are encoded in one batch (with every other new image's), so chunked prefill may split
    its tokens anywhere.
    """

    def __init__(self, hf: dict[str, Any], processor: LlavaNextImageProcessor):
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy != "default":
            # transformers' LlavaNextModel cannot lay out a CLIP tile's CLS feature either.
            raise ConfigError(
                f"vision_feature_select_strategy {strategy!r} is not supported for LLaVA-NeXT; "
                "its CLIP tiles' features are packed without their CLS token ('default')"
            )
        pinpoints = tuple(map(tuple, hf.get("image_grid_pinpoints", DEFAULT_GRID_PINPOINTS)))
        if pinpoints != processor.grid_pinpoints:
            raise ConfigError(
                f"config.json's image_grid_pinpoints {pinpoints} differ from "
                f"preprocessor_config.json's {processor.grid_pinpoints}; they must be the same"
            )
        # The tower, the projector and the checks of a tile's preprocessing are LLaVA-1.5's.
        super().__init__(hf, processor.tile)
        self.processor = processor
        self.patches_per_side = clip_config(hf.get("vision_config") or {}).patches_per_side
        self.image_newline = nn.Parameter(torch.empty(hf["text_config"]["hidden_size"]))

    def tile(self, image: Image.Image) -> TiledImage:
        """The image's tiles as one TiledImage tile, whose tokens take feature_rows of their
        encoding, with no text around them."""
        rows = self.feature_rows(image.height, image.width)
        return TiledImage(self.processor(image)[None], ("", ""), len(rows), feature_rows=rows)

    def feature_rows(self, height: int, width: int) -> Tensor:
        """For each token an image of this size stands for, the row of its encoding
        (encode_images) that the token takes: the whole image's features; then, of the grid
        of its tiles' patches, those within the image's aspect (transformers' unpad_image,
        with its rounding) row by row, each row followed by image_newline. [n_tokens] int64."""
        rows, cols = self.processor.grid(height, width)
        side = self.patches_per_side
        grid_height, grid_width = rows * side, cols * side
        top, left = 0, 0
        if width / height > grid_width / grid_height:
            top = (grid_height - int(round(height * (grid_width / width), 7))) // 2
        else:
            left = (grid_width - int(round(width * (grid_height / height), 7))) // 2
        row = torch.arange(top, grid_height - top)[:, None]
        col = torch.arange(left, grid_width - left)[None, :]
        tile = 1 + row // side * cols + col // side  # the whole image is tile 0
        patches = tile * side * side + row % side * side + col % side  # [kept rows, kept cols]
        newline = torch.full((len(patches), 1), (1 + rows * cols) * side * side)
        grid = torch.cat((patches, newline), dim=1).flatten()
        return torch.cat((torch.arange(side * side), grid))

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[Tensor]) -> list[Tensor]:
        """Each image's tiles [n_tiles, 3, size, size] -> its encoding [n_tiles *
        tokens_per_image + 1, text_dim]: every tile's embeddings, tile after tile, then
        image_newline; all tiles in one batch."""
        embeddings = self.encode(torch.cat(pixel_values))  # [all tiles, tokens_per_image, dim]
        newline = self.image_newline[None].to(embeddings.dtype)
        per_image = embeddings.split([len(tiles) for tiles in pixel_values])
        return [torch.cat((tiles.flatten(0, 1), newline)) for tiles in per_image]
