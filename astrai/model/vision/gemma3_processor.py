"""Gemma 3's image preprocessing, as transformers' Gemma3ImageProcessor does it with Pillow, to
the pixel: resize to the tower's square size (bilinear), rescale, normalize. Pan-and-scan (extra
crops of a long image) is off, as transformers' default is; a checkpoint that turns it on is
refused. Read from a checkpoint's preprocessor_config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from astrai.config import ConfigError
from astrai.model.vision.image_processor import normalized, rgb

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, transformers' default for Gemma 3
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
SUPPORTED_PROCESSORS = tuple(f"Gemma3ImageProcessor{backend}" for backend in ("", "Fast", "Pil"))


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """An image -> pixel values [3, size, size] float32, as the model was trained to see it."""

    size: int
    resample: int = BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD
    image_std: tuple[float, float, float] = IMAGENET_STANDARD

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Gemma3ImageProcessor:
        """The processor preprocessor_config.json describes; one that would skip a step astrai
        always runs, or crop by pan-and-scan, is refused rather than half applied."""
        kind = config.get("image_processor_type", SUPPORTED_PROCESSORS[0])
        if kind not in SUPPORTED_PROCESSORS:
            raise ConfigError(
                f"preprocessor_config.json's image_processor_type {kind!r} is not supported; "
                f"astrai preprocesses as {SUPPORTED_PROCESSORS[0]}"
            )
        steps = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
        off = [step for step in steps if config.get(step, True) is False]
        if off:
            raise ConfigError(
                f"preprocessor_config.json turns off {off}; astrai's Gemma 3 preprocessing "
                "always runs every step"
            )
        if config.get("do_pan_and_scan"):
            raise ConfigError(
                "preprocessor_config.json turns on do_pan_and_scan, which astrai does not "
                "implement; set it to false (transformers' default): each image is then seen "
                "whole, at the tower's size"
            )
        size = config.get("size", {"height": 224, "width": 224})
        square = isinstance(size, dict) and size.get("height") == size.get("width")
        if not square or not isinstance(size.get("height"), int):
            raise ConfigError(
                f"preprocessor_config.json's size {size!r} is not supported; astrai's Gemma 3 "
                "preprocessing resizes to a square {'height': N, 'width': N}"
            )
        return cls(
            size=size["height"],
            resample=int(config.get("resample", BILINEAR)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            image_mean=tuple(config.get("image_mean", IMAGENET_STANDARD)),
            image_std=tuple(config.get("image_std", IMAGENET_STANDARD)),
        )

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """The image's pixel values [3, size, size] float32."""
        resized = rgb(image).resize((self.size, self.size), resample=self.resample)
        pixels = np.asarray(resized)  # [size, size, 3] uint8
        return normalized(pixels, self.rescale_factor, self.image_mean, self.image_std)
