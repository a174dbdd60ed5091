"""What every checkpoint reader shares: its error, a tensor-parallel rank's share, progress."""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from tqdm import tqdm

from astrai.config import ModelConfig
from astrai.model.transformer import Transformer

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointError(ValueError):
    """A model directory's weights are missing, unreadable, or do not fit its config."""


class WeightShard(Protocol):
    """The share of the weights one tensor-parallel rank loads (astrai.distributed's
    TensorShard): its model's config, and which rows or columns of each tensor it holds."""

    def model(self, config: ModelConfig) -> Transformer:
        """The rank's model, for the whole model's config (built where the caller says)."""
        ...

    def spans(self, name: str, config: ModelConfig) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]): the ranges along dim of native tensor `name` (of the
        whole model, config) the rank holds, concatenated in order; None for a tensor every
        rank holds whole."""
        ...


def part_rows(lengths: list[int], ranges: list[tuple[int, int]]) -> list[list[slice]]:
    """For parts of these row counts lying one after another, the slices of each part's rows
    that the ranges of the whole cover, in order (a WeightShard's spans along dim 0)."""
    shares, offset = [], 0
    for length in lengths:
        shares.append(
            [
                slice(max(start - offset, 0), min(stop - offset, length))
                for start, stop in ranges
                if start < offset + length and stop > offset
            ]
        )
        offset += length
    return shares


def loading(items: Collection[T], source: Path) -> Iterable[T]:
    """items, counted on a progress bar when stderr is a terminal, announced in the log."""
    log.info("loading %d tensors from %s", len(items), source)
    return tqdm(
        items,
        desc=f"loading {source.name}",
        unit="tensor",
        leave=False,
        disable=not sys.stderr.isatty(),
    )
