"""The model's layers that reach the products and lookups: one Linear and one Embedding,
whatever form their weight is held in.

A weight's format is data, not a class of layer: a dense Parameter, a QuantizedWeight (GGUF
blocks), a ConcatenatedWeight (a fused projection's parts in different block types), or a
TiedTable (a tied LM head's: its embedding's table). A layer is built dense, as the config
says; a loader that keeps a tensor's blocks puts them into the layer built for it (hold), so a
model runs the modules it was built with. The function a format's product or lookup takes is
chosen when the weight is set: a call runs it, with no test of the format.

These layers live apart from linear_ops (dense products) and quant_ops (products on blocks),
as they hold either: neither of those modules knows the other's format.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.kernels.fused_ops import gather_rows
from astrai.kernels.linear_ops import linear
from astrai.kernels.quant_ops import (
    ConcatenatedWeight,
    QuantizedWeight,
    concatenated_linear,
    lookup_rows,
    quant_linear,
)


@dataclass(frozen=True, eq=False)
class TiedTable:
    """A tied LM head's W: its embedding's dense table, read at each call (a load assigns the
    table anew), so the head has no weight of its own to save or load. A head whose table is
    in blocks holds the blocks themselves."""

    embedding: Embedding

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.embedding.weight.shape)


def _tied_linear(x: Tensor, tied: TiedTable, bias: Tensor | None) -> Tensor:
    return linear(x, tied.embedding.weight, bias)


HeldWeight = QuantizedWeight | ConcatenatedWeight | TiedTable
# y = x W^T + b for each format a Linear may hold W in besides its dense Parameter (linear)
PRODUCTS: dict[type, Callable[[Tensor, HeldWeight, Tensor | None], Tensor]] = {
    QuantizedWeight: quant_linear,
    ConcatenatedWeight: concatenated_linear,
    TiedTable: _tied_linear,
}


class Linear(nn.Module):
    """y = x W^T + b, W [out_features, in_features]: a dense Parameter initialised as
    nn.Linear's (and named as its, in the state dict), or the weight given, held."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        weight: HeldWeight | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if weight is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
            self._product = linear
        else:
            self.hold(weight)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def hold(self, weight: HeldWeight) -> None:
        """Multiply by weight from now on, in place of the dense Parameter, which leaves the
        state dict (a loader puts a tensor's blocks into the layer built for it; a bias stays
        a Parameter)."""
        if "weight" in self._parameters:
            del self.weight
        self.weight = weight
        self._product = PRODUCTS[type(weight)]

    def forward(self, x: Tensor) -> Tensor:
        return self._product(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        held = "" if isinstance(self.weight, Tensor) else f", weight={type(self.weight).__name__}"
        return f"in_features={self.in_features}, out_features={self.out_features}{held}"


class Embedding(nn.Module):
    """The token embedding: a table [rows, dim] held dense (a Parameter) or in its GGUF blocks,
    whose rows are decoded as a step looks them up (hold). A tensor-parallel rank's holds the
    vocabulary's rows [first, stop) only: it embeds its own tokens and zeros for the rest, and
    sum_partials adds the ranks' rows up in place."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        rows: tuple[int, int] | None = None,
        sum_partials: Callable[[Tensor], object] | None = None,
    ):
        super().__init__()
        self.rows = rows
        first, stop = (0, vocab_size) if rows is None else rows
        # nn.Embedding's init, N(0, 1), drawn only off the meta device: the loaders build the
        # model there, where a random draw imports torch._dynamo, and with it sympy and
        # triton's library (100 MB resident) and a second of start-up.
        weight = torch.empty(stop - first, dim)
        if not weight.is_meta:
            weight.normal_()
        self.weight = nn.Parameter(weight)
        self.sum_partials = sum_partials
        self._lookup = dense_rows

    def hold(self, table: QuantizedWeight, dtype: torch.dtype) -> None:
        """Keep the table in its blocks from now on, in place of the dense Parameter (which
        leaves the state dict); looked-up rows are decoded to dtype."""
        del self.weight
        self.weight = table
        self._lookup = partial(lookup_rows, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        if self.rows is None:
            return self._lookup(ids, self.weight)
        first, stop = self.rows
        outside = (ids < first) | (ids >= stop)
        local = (ids - first).masked_fill(outside, 0)
        h = self._lookup(local, self.weight).masked_fill(outside[:, None], 0.0)
        self.sum_partials(h)
        return h


def dense_rows(ids: Tensor, table: Tensor) -> Tensor:
    """F.embedding(ids, table); a step's ids [num_tokens] by gather_rows, which a recorded
    step replays."""
    if ids.dim() == 1:
        return gather_rows(table, ids)
    return F.embedding(ids, table)


def held_blocks(model: nn.Module) -> list[QuantizedWeight | ConcatenatedWeight]:
    """The weights model's layers hold in blocks (which are not parameters), each once: a tied
    head and its embedding share theirs."""
    layers = (m for m in model.modules() if isinstance(m, Linear | Embedding))
    held = (m.weight for m in layers if isinstance(m.weight, QuantizedWeight | ConcatenatedWeight))
    return list({id(weight): weight for weight in held}.values())
