"""Image bytes from a request -> a decoded Pillow image, within limits, or an ImageError that
says what was wrong without the imaging library's internals."""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageError(ValueError):
    """An image a request carries that cannot be used: not an image, too large, a format astrai
    does not read. The message is for the client."""


@dataclass(frozen=True)
class ImageLimits:
    """The most bytes and pixels (width x height) one image of a request may have."""

    max_bytes: int = 20 << 20
    max_pixels: int = 4096 * 4096


def decode_image(data: bytes, limits: ImageLimits, what: str = "the image") -> Image.Image:
    """The image data holds (a GIF's first frame), loaded; an ImageError naming `what` for
    data over the limits, not an image, or of a format outside FORMATS.

    The size is checked from the header before any pixel is decoded, so a small file that
    declares a huge image (a decompression bomb) costs nothing.
    """
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"{what} is {len(data)} bytes, over the limit of {limits.max_bytes} bytes per image"
        )
    try:
        # Pillow refuses past twice its own pixel limit here; below that limits decide.
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(
            f"{what} declares more pixels than an image may have (at most {limits.max_pixels}); "
            "send a smaller image"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageError(
            f"{what} is not a readable image; send PNG, JPEG, WebP or GIF data "
            "(base64-encoded in a data: URL or the API's image field)"
        ) from None
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{what} is {width}x{height} pixels, over the limit of {limits.max_pixels} pixels "
            "per image; send a smaller image"
        )
    try:
        image.seek(0)  # a GIF's first frame
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise ImageError(
            f"{what} is corrupt or truncated; send a complete PNG, JPEG, WebP or GIF file"
        ) from None
    return image
