"""An image as a vision-language model's prompt holds it: the tiles its encoder sees, each
standing for a run of image tokens, and the text the model's layout puts around them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class TiledImage:
    """pixel_values [n_tiles, ...]: one row per tile the encoder sees (LLaVA: the image;
    Idefics3: its crops, then the whole image scaled down; Qwen2-VL: the image's patches;
    LLaVA-NeXT: all its crops, whose features the encoder packs together).
    Each tile stands for tokens_per_tile image tokens. texts has n_tiles + 1 entries: texts[i]
    comes before tile i's image tokens, texts[-1] after the last tile's. grid: the (t, h, w)
    grid a tile's tokens lie on in row-major order, for M-RoPE (None for a model without).
    image_token: the token a tile's image tokens are, where it is not the placeholder that
    stands for the whole image in a prompt (Gemma 3: `<image_soft_token>`, placed by
    `<start_of_image>`). bidirectional: a tile's image tokens attend to each other, not only
    to those before them (Gemma 3), so a prefill chunk that computes one computes them all.
    feature_rows [tokens_per_tile] int64: the row of the tile's encoding that each of its tokens
    takes, where the encoder's output is not one row per token in order (LLaVA-NeXT's: its
    tiles' features, of which the image's aspect keeps some, and a newline embedding); None
    where token i takes row i."""

    pixel_values: Tensor
    texts: tuple[str, ...]
    tokens_per_tile: int
    grid: tuple[int, int, int] | None = None
    image_token: int | None = None
    bidirectional: bool = False
    feature_rows: Tensor | None = None

    def __post_init__(self) -> None:
        assert len(self.texts) == len(self.pixel_values) + 1

    def token_ids(
        self, image_token: int, encode: Callable[[str], list[int]]
    ) -> tuple[list[int], list[int]]:
        """The token ids the image's one placeholder (image_token) expands to, and where each
        tile's run of tokens_per_tile image tokens starts in them. encode tokenizes a text
        without special tokens added; the layout's texts end at special tokens or the image
        tokens, so each encodes as it would within the whole prompt."""
        token = image_token if self.image_token is None else self.image_token
        ids: list[int] = []
        starts: list[int] = []
        for text in self.texts[:-1]:
            ids += encode(text) if text else []
            starts.append(len(ids))
            ids += [token] * self.tokens_per_tile
        ids += encode(self.texts[-1]) if self.texts[-1] else []
        return ids, starts


def expand_image_tokens(
    token_ids: Sequence[int],
    images: Sequence[TiledImage],
    image_token: int,
    encode: Callable[[str], list[int]],
) -> tuple[list[int], list[tuple[TiledImage, int, int]]]:
    """token_ids with their image tokens (one per image, in order) each expanded to its image's
    tokens (TiledImage.token_ids), and every tile as (its image, its index there, the position
    where its run of image tokens starts)."""
    expanded: list[int] = []
    tiles: list[tuple[TiledImage, int, int]] = []
    remaining = iter(images)
    for token in token_ids:
        if token != image_token:
            expanded.append(token)
            continue
        image = next(remaining)
        ids, starts = image.token_ids(image_token, encode)
        tiles += [(image, i, len(expanded) + start) for i, start in enumerate(starts)]
        expanded += ids
    return expanded, tiles
