"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3, OLMo 2, Granite) as
explicit tensor code.

The model works on a flattened ragged batch: num_tokens rows, each with its own position,
from any number of sequences at any offsets. It never sees how K/V are stored; each layer
hands its q/k/v to the AttentionBackend it was given for this forward pass (the paged KV
cache view in serving, DenseCausalAttention for whole padded sequences with no cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from astrai.config import ModelConfig
from astrai.kernels import (
    Embedding,
    Linear,
    TiedTable,
    add_rms_norm,
    apply_rope,
    gelu_tanh_and_mul,
    rms_norm,
    silu_and_mul,
)
from astrai.kernels.layers import held_blocks
from astrai.model.moe import MoEFeedForward
from astrai.model.rope import RotaryEmbedding, rotary_dim

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class RankShare:
    """What a tensor-parallel rank's layers need besides its narrower config (TensorShard
    works it out from the whole model's): sum_partials, which adds a tensor up across the
    ranks in place; the vocabulary's rows [first, stop) its embedding and head hold; and, for
    q and k norms across all heads (OLMo 2), the whole widths they span."""

    sum_partials: Callable[[Tensor], object] | None
    vocab_rows: tuple[int, int]
    qk_norm_widths: tuple[int, int] | None = None


@dataclass(frozen=True)
class LayerAttention:
    """What a backend must know of one layer's attention besides q, k and v.

    index picks the layer's KV cache. scale multiplies q.k (1/sqrt(head_dim) unless the model
    says otherwise); a query at position p sees the keys at positions p - window + 1 .. p when
    window is set, else all up to p; softcap c turns each scaled logit x into c * tanh(x / c).
    """

    index: int
    scale: float
    window: int | None = None
    softcap: float | None = None


class AttentionBackend(Protocol):
    """Where one layer's attention happens: stores k/v if it caches, attends, returns outputs.

    q is [num_tokens, n_heads, head_dim]; k and v are [num_tokens, n_kv_heads, head_dim], with
    rope and q/k norm already applied. Returns [num_tokens, n_heads, head_dim], computed as
    layer says (its cache, scale, window and soft-cap). q, k and v are valid for the call only
    (a replayed step reuses their memory for the next layer): a backend that keeps K/V copies
    them.
    """

    def __call__(self, layer: LayerAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: LayerAttention) -> Tensor:
    """Softmax attention of q [..., heads, L, hd] over k, v [..., kv_heads, S, hd] with the
    layer's scale and soft-cap; mask [..., L, S] is True where a query sees a key, None for
    causal attention over keys that are the queries themselves.

    SDPA cannot soft-cap, so a soft-capped layer takes transformers' eager formula.
    """
    if layer.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale, enable_gqa=True
        )
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * layer.scale / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


class DenseCausalAttention:
    """AttentionBackend for a padded [B, T] batch with no cache: causal SDPA over each row.

    attention_mask is [B, T], nonzero for real tokens (left or right padding). Pad keys are
    hidden from every query; a pad query still sees itself so its row stays finite (its
    output is garbage the caller ignores, but NaN would leak into later layers through V).
    """

    def __init__(self, attention_mask: Tensor):
        self.shape = attention_mask.shape  # [B, T]
        seq_len = self.shape[1]
        valid = attention_mask.bool()
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=valid.device).tril()
        diagonal = torch.eye(seq_len, dtype=torch.bool, device=valid.device)
        # [B, 1, T, T]: query i may see key j if j <= i and (j is real or j == i)
        self.mask = (causal & (valid[:, None, :] | diagonal))[:, None]

    def __call__(self, layer: LayerAttention, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        batch, seq_len = self.shape
        # [B * T, heads, head_dim] -> [B, heads, T, head_dim]
        q, k, v = (t.view(batch, seq_len, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        mask = self.mask
        if layer.window is not None:
            # Real tokens lie side by side with either padding, so distance in the row is
            # distance in position.
            mask = mask & torch.ones_like(mask[0, 0]).triu(1 - layer.window)
        out = attend(q, k, v, mask, layer)
        return out.transpose(1, 2).reshape(batch * seq_len, out.shape[1], out.shape[3])


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(norm(x + residual), x + residual): the residual add before a pre-norm, fused."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a vector whose parts lie on the tensor-parallel ranks (OLMo 2's q and k
    norms across all heads): each rank's sum of squares, added up across the ranks by
    sum_partials, over the whole width; the rank's part of the weight. A KV head replicated on
    r ranks counts r times, so its width is counted r times too."""

    def __init__(
        self, dim: int, width: int, eps: float, sum_partials: Callable[[Tensor], object] | None
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.width, self.eps = width, eps
        self.sum_partials = sum_partials

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        self.sum_partials(squares)
        return self.weight * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with fused qkv, optional qkv bias (Qwen2) and q/k norm (Qwen3,
    Gemma 3); its LayerAttention carries Gemma's scale, soft-cap and sliding window. A
    tensor-parallel rank's q and k norms across all heads (OLMo 2) span every rank's heads."""

    def __init__(self, config: ModelConfig, layer_idx: int, share: RankShare | None = None):
        super().__init__()
        self.layer = LayerAttention(
            index=layer_idx,
            scale=config.attention_scale or config.head_dim**-0.5,
            window=config.layer_window(layer_idx),
            softcap=config.attn_logit_softcap,
        )
        self.rope_index = int(config.uses_local_rope(layer_idx))  # which of rope_inv_freqs
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = rotary_dim(config)
        q_size = config.n_heads * config.head_dim
        kv_size = config.n_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qk_size = q_size + kv_size  # qkv's columns before v's
        self.wqkv = Linear(config.dim, q_size + 2 * kv_size, bias=config.attention_bias)
        self.wo = Linear(q_size, config.dim, bias=False)
        self.qk_norm_across_heads = config.qk_norm_across_heads
        q_dims, k_dims = (q_size, kv_size) if self.qk_norm_across_heads else (config.head_dim,) * 2
        eps = config.norm_eps
        if share is not None and share.qk_norm_widths is not None:
            q_width, k_width = share.qk_norm_widths
            self.q_norm = ShardedRMSNorm(q_dims, q_width, eps, share.sum_partials)
            self.k_norm = ShardedRMSNorm(k_dims, k_width, eps, share.sum_partials)
        else:
            qk_norm = config.use_qk_norm or config.qk_norm_across_heads
            self.q_norm = RMSNorm(q_dims, eps) if qk_norm else None
            self.k_norm = RMSNorm(k_dims, eps) if qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, signed_sin: Tensor, attention: AttentionBackend
    ) -> Tensor:
        num_tokens = x.shape[0]
        qkv = self.wqkv(x)
        if self.qk_norm_across_heads:  # OLMo 2: one norm over all of q, one over all of k
            q, k, v = qkv.split(self.split_sizes, dim=1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=1)
        # q and k heads side by side, [num_tokens, n_heads + n_kv_heads, head_dim]: one rope call
        qk = qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        cos, signed_sin = cos[self.rope_index], signed_sin[self.rope_index]
        if self.rotary_dim == self.head_dim:
            qk = apply_rope(qk, cos, signed_sin)
        else:  # partial rotary (Phi-3): the rest of each head passes unrotated
            rotated = apply_rope(qk[..., : self.rotary_dim], cos, signed_sin)
            qk = torch.cat((rotated, qk[..., self.rotary_dim :]), dim=-1)
        q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        out = attention(self.layer, q, k, v)  # [num_tokens, n_heads, head_dim]
        return self.wo(out.reshape(num_tokens, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU MLP (GeGLU with tanh GELU on Gemma); w13 is the fused gate (w1) and up (w3)
    projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w13 = Linear(config.dim, 2 * config.dim_ffn, bias=False)
        self.w2 = Linear(config.dim_ffn, config.dim, bias=False)
        self.act_and_mul = gelu_tanh_and_mul if config.hidden_act == "gelu_tanh" else silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act_and_mul(self.w13(x)))  # w13: [num_tokens, 2 * dim_ffn]


class TransformerBlock(nn.Module):
    """Pre-norm decoder layer: h = x + attention(norm(x)), then h + feed_forward(norm(h)).
    With post_norms (Gemma) each sublayer's output is normed too before its residual add;
    without pre_norms (OLMo 2) only so. Granite scales each output by residual_multiplier.

    The residual stream is carried as (the last sublayer's output, the stream before it), so
    each residual add runs fused with the norm that follows it.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        share: RankShare | None = None,
    ):
        super().__init__()
        pre_norms = config.pre_norms
        self.attention_norm = RMSNorm(config.dim, config.norm_eps) if pre_norms else None
        self.attention = Attention(config, layer_idx, share)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps) if pre_norms else None
        self.residual_multiplier = config.residual_multiplier
        moe = config.moe
        sparse = moe is not None and moe.is_sparse(layer_idx)
        self.feed_forward = MoEFeedForward(config, FeedForward) if sparse else FeedForward(config)
        post_norms = config.post_norms
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps) if post_norms else None
        self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps) if post_norms else None
        # Under tensor parallelism (astrai.distributed) wo and w2 each give this rank's partial
        # sums, which the share's sum_partials adds up across the ranks in place.
        self.sum_partials = None if share is None else share.sum_partials

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        signed_sin: Tensor,
        attention: AttentionBackend,
    ) -> tuple[Tensor, Tensor]:
        """x and residual: the previous layer's two outputs, or the embeddings and None."""
        x, residual = self._residual_add(self.attention_norm, x, residual)
        x = self.attention(x, cos, signed_sin, attention)
        if self.sum_partials is not None:
            self.sum_partials(x)
        if self.post_attention_norm is not None:
            x = self.post_attention_norm(x)
        x, residual = self._residual_add(self.ffn_norm, self._scaled(x), residual)
        x = self.feed_forward(x)
        if self.sum_partials is not None:
            self.sum_partials(x)
        if self.post_ffn_norm is not None:
            x = self.post_ffn_norm(x)
        return self._scaled(x), residual

    @staticmethod
    def _residual_add(
        pre_norm: RMSNorm | None, x: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """(the next sublayer's input, the stream x + residual): the stream pre-normed, fused
        with the add, or the stream itself where the model has no pre-norms."""
        if pre_norm is None:
            stream = x if residual is None else x + residual
            return stream, stream
        if residual is None:
            return pre_norm(x), x
        return pre_norm.add_and_norm(x, residual)

    def _scaled(self, x: Tensor) -> Tensor:
        """A sublayer's output as it joins the stream (Granite's residual_multiplier)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class Transformer(nn.Module):
    """The decoder: embedding, n_layers blocks, final norm and lm_head (tied or not).

    A tensor-parallel rank's model (astrai.distributed.TensorShard) is built with its share
    (RankShare): its layers add their partial outputs up across the ranks, its embedding and
    head hold its rows of the vocabulary, OLMo 2's q and k norms span every rank's heads. The
    loaders fill the weights of the layers built here and never swap a layer.
    """

    def __init__(self, config: ModelConfig, share: RankShare | None = None):
        super().__init__()
        self.config = config
        rows, sum_partials = None, None
        if share is not None:
            rows, sum_partials = share.vocab_rows, share.sum_partials
        self.tok_embeddings = Embedding(config.vocab_size, config.dim, rows, sum_partials)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            TransformerBlock(config, i, share) for i in range(config.n_layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        head_rows = config.vocab_size if rows is None else rows[1] - rows[0]
        # A tied head reads the embedding's table: it has no weight of its own to save or load.
        tied = TiedTable(self.tok_embeddings) if config.tie_weight else None
        self.output = Linear(config.dim, head_rows, bias=False, weight=tied)
        # A vision-language checkpoint's image encoder (astrai.model.vision), set by its loader:
        # it turns images into the embeddings of their placeholder tokens.
        self.vision: nn.Module | None = None

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionBackend,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits of a flattened ragged batch.

        input_ids and positions are [num_tokens] int64. The lm_head runs only on the rows in
        logits_indices (prefill needs just each sequence's last row), or on all rows if None.
        Returns float32 [len(logits_indices) or num_tokens, vocab_size].
        """
        h, cos, signed_sin = self.embed(input_ids, positions)
        h, residual = self.run_layers(h, cos, signed_sin, attention)
        return self.logits(h, residual, logits_indices)

    def embed(
        self,
        input_ids: Tensor,
        positions: Tensor,
        rope_lengths: Tensor | None = None,
        top: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(embeddings [num_tokens, dim], cos, signed_sin [n_ropes, num_tokens, 1, head_dim]):
        what the layers read, rope's angles built once for all of them; positions are
        [num_tokens], or [3, num_tokens] on a model with M-RoPE; rope_lengths [num_tokens] are
        the sequence lengths the tokens rotate for (RotaryEmbedding.forward); top, the highest
        position where the caller knows it (RotaryEmbedding.rotation)."""
        h = self.tok_embeddings(input_ids)
        if self.config.scale_embeddings:
            # Gemma: sqrt(dim) rounded to the model dtype first, as transformers does
            h = h * torch.tensor(self.config.dim**0.5, dtype=h.dtype)
        if self.config.embedding_multiplier != 1.0:  # Granite
            h = h * self.config.embedding_multiplier
        return h, *self.rope.rotation(positions, rope_lengths, h.dtype, top)

    def run_layers(
        self, h: Tensor, cos: Tensor, signed_sin: Tensor, attention: AttentionBackend
    ) -> tuple[Tensor, Tensor]:
        """(last feed-forward output, residual stream before it): the decoder layers, the part
        of a step the executor records and replays."""
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, signed_sin, attention)
        return h, residual

    def final_hidden(self, h: Tensor, residual: Tensor, indices: Tensor | None) -> Tensor:
        """The final norm's output for the rows in indices (all rows if None), [rows, dim] in
        the model's dtype: what the LM head reads and an embedding pools."""
        if indices is not None:
            h, residual = h[indices], residual[indices]  # [rows, dim]
        h, _ = self.norm.add_and_norm(h, residual)
        return h

    def logits(self, h: Tensor, residual: Tensor, logits_indices: Tensor | None) -> Tensor:
        """float32 logits of the rows in logits_indices (all rows if None): final norm, head."""
        return self.scaled_logits(self.output(self.final_hidden(h, residual, logits_indices)))

    def scaled_logits(self, logits: Tensor) -> Tensor:
        """float32 logits from the head's output: scaled (Granite) and capped (Gemma 2)."""
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def forward_dense(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab_size] (float32) of a padded batch, with no KV cache.

        attention_mask [B, T] marks real tokens (left or right padding); positions count real
        tokens only, so a left-padded prompt gets the same positions as an unpadded one.
        """
        batch, seq_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        logits = self.forward(
            input_ids.reshape(-1), positions.reshape(-1), DenseCausalAttention(attention_mask)
        )
        return logits.view(batch, seq_len, -1)

    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """log p(token t | tokens < t) as float32 [B, T - 1], for perplexity and scoring.

        Entries whose token or preceding token is padding are 0, so a row sums to the
        log-likelihood of its real tokens after the first.
        """
        logits = self.forward_dense(input_ids, attention_mask)[:, :-1]  # [B, T-1, vocab]
        targets = input_ids[:, 1:]
        logprobs = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        if attention_mask is None:
            return logprobs
        valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        return logprobs.masked_fill(~valid, 0.0)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its activations', and its dense weights')."""
        return self.norm.weight.dtype

    def weight_bytes(self) -> int:
        """Bytes of the weights, quantized blocks (which are not parameters) included, once
        each: a tied head and the embedding share theirs."""
        total = sum(weight.nbytes() for weight in held_blocks(self))
        return total + sum(p.numel() * p.element_size() for p in self.parameters())

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the native format: config.json and model.safetensors with native names."""
        if self.vision is not None:
            raise ValueError(
                "the native format holds language models only; serve a vision-language model "
                "from its Hugging Face directory"
            )
        if held_blocks(self):
            raise ValueError(
                "the native format holds dense weights only; load the GGUF file with "
                "dequantize=True to save it"
            )
        directory = Path(directory)
        self.config.save(directory)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
