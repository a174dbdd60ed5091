"""M-RoPE positions (Qwen2-VL): where each token of a prompt with images turns, on three
axes; the engine computes them once per prompt, its tasks hold them, and the executor hands
each step's rows to the model in its StepBatch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MRopePositions:
    """M-RoPE positions of a prompt with images (Qwen2-VL), as transformers' get_rope_index
    gives them: prompt [3, len(prompt)] the (temporal, height, width) position of each token;
    a token past the prompt at index i has i + delta on all three (transformers' rope_deltas),
    since an image's tokens take fewer positions than tokens."""

    prompt: np.ndarray
    delta: int

    @classmethod
    def of(cls, length: int, grids: Sequence[tuple[int, tuple[int, int, int]]]) -> MRopePositions:
        """The positions of a prompt of length tokens whose images' tokens start at each of
        grids' indices, a (t, h, w) grid of tokens each in row-major order. A text token is one
        past the largest position before it, on all three axes; an image's tokens start there
        and count their grid coordinates from it."""
        positions = np.empty((3, length), dtype=np.int64)
        next_position, index = 0, 0
        for start, (t, h, w) in grids:
            text = start - index
            positions[:, index:start] = np.arange(next_position, next_position + text)
            next_position += text
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
            positions[:, start : start + t * h * w] = grid.reshape(3, -1) + next_position
            next_position += max(h, w)  # as transformers counts, whatever t
            index = start + t * h * w
        positions[:, index:] = np.arange(next_position, next_position + length - index)
        return cls(positions, int(positions.max(initial=-1)) + 1 - length)

    def rows(self, start: int, length: int) -> np.ndarray:
        """[3, length] the positions of the sequence's tokens start .. start + length - 1."""
        prompt_length = self.prompt.shape[1]
        after = np.arange(max(start, prompt_length), start + length) + self.delta
        return np.concatenate(
            (self.prompt[:, start : start + length], np.broadcast_to(after, (3, len(after)))),
            axis=1,
        )


def plain_positions(start: int, length: int) -> np.ndarray:
    """[3, length] the M-RoPE positions of tokens start .. start + length - 1 of a sequence
    without images: each token's index on all three axes."""
    return np.broadcast_to(np.arange(start, start + length), (3, length))
