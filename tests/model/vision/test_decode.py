"""Image bytes from a request: what decodes, and the refusals (bomb, corrupt, too large)."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from tiny_models import noise_image, png_bomb

from astrai.model.vision.decode import ImageError, ImageLimits, decode_image

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1000 * 1000)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_formats_decode(fmt):
    image = noise_image(0, (20, 10))
    decoded = decode_image(encoded(image, fmt), LIMITS)
    assert decoded.size == (20, 10)


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), color) for color in ("red", "blue")]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    decoded = decode_image(data, LIMITS)
    assert decoded.convert("RGB").getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("size", [(100_000, 100_000), (1001, 1000)])
def test_a_decompression_bomb_is_refused_before_decoding(size, monkeypatch):
    decoded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self))
    data = png_bomb(*size)
    assert len(data) < 200
    with pytest.raises(ImageError, match="pixels") as refused:
        decode_image(data, LIMITS, "messages[0].content[1]")
    assert "messages[0].content[1]" in str(refused.value)
    assert decoded == []


def test_too_many_bytes_are_refused():
    data = encoded(noise_image(0, (20, 10)), "PNG")
    with pytest.raises(ImageError, match=f"{len(data)} bytes"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))


@pytest.mark.parametrize(
    "data",
    [
        b"not an image at all",
        b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
        encoded(noise_image(0), "PNG")[:-30],
    ],
    ids=["text", "broken header", "truncated"],
)
def test_corrupt_data_is_refused_without_library_internals(data):
    with pytest.raises(ImageError) as refused:
        decode_image(data, LIMITS, "the image")
    message = str(refused.value)
    assert message.startswith("the image is ")
    assert "PIL" not in message and "Error" not in message and "0x" not in message
