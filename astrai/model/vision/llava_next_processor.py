"""LLaVA-NeXT's image preprocessing ("anyres"), as transformers' LlavaNextImageProcessor does it
with Pillow, to the pixel: the whole image squashed to one tile, then the image resized (its
aspect kept) to fit the best of image_grid_pinpoints, padded to it and cut into tiles; each tile
preprocessed as CLIP's. Read from a checkpoint's preprocessor_config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from astrai.config import ConfigError
from astrai.model.vision.image_processor import ClipImageProcessor, rgb

SUPPORTED_PROCESSORS = tuple(f"LlavaNextImageProcessor{backend}" for backend in ("", "Fast", "Pil"))
# transformers' LlavaNextImageProcessor default: tiles of 336 pixels, 2 to 4 of them.
DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def best_resolution(
    height: int, width: int, resolutions: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """The (height, width) of resolutions that shows most of an image of this size, fitted in
    with its aspect kept, and wastes least of its area on ties: transformers'
    select_best_resolution, with its rounding."""
    best, most_shown, least_wasted = resolutions[0], 0, math.inf
    for target_height, target_width in resolutions:
        scale = min(target_width / width, target_height / height)
        shown = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_width * target_height - shown
        if shown > most_shown or (shown == most_shown and wasted < least_wasted):
            best, most_shown, least_wasted = (target_height, target_width), shown, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of an image of this size resized to fit target with its aspect kept,
    as transformers' get_patch_output_size rounds it."""
    target_height, target_width = target
    scale_width, scale_height = target_width / width, target_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), target_height), target_width
    return target_height, min(math.ceil(width * scale_height), target_width)


@dataclass(frozen=True)
class LlavaNextImageProcessor:
    """An image -> its tiles' pixel values [1 + rows * cols, 3, tile_size, tile_size]: the
    whole image first, then the tiles of its best resolution row by row.

    grid_pinpoints: the (height, width) resolutions, whole tiles each, an image may be resized
    into; tile: the CLIP preprocessing each tile then gets (its crop is the tile size).
    """

    tile: ClipImageProcessor
    grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_GRID_PINPOINTS

    @property
    def tile_size(self) -> int:
        return self.tile.crop_size[0]

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> LlavaNextImageProcessor:
        """The processor preprocessor_config.json describes; one whose tiles would not be
        square, or whose resolutions are not whole tiles, is refused."""
        tile = ClipImageProcessor.from_hf(config, SUPPORTED_PROCESSORS)
        height, width = tile.crop_size
        if height != width:
            raise ConfigError(
                f"preprocessor_config.json's crop_size {height}x{width} is not square; "
                "LLaVA-NeXT's tiles are"
            )
        pinpoints = config.get("image_grid_pinpoints", DEFAULT_GRID_PINPOINTS)
        if (
            not isinstance(pinpoints, list | tuple)
            or not pinpoints
            or not all(
                isinstance(p, list | tuple)
                and len(p) == 2
                and all(isinstance(n, int) and n > 0 and n % height == 0 for n in p)
                for p in pinpoints
            )
        ):
            raise ConfigError(
                f"preprocessor_config.json's image_grid_pinpoints {pinpoints!r} is not "
                f"supported; astrai takes [height, width] pairs in whole {height}-pixel tiles"
            )
        return cls(tile, tuple((int(h), int(w)) for h, w in pinpoints))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of the tiles an image of this size is cut into, after the whole one."""
        best_height, best_width = best_resolution(height, width, self.grid_pinpoints)
        return best_height // self.tile_size, best_width // self.tile_size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """The image's tiles, pixel values [1 + rows * cols, 3, tile_size, tile_size] float32."""
        image = rgb(image)
        size, resample = self.tile_size, self.tile.resample
        best = best_resolution(image.height, image.width, self.grid_pinpoints)
        height, width = fitted_size(image.height, image.width, best)
        canvas = Image.new("RGB", best[::-1])  # black: transformers pads with zeros
        canvas.paste(
            image.resize((width, height), resample),
            ((best[1] - width) // 2, (best[0] - height) // 2),
        )
        edge = self.tile.shortest_edge
        tiles = [image.resize((edge, edge), resample)]
        tiles += [
            canvas.crop((left, top, left + size, top + size))
            for top in range(0, best[0], size)
            for left in range(0, best[1], size)
        ]
        return torch.stack([self.tile(tile) for tile in tiles])
