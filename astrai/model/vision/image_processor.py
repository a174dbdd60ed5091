"""CLIP's image preprocessing (resize the shortest edge, center crop, rescale, normalize), as
transformers' CLIPImageProcessor does it with Pillow, to the pixel; read from a checkpoint's
preprocessor_config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from astrai.config import ConfigError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for CLIP
SUPPORTED_PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")


@dataclass(frozen=True)
class ClipImageProcessor:
    """An image -> pixel values [3, crop_height, crop_width] float32, as the model was
    trained to see it."""

    shortest_edge: int
    crop_size: tuple[int, int]  # (height, width)
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], processor_types: tuple[str, ...] = SUPPORTED_PROCESSORS
    ) -> ClipImageProcessor:
        """The processor preprocessor_config.json describes, of one of processor_types (those
        that preprocess as CLIP's: LLaVA-NeXT's does it to each tile); one that would not
        resize, crop, rescale and normalize as LLaVA-1.5's does is refused rather than half
        applied."""
        kind = config.get("image_processor_type", processor_types[0])
        if kind not in processor_types:
            raise ConfigError(
                f"preprocessor_config.json's image_processor_type {kind!r} is not supported; "
                f"astrai preprocesses as {processor_types[0]}"
            )
        steps = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
        off = [step for step in steps if config.get(step, True) is False]
        if off:
            raise ConfigError(
                f"preprocessor_config.json turns off {off}; astrai's CLIP preprocessing "
                "always runs every step"
            )
        size, crop = config.get("size", {}), config.get("crop_size", {})
        if not isinstance(size, dict) or "shortest_edge" not in size:
            raise ConfigError(
                f"preprocessor_config.json's size {size!r} is not supported; astrai's CLIP "
                "preprocessing resizes to a {'shortest_edge': N}"
            )
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(crop, dict) or not {"height", "width"} <= set(crop):
            raise ConfigError(
                f"preprocessor_config.json's crop_size {crop!r} needs height and width"
            )
        return cls(
            shortest_edge=int(size["shortest_edge"]),
            crop_size=(int(crop["height"]), int(crop["width"])),
            resample=int(config.get("resample", BICUBIC)),
            rescale_factor=float(config.get("rescale_factor", 1 / 255)),
            image_mean=tuple(config.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(config.get("image_std", OPENAI_CLIP_STD)),
        )

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """The image's pixel values [3, crop_height, crop_width] float32."""
        image = rgb(image)
        width, height = image.size
        short, long = min(width, height), max(width, height)
        new_long = int(self.shortest_edge * long / short)  # transformers truncates too
        size = (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)
        pixels = np.asarray(image.resize(size, resample=self.resample))  # [H, W, 3] uint8
        pixels = self._center_crop(pixels)
        return normalized(pixels, self.rescale_factor, self.image_mean, self.image_std)

    def _center_crop(self, pixels: np.ndarray) -> np.ndarray:
        """The middle crop_size of pixels [H, W, 3], zero-padded around where the image is
        smaller, as transformers' center_crop does."""
        crop_height, crop_width = self.crop_size
        height, width = pixels.shape[:2]
        if crop_height > height or crop_width > width:
            padded = np.zeros(
                (max(crop_height, height), max(crop_width, width), 3), dtype=pixels.dtype
            )
            top, left = -(-(padded.shape[0] - height) // 2), -(-(padded.shape[1] - width) // 2)
            padded[top : top + height, left : left + width] = pixels
            pixels, (height, width) = padded, padded.shape[:2]
        top, left = (height - crop_height) // 2, (width - crop_width) // 2
        return pixels[top : top + crop_height, left : left + crop_width]


def rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; transparent pixels composited on white, as transformers does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def normalized(
    pixels: np.ndarray,
    rescale_factor: float,
    mean: tuple[float, float, float],
    std: tuple[float, float, float],
) -> torch.Tensor:
    """Pixels [H, W, 3] uint8 rescaled and normalized, as transformers' rescale and normalize
    round them: pixel values [3, H, W] float32."""
    scaled = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    result = (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(result.transpose(2, 0, 1)))
