"""One Linear and one Embedding whatever their weight's format: dense, blocks, parts in
different block types, a tied head's table, a tensor-parallel rank's share of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from astrai.kernels import Embedding, Linear, TiedTable
from astrai.kernels.layers import held_blocks
from astrai.kernels.quant_ops import ConcatenatedWeight, QuantizedWeight, quant_linear

Q8_0, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0


def blocks(out_features: int, in_features: int, qtype=Q8_0, seed: int = 0) -> QuantizedWeight:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    return QuantizedWeight.from_gguf(quantize(weight.numpy(), qtype), qtype, tuple(weight.shape))


def test_linear_module_keeps_nn_linear_parameters_and_trains():
    layer = Linear(16, 4)
    assert set(layer.state_dict()) == {"weight", "bias"}
    layer(torch.randn(2, 16)).sum().backward()
    assert layer.weight.grad is not None


def test_a_dense_linear_is_initialised_as_nn_linear_is():
    """A model built off the meta device draws the same random weights as before."""
    torch.manual_seed(3)
    ours = Linear(16, 4)
    torch.manual_seed(3)
    theirs = nn.Linear(16, 4)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)


def test_a_linear_holding_blocks_multiplies_by_them_and_saves_only_its_bias():
    layer = Linear(64, 16).requires_grad_(False)
    weight = blocks(16, 64)
    layer.hold(weight)
    assert set(layer.state_dict()) == {"bias"} and layer.weight is weight
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), quant_linear(x, weight, layer.bias))
    assert held_blocks(layer) == [weight]


def test_a_linear_holding_parts_joins_their_products():
    """A fused projection whose parts are in different block types (Q8_0 q, Q4_0 k)."""
    parts = (blocks(16, 64, Q8_0, seed=1), blocks(8, 64, Q4_0, seed=2))
    layer = Linear(64, 24, weight=ConcatenatedWeight(parts)).requires_grad_(False)
    assert layer.weight.shape == (24, 64)
    x = torch.randn(2, 64)
    expected = torch.cat([quant_linear(x, part) for part in parts], dim=-1) + layer.bias
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer.weight.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_a_tied_head_reads_the_table_its_embedding_holds_now():
    """Loading assigns the embedding a new Parameter: the head multiplies by that one."""
    embedding = Embedding(10, 32)
    head = Linear(32, 10, bias=False, weight=TiedTable(embedding))
    assert not head.state_dict()
    embedding.load_state_dict({"weight": torch.randn(10, 32)}, assign=True)
    h = torch.randn(2, 32)
    assert torch.equal(head(h), F.linear(h, embedding.weight))


def test_an_embedding_holding_blocks_decodes_the_rows_it_looks_up():
    embedding = Embedding(12, 32)
    table = blocks(12, 32)
    embedding.hold(table, torch.bfloat16)
    assert not embedding.state_dict()
    ids = torch.tensor([[0, 11], [5, 5]])
    assert torch.equal(embedding(ids), F.embedding(ids, table.dequantize(torch.bfloat16)))


def test_the_ranks_shares_of_the_vocabulary_add_up_to_the_whole_embedding():
    """Each rank embeds its own tokens and zeros for the rest; sum_partials adds them up."""
    table = torch.randn(12, 32)
    ids = torch.tensor([0, 5, 6, 11, 3])
    total = torch.zeros(len(ids), 32)
    for first, stop in ((0, 6), (6, 12)):
        share = Embedding(12, 32, rows=(first, stop), sum_partials=total.add_)
        share.load_state_dict({"weight": table[first:stop]}, assign=True)
        h = share(ids)
        outside = (ids < first) | (ids >= stop)
        assert h[outside].eq(0).all() and h[~outside].ne(0).all()
    assert torch.equal(total, F.embedding(ids, table))
