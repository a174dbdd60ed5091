"""StepGraph and its arena: what a recording catches, what it refuses, which buffers it reuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from astrai.kernels import Arena, StepGraph, add_rms_norm, linear, native, rms_norm, silu_and_mul

needs_kernels = pytest.mark.skipif(native.fused_ops is None, reason="no fused-ops kernels")


class Layer(nn.Module):
    """Kernel calls only: the residual add and norm (a plain norm in the first layer)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16))

    def forward(self, x, residual):
        if residual is None:
            return rms_norm(x, self.weight, 1e-5), x
        return add_rms_norm(x, residual, self.weight, 1e-5)


class LayerWithATenOp(Layer):
    """SwiGLU of the norm repeated twice: x.repeat is an ATen op, not a kernel call."""

    def forward(self, x, residual):
        x, residual = super().forward(x, residual)
        return silu_and_mul(x.repeat(1, 2)), residual


def run(layers, x):
    residual = None
    for layer in layers:
        x, residual = layer(x, residual)
    return x, residual


def record(layer_class, n_layers: int, x: torch.Tensor):
    """(layers, graph, outputs): the layers' forward over x recorded into a new graph."""
    layers = nn.ModuleList(layer_class() for _ in range(n_layers))
    graph = StepGraph(Arena(max_rows=4))
    with graph.record(layers):
        outputs = run(layers, x)
    return layers, graph, outputs


@needs_kernels
@torch.inference_mode()
def test_an_op_outside_the_kernels_voids_the_recording():
    _, graph, _ = record(LayerWithATenOp, 3, torch.randn(2, 16))
    assert not graph.valid, "x.repeat computes outside a kernel: the recording must not hold"
    assert graph.stray == ["aten.repeat.default"] * 3


@needs_kernels
@torch.inference_mode()
def test_a_recording_of_kernel_calls_alone_replays_them_on_new_inputs():
    static = torch.randn(3, 16)
    layers, graph, (out, residual) = record(Layer, 5, static)
    assert graph.valid and len(graph.calls) == 5
    for _ in range(2):
        new = torch.randn(3, 16)
        static.copy_(new)
        graph.replay(backend=None)
        want_out, want_residual = run(layers, new)
        assert torch.equal(out, want_out) and torch.equal(residual, want_residual)


def test_arena_alternates_two_sets_of_buffers_across_layers():
    arena = Arena(max_rows=8)
    taken = []
    for _ in range(4):
        arena.start_layer()
        taken.append([arena.take((3, 16), torch.float32), arena.take((3, 16), torch.float32)])
    ptr = [[t.data_ptr() for t in layer] for layer in taken]
    assert ptr[0] == ptr[2] and ptr[1] == ptr[3]  # layer i reuses layer i - 2's buffers
    assert len({*ptr[0], *ptr[1]}) == 4  # never a buffer of its own or of the layer before


def test_what_a_step_takes_before_its_first_layer_no_layer_takes():
    """The embedding and rope's angles, which every layer reads, are taken before the first
    layer: from a set of their own, in every step however many layers the last one had."""
    arena = Arena(max_rows=8)
    for n_layers in (3, 2, 1):
        arena.start_step()
        angles = arena.take((3, 1, 16), torch.float32).data_ptr()
        in_layers = set()
        for _ in range(n_layers):
            arena.start_layer()
            in_layers |= {arena.take((3, 1, 16), torch.float32).data_ptr() for _ in range(2)}
        assert angles not in in_layers
        assert arena.take((3, 1, 16), torch.float32).data_ptr() != angles  # nor the head


def test_arena_keeps_each_row_shape_in_its_place_when_a_layer_takes_one_more():
    """The first layer norms without the residual add and takes one buffer fewer; the layers
    after it still get the buffers of the same shape in the same order."""
    arena = Arena(max_rows=8)
    arena.start_layer()
    first = [arena.take((2, 16), torch.float32), arena.take((2, 32), torch.float32)]
    arena.start_layer()
    arena.start_layer()
    third = [
        arena.take((2, 16), torch.float32),
        arena.take((2, 16), torch.float32),
        arena.take((2, 32), torch.float32),
    ]
    assert third[0].data_ptr() == first[0].data_ptr()
    assert third[2].data_ptr() == first[1].data_ptr()
    assert third[1].data_ptr() not in (first[0].data_ptr(), first[1].data_ptr())
    assert arena.take((8, 16), torch.float32).shape == (8, 16)


@pytest.mark.skipif(native.skinny_linear is None, reason="no skinny-linear kernel")
@torch.inference_mode()
def test_a_copy_of_a_strided_input_voids_the_recording():
    """A replay would read the copy's memory after the recording freed it: the copy must be
    seen, outside the kernel op."""
    weight, x = torch.randn(8, 32), torch.randn(2, 64)
    strided, contiguous = StepGraph(Arena(max_rows=4)), StepGraph(Arena(max_rows=4))
    with strided.record([]):
        linear(x[:, ::2], weight)
    rows = x[:, :32].contiguous()
    with contiguous.record([]):
        linear(rows, weight)
    assert strided.stray == ["aten.contiguous.default"] and contiguous.valid
