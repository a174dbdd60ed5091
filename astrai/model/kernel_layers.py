"""The decoder layers for a few fp32 rows on the CPU, as direct calls to the C kernels.

A batch-1 decode step spent some 5 ms of its 45 in Python around the kernels -- module calls,
eligibility checks and a fresh tensor for every op's output, about 175 us a layer on a 2-core
EPYC (benchmarks/README.md). Here a layer is nine kernel calls and the attention backend's,
with every pointer resolved once per batch size, over buffers that every layer and every step
of that batch size reuses. The kernels, their arguments and their order are those of the
modules' own forward, so the result is bit-identical to it (tested).

Buffers are per thread (two threads may run one model) and per model. The weights' pointers
are re-read when one moves (.to(), .data = ...) or the model loads new ones (load_state_dict).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from astrai.model import fused_ops, linear

# Per thread: a WeakKeyDictionary from a Transformer to its KernelLayers.
_per_thread = threading.local()


@dataclass
class LayerCalls:
    """One layer's kernel calls, as argument tuples; wo's input comes from the backend."""

    attention_norm: tuple
    qkv: tuple
    rope: tuple
    wo: tuple  # the arguments after the input pointer's place is filled
    ffn_norm: tuple
    w13: tuple
    silu_mul: tuple
    w2: tuple


class KernelLayers:
    """One model's layers as kernel calls for one batch size: weights, buffers, arguments."""

    def __init__(self, model: torch.nn.Module, rows: int):
        config = model.config
        self.weights_version = model.weights_version
        self.rows = rows
        dim, head_dim = config.dim, config.head_dim
        self.heads, self.kv_heads = config.n_heads, config.n_kv_heads
        q_size, kv_size = self.heads * head_dim, self.kv_heads * head_dim
        qkv_size = q_size + 2 * kv_size
        ffn = config.dim_ffn
        eps = config.norm_eps

        with torch.inference_mode(False):  # buffers that steps in and out of it may write
            empty = lambda *shape: torch.empty(rows, *shape)  # noqa: E731
            self.stream = (empty(dim), empty(dim))  # the residual stream, written in turns
            self.cos, self.signed_sin = empty(1, head_dim), empty(1, head_dim)
            normed, self.ffn_out = empty(dim), empty(dim)
            qkv, qk = empty(qkv_size), empty(self.heads + self.kv_heads, head_dim)
            self.wo_out, gate_up, act = empty(dim), empty(2 * ffn), empty(ffn)
        self.q, self.k = qk.split([self.heads, self.kv_heads], dim=1)
        self.v = qkv[:, q_size + kv_size :].view(rows, self.kv_heads, head_dim)
        self.buffers = (normed, qkv, qk, gate_up, act)

        # The weights whose pointers the calls hold; weights_moved() checks them every step.
        self.weights: list[Tensor] = []

        def ptr(t: Tensor | None) -> int:
            if t is None:
                return 0
            self.weights.append(t)
            return t.data_ptr()

        first, second = (t.data_ptr() for t in self.stream)
        self.layers = []
        for index, layer in enumerate(model.layers):
            attention, ffn_layer = layer.attention, layer.feed_forward
            # Layer 0 norms the embeddings (in stream[0]); later layers first add the last
            # feed-forward output to the stream (stream[1]) into stream[0].
            sum_and_terms = (first, self.ffn_out.data_ptr(), second) if index else (0, first, 0)
            self.layers.append(
                LayerCalls(
                    attention_norm=(normed.data_ptr(), *sum_and_terms,
                                    ptr(layer.attention_norm.weight), eps, rows, dim),
                    qkv=(qkv.data_ptr(), normed.data_ptr(), ptr(attention.wqkv.weight),
                         ptr(attention.wqkv.bias), rows, dim, qkv_size, False),
                    rope=(qk.data_ptr(), qkv.data_ptr(), self.cos.data_ptr(),
                          self.signed_sin.data_ptr(), rows, self.heads + self.kv_heads,
                          head_dim, qkv_size),
                    wo=(ptr(attention.wo.weight), 0, rows, q_size, dim, False),
                    ffn_norm=(normed.data_ptr(), second, self.wo_out.data_ptr(), first,
                              ptr(layer.ffn_norm.weight), eps, rows, dim),
                    w13=(gate_up.data_ptr(), normed.data_ptr(), ptr(ffn_layer.w13.weight), 0,
                         rows, dim, 2 * ffn, False),
                    silu_mul=(act.data_ptr(), gate_up.data_ptr(), rows, ffn),
                    w2=(self.ffn_out.data_ptr(), act.data_ptr(), ptr(ffn_layer.w2.weight), 0,
                        rows, ffn, dim, False),
                )
            )  # fmt: skip
        self.pointers = [t.data_ptr() for t in self.weights]

    def weights_moved(self) -> bool:
        """Whether a weight now lies elsewhere (.to(), .data = ...): some 40 us a step."""
        return [t.data_ptr() for t in self.weights] != self.pointers

    def run(
        self,
        h: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        attention: Callable[[int, Tensor, Tensor, Tensor], Tensor],
    ) -> tuple[Tensor, Tensor]:
        """(last feed-forward output, residual stream before it), as the layer loop returns.

        Both are this object's buffers: the caller reads them before the next forward pass.
        """
        self.stream[0].copy_(h)
        self.cos.copy_(cos)
        self.signed_sin.copy_(signed_sin)
        rms_norm, silu_mul, rope = (
            fused_ops._fused_ops.rms_norm,
            fused_ops._fused_ops.silu_mul,
            fused_ops._fused_ops.rope,
        )
        matmul = linear._skinny_linear.linear
        wo_out = self.wo_out.data_ptr()
        for layer_idx, calls in enumerate(self.layers):
            rms_norm(*calls.attention_norm)
            matmul(*calls.qkv)
            rope(*calls.rope)
            out = attention(layer_idx, self.q, self.k, self.v).contiguous()
            matmul(wo_out, out.data_ptr(), *calls.wo)
            rms_norm(*calls.ffn_norm)
            matmul(*calls.w13)
            silu_mul(*calls.silu_mul)
            matmul(*calls.w2)
        return self.ffn_out, self.stream[1]


def kernel_layers(model: torch.nn.Module, h: Tensor) -> KernelLayers | None:
    """The model's KernelLayers for h's rows, or None where its own modules must run.

    They run for fp32 on the CPU with every kernel built, no gradients, no torch.compile
    tracing, few enough rows for the skinny linears, and no q/k norm (Qwen3).
    """
    config = model.config
    rows = h.shape[0]
    if not (
        fused_ops._fused_ops is not None
        and linear._skinny_linear is not None
        and h.dtype == torch.float32
        and h.is_cpu
        and rows <= linear.SKINNY_MAX_ROWS
        and not config.use_qk_norm
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        # the kernels read rows 8 floats at a time
        and config.dim % 8 == 0
        and config.dim_ffn % 8 == 0
        and (config.n_heads * config.head_dim) % 8 == 0
    ):
        return None
    plans = getattr(_per_thread, "plans", None)
    if plans is None:
        plans = _per_thread.plans = weakref.WeakKeyDictionary()
    plan = plans.get(model)
    if (
        plan is None
        or plan.rows != rows
        or plan.weights_version != model.weights_version
        or plan.weights_moved()
    ):
        if not all(
            p.dtype == torch.float32 and p.is_cpu and p.is_contiguous()
            for p in model.layers.parameters()
        ):
            return None
        plan = plans[model] = KernelLayers(model, rows)
    return plan
