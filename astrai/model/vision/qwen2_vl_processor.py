"""Qwen2-VL's and Qwen2.5-VL's image preprocessing, as transformers' Qwen2VLImageProcessor does
it with Pillow, to the pixel: resize to a multiple of the merged patch within a pixel budget
(smart_resize), rescale, normalize, and cut into patches in the flattened layout the vision
tower's Conv3d reads, each 2x2 block of patches (one token after merging) side by side. Read
from a checkpoint's preprocessor_config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from astrai.config import ConfigError
from astrai.model.vision.decode import ImageError
from astrai.model.vision.image_processor import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalized, rgb
from astrai.model.vision.tiled_image import TiledImage

BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for Qwen2-VL
SUPPORTED_PROCESSORS = tuple(
    f"{family}ImageProcessor{backend}"
    for family in ("Qwen2VL", "Qwen2_5_VL")
    for backend in ("", "Fast", "Pil")
)
MAX_ASPECT_RATIO = 200  # transformers refuses images longer than this to a side


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """(height, width) rounded to multiples of factor, scaled into [min_pixels, max_pixels]
    with the aspect ratio kept as near as may be, as transformers' smart_resize computes it."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"the image is {width}x{height} pixels, more than {MAX_ASPECT_RATIO} times longer "
            "to one side than the other; Qwen2-VL reads no image that narrow, so crop it"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    """An image -> its patches, in blocks of merge_size x merge_size patches (one token each
    in the prompt) [rows, cols, merge_size^2, 3 * temporal_patch_size * patch_size^2].

    A still image is one frame repeated temporal_patch_size times, as transformers repeats it.
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen2VLImageProcessor:
        """The processor preprocessor_config.json describes (min_pixels and max_pixels at the
        top level win over size, as in transformers); one that would skip a step astrai
        always runs is refused rather than half applied."""
        kind = config.get("image_processor_type", SUPPORTED_PROCESSORS[0])
        if kind not in SUPPORTED_PROCESSORS:
            raise ConfigError(
                f"preprocessor_config.json's image_processor_type {kind!r} is not supported; "
                f"astrai preprocesses as {', '.join(SUPPORTED_PROCESSORS[::3])}"
            )
        steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        off = [step for step in steps if config.get(step, True) is False]
        if off:
            raise ConfigError(
                f"preprocessor_config.json turns off {off}; astrai's Qwen2-VL preprocessing "
                "always runs every step"
            )
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        max_pixels = config.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        if not all(isinstance(n, int) and n > 0 for n in (min_pixels, max_pixels)):
            raise ConfigError(
                f"preprocessor_config.json's pixel budget {min_pixels!r}..{max_pixels!r} must "
                "be positive ints (min_pixels, max_pixels or size's shortest_edge, longest_edge)"
            )
        return cls(
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            patch_size=int(config.get("patch_size", 14)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            merge_size=int(config.get("merge_size", 2)),
            resample=int(config.get("resample", BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            image_mean=tuple(config.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(config.get("image_std", OPENAI_CLIP_STD)),
        )

    def __call__(self, image: Image.Image) -> TiledImage:
        """The image as one tile: its patches [1, rows, cols, merge_size^2, patch_dim] float32,
        standing for rows * cols tokens (a (1, rows, cols) grid of them), with no text around
        them."""
        image = rgb(image)
        width, height = image.size
        factor = self.patch_size * self.merge_size
        size = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        resized = np.asarray(image.resize(size[::-1], resample=self.resample))  # [H, W, 3] uint8
        pixels = normalized(resized, self.rescale_factor, self.image_mean, self.image_std).numpy()
        patches = self._patchify(pixels)
        rows, cols = patches.shape[:2]
        return TiledImage(patches[None], ("", ""), rows * cols, grid=(1, rows, cols))

    def _patchify(self, pixels: np.ndarray) -> torch.Tensor:
        """pixels [3, H, W] -> patches [H / (P m), W / (P m), m * m, 3 * T * P * P], in
        transformers' order: blocks row by row, a block's patches row by row, each patch's
        values by channel, frame, row, column."""
        channels, height, width = pixels.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        shape = (grid_h // m, grid_w // m, m * m, channels * t * p * p)
        return torch.from_numpy(np.ascontiguousarray(frames).reshape(shape))
