"""The decoder layers for a few rows on the CPU, as direct calls to the C kernels.

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
class LayerWeights:
    """Pointers to one layer's weights (0 for no qkv bias)."""

    attention_norm: int
    wqkv: int
    wqkv_bias: int
    wo: int
    ffn_norm: int
    w13: int
    w2: int


@dataclass
class LayerCalls:
    """One layer's kernel calls for one batch size, as argument tuples."""

    attention_norm: tuple
    qkv: tuple
    rope: tuple
    wo: tuple  # the arguments after out and the input, which the attention backend allocates
    ffn_norm: tuple
    w13: tuple
    silu_mul: tuple
    w2: tuple


@dataclass
class StepCalls:
    """Every layer's calls for one batch size, and the buffer views they read and write."""

    layers: list[LayerCalls]
    embedded: Tensor  # the layer-0 residual stream, the embeddings copied in
    cos: Tensor
    signed_sin: Tensor
    q: Tensor  # what the attention backend gets
    k: Tensor
    v: Tensor
    attention_out: Tensor  # where the attention writes when the backend offers decode_calls
    wo_out: int  # where wo writes
    ffn_out: Tensor  # what the layers return: the last feed-forward output and the stream
    stream: Tensor


class KernelLayers:
    """One model's layers as kernel calls: its weights' pointers, buffers for up to capacity
    rows, and the calls of each batch size met so far (argument tuples are cheap to keep)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        config = model.config
        self.weights_version = model.weights_version
        self.dtype, self.is_bf16 = dtype, dtype == torch.bfloat16
        self.dim, self.head_dim, self.ffn = config.dim, config.head_dim, config.dim_ffn
        self.heads, self.kv_heads = config.n_heads, config.n_kv_heads
        self.eps = config.norm_eps
        # The weights whose pointers the calls hold; weights_moved() checks them every step.
        self.weights: list[Tensor] = []

        def ptr(t: Tensor | None) -> int:
            if t is None:
                return 0
            self.weights.append(t)
            return t.data_ptr()

        self.layer_weights = [
            LayerWeights(
                attention_norm=ptr(layer.attention_norm.weight),
                wqkv=ptr(layer.attention.wqkv.weight),
                wqkv_bias=ptr(layer.attention.wqkv.bias),
                wo=ptr(layer.attention.wo.weight),
                ffn_norm=ptr(layer.ffn_norm.weight),
                w13=ptr(layer.feed_forward.w13.weight),
                w2=ptr(layer.feed_forward.w2.weight),
            )
            for layer in model.layers
        ]
        self.pointers = [t.data_ptr() for t in self.weights]
        self.capacity = 0
        self.steps: dict[int, StepCalls] = {}

    def weights_moved(self) -> bool:
        """Whether a weight now lies elsewhere (.to(), .data = ...): some 40 us a step."""
        return [t.data_ptr() for t in self.weights] != self.pointers

    def _allocate(self, capacity: int) -> None:
        """Buffers for up to capacity rows; calls made for the old ones are dropped."""
        dim, head_dim = self.dim, self.head_dim
        qkv_size = (self.heads + 2 * self.kv_heads) * head_dim
        with torch.inference_mode(False):  # buffers that steps in and out of it may write
            empty = lambda *shape: torch.empty(capacity, *shape, dtype=self.dtype)  # noqa: E731
            self.buffers = {
                # the residual stream, written in turns
                "stream": empty(dim),
                "stream_next": empty(dim),
                "cos": empty(1, head_dim),
                "signed_sin": empty(1, head_dim),
                "normed": empty(dim),
                "qkv": empty(qkv_size),
                "qk": empty(self.heads + self.kv_heads, head_dim),
                "attention_out": empty(self.heads * head_dim),
                "wo_out": empty(dim),
                "gate_up": empty(2 * self.ffn),
                "act": empty(self.ffn),
                "ffn_out": empty(dim),
            }
        self.capacity = capacity
        self.steps.clear()

    def _calls(self, rows: int) -> StepCalls:
        if rows > self.capacity:
            self._allocate(min(max(rows, 2 * self.capacity), linear.SKINNY_MAX_ROWS))
        b = {name: t[:rows] for name, t in self.buffers.items()}
        at = {name: t.data_ptr() for name, t in b.items()}
        first, second = at["stream"], at["stream_next"]
        dim, head_dim, ffn, eps, bf16 = self.dim, self.head_dim, self.ffn, self.eps, self.is_bf16
        q_size, kv_size = self.heads * head_dim, self.kv_heads * head_dim
        qkv_size, qk_heads = q_size + 2 * kv_size, self.heads + self.kv_heads
        layers = []
        for index, w in enumerate(self.layer_weights):
            # Layer 0 norms the embeddings (in stream); later layers first add the last
            # feed-forward output to the stream (in stream_next) into stream.
            sum_and_terms = (first, at["ffn_out"], second) if index else (0, first, 0)
            layers.append(
                LayerCalls(
                    attention_norm=(at["normed"], *sum_and_terms, w.attention_norm, eps, rows, dim,
                                    bf16),
                    qkv=(at["qkv"], at["normed"], w.wqkv, w.wqkv_bias, rows, dim, qkv_size, bf16),
                    rope=(at["qk"], at["qkv"], at["cos"], at["signed_sin"], rows, qk_heads,
                          head_dim, qkv_size, bf16),
                    wo=(w.wo, 0, rows, q_size, dim, bf16),
                    ffn_norm=(at["normed"], second, at["wo_out"], first, w.ffn_norm, eps, rows,
                              dim, bf16),
                    w13=(at["gate_up"], at["normed"], w.w13, 0, rows, dim, 2 * ffn, bf16),
                    silu_mul=(at["act"], at["gate_up"], rows, ffn, bf16),
                    w2=(at["ffn_out"], at["act"], w.w2, 0, rows, ffn, dim, bf16),
                )
            )  # fmt: skip
        q, k = b["qk"].split([self.heads, self.kv_heads], dim=1)
        return StepCalls(
            layers=layers,
            embedded=b["stream"],
            cos=b["cos"],
            signed_sin=b["signed_sin"],
            q=q,
            k=k,
            v=b["qkv"][:, q_size + kv_size :].view(rows, self.kv_heads, head_dim),
            attention_out=b["attention_out"].view(rows, self.heads, head_dim),
            wo_out=at["wo_out"],
            ffn_out=b["ffn_out"],
            stream=b["stream_next"],
        )

    def run(
        self,
        h: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        attention: Callable[[int, Tensor, Tensor, Tensor], Tensor],
    ) -> tuple[Tensor, Tensor]:
        """(last feed-forward output, residual stream before it), as the layer loop returns.

        Both are views of this object's buffers: the caller reads them before the next forward
        pass.
        """
        rows = h.shape[0]
        step = self.steps.get(rows)
        if step is None:
            step = self.steps[rows] = self._calls(rows)
        step.embedded.copy_(h)
        step.cos.copy_(cos)
        step.signed_sin.copy_(signed_sin)
        rms_norm, silu_mul, rope = (
            fused_ops._fused_ops.rms_norm,
            fused_ops._fused_ops.silu_mul,
            fused_ops._fused_ops.rope,
        )
        matmul = linear._skinny_linear.linear
        # A backend that can resolve every layer's attention call at once (a step of paged
        # decodes) writes into attention_out; any other is called layer by layer.
        decode_calls = getattr(attention, "decode_calls", None)
        direct = decode_calls and decode_calls(step.q, step.k, step.v, step.attention_out)
        attention_out = step.attention_out.data_ptr()
        for layer_idx, calls in enumerate(step.layers):
            rms_norm(*calls.attention_norm)
            matmul(*calls.qkv)
            rope(*calls.rope)
            if direct:
                direct[layer_idx]()
            else:
                out = attention(layer_idx, step.q, step.k, step.v).contiguous()
                attention_out = out.data_ptr()
            matmul(step.wo_out, attention_out, *calls.wo)
            rms_norm(*calls.ffn_norm)
            matmul(*calls.w13)
            silu_mul(*calls.silu_mul)
            matmul(*calls.w2)
        return step.ffn_out, step.stream


def kernel_layers(model: torch.nn.Module, h: Tensor) -> KernelLayers | None:
    """The model's KernelLayers for h's rows, or None where its own modules must run.

    They run on the CPU with every kernel built, no gradients, no torch.compile tracing, few
    enough rows for the skinny linears, no q/k norm (Qwen3), in fp32, or in bf16 where the
    skinny kernel takes bf16 linears (where PyTorch has no fast bf16 GEMM).
    """
    config = model.config
    dtype = h.dtype
    # the kernels read rows 8 floats or 16 bf16 at a time
    multiple = {torch.float32: 8, torch.bfloat16: 16}.get(dtype)
    if not (
        fused_ops._fused_ops is not None
        and linear._skinny_linear is not None
        and dtype in linear.KERNEL_DTYPES
        and h.is_cpu
        and h.shape[0] <= linear.SKINNY_MAX_ROWS
        and not config.use_qk_norm
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and config.dim % multiple == 0
        and config.dim_ffn % multiple == 0
        and (config.n_heads * config.head_dim) % multiple == 0
    ):
        return None
    plans = getattr(_per_thread, "plans", None)
    if plans is None:
        plans = _per_thread.plans = weakref.WeakKeyDictionary()
    plan = plans.get(model)
    if (
        plan is None
        or plan.dtype != dtype
        or plan.weights_version != model.weights_version
        or plan.weights_moved()
    ):
        if not all(
            p.dtype == dtype and p.is_cpu and p.is_contiguous() for p in model.layers.parameters()
        ):
            return None
        plan = plans[model] = KernelLayers(model, dtype)
    return plan
