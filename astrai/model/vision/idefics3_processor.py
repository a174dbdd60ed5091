"""Idefics3's and SmolVLM's image preprocessing, as transformers' Idefics3ImageProcessor does it
with Pillow, to the pixel: resize the longest edge, split into tiles of the encoder's size plus
the whole image scaled to one tile, rescale, normalize; and the prompt layout its processor
writes around each tile's image tokens. Read from a checkpoint's preprocessor_config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from astrai.config import ConfigError
from astrai.model.vision.image_processor import normalized, rgb
from astrai.model.vision.tiled_image import TiledImage

LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, transformers' default for Idefics3
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
MAX_IMAGE_SIZE = 4096  # transformers caps the resized image's longest edge here
SUPPORTED_PROCESSORS = tuple(
    f"{family}ImageProcessor{backend}"
    for family in ("Idefics3", "SmolVLM")
    for backend in ("", "Fast", "Pil")
)
# The tokens Idefics3Processor writes around each tile's image tokens.
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


@dataclass(frozen=True)
class Idefics3ImageProcessor:
    """An image -> its tiles of tile_size x tile_size pixels and their prompt layout.

    longest_edge: the image is first resized so its longest edge has this many pixels; with
    splitting it is then cut into tiles (rows x cols) and the whole image, scaled to one tile,
    comes last; without splitting the image is scaled to one tile.
    """

    longest_edge: int
    tile_size: int
    split: bool = True
    resample: int = LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Idefics3ImageProcessor:
        """The processor preprocessor_config.json describes; one that would skip a step
        astrai always runs is refused rather than half applied."""
        kind = config.get("image_processor_type", SUPPORTED_PROCESSORS[0])
        if kind not in SUPPORTED_PROCESSORS:
            raise ConfigError(
                f"preprocessor_config.json's image_processor_type {kind!r} is not supported; "
                f"astrai preprocesses as {', '.join(SUPPORTED_PROCESSORS[:4:3])}"
            )
        steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        off = [step for step in steps if config.get(step, True) is False]
        if off:
            raise ConfigError(
                f"preprocessor_config.json turns off {off}; astrai's Idefics3 preprocessing "
                "always runs every step"
            )
        size = config.get("size", {"longest_edge": 4 * 364})
        tile = config.get("max_image_size", {"longest_edge": 364})
        for name, value in (("size", size), ("max_image_size", tile)):
            if not isinstance(value, dict) or not isinstance(value.get("longest_edge"), int):
                raise ConfigError(
                    f"preprocessor_config.json's {name} {value!r} is not supported; astrai's "
                    "Idefics3 preprocessing takes a {'longest_edge': N}"
                )
        return cls(
            longest_edge=size["longest_edge"],
            tile_size=tile["longest_edge"],
            split=bool(config.get("do_image_splitting", True)),
            resample=int(config.get("resample", LANCZOS)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            image_mean=tuple(config.get("image_mean", IMAGENET_STANDARD)),
            image_std=tuple(config.get("image_std", IMAGENET_STANDARD)),
        )

    def __call__(self, image: Image.Image, tokens_per_tile: int) -> TiledImage:
        """The image's tiles (pixel values [n_tiles, 3, tile_size, tile_size] float32), each
        for tokens_per_tile image tokens, and the prompt text around each tile's tokens."""
        image = rgb(image)
        width, height = image.size
        image = image.resize(_longest_edge_size(width, height, self.longest_edge), self.resample)
        size = self.tile_size
        rows = cols = 0
        if self.split:
            image = image.resize(_tile_multiple_size(*image.size, size), self.resample)
            width, height = image.size
            if width > size or height > size:
                rows, cols = height // size, width // size
        if rows:
            pixels = np.asarray(image)  # [H, W, 3] uint8
            crops = [
                pixels[r * size : (r + 1) * size, c * size : (c + 1) * size]
                for r in range(rows)
                for c in range(cols)
            ]
        else:
            crops = []
        crops.append(np.asarray(image.resize((size, size), self.resample)))
        tiles = [normalized(c, self.rescale_factor, self.image_mean, self.image_std) for c in crops]
        return TiledImage(torch.stack(tiles), _layout(rows, cols), tokens_per_tile)


def _longest_edge_size(width: int, height: int, longest_edge: int) -> tuple[int, int]:
    """(width, height) with the longest edge at longest_edge (the other rounded up to even),
    then scaled below MAX_IMAGE_SIZE, as transformers' Idefics3 resize computes it."""
    aspect = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(width, 1), max(height, 1)


def _tile_multiple_size(width: int, height: int, tile: int) -> tuple[int, int]:
    """(width, height) rounded up to whole tiles, the longest edge first, as transformers'
    resize_for_vision_encoder computes it."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


def _layout(rows: int, cols: int) -> tuple[str, ...]:
    """The texts around the tiles' image tokens, as Idefics3Processor writes an image: each
    crop after its <row_r_col_c> tag, a line per row, then the whole image after
    <global-img>, all between <fake_token_around_image> tokens."""
    texts = [
        ("\n" if c == 0 and r else "") + f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>"
        for r in range(rows)
        for c in range(cols)
    ]
    texts.append(("\n\n" if rows else "") + FAKE_TOKEN + GLOBAL_TOKEN)
    return (*texts, FAKE_TOKEN)
