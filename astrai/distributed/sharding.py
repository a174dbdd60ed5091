"""Megatron-style sharding of a Llama-family model across tensor-parallel ranks.

Each rank holds a column-parallel share of wqkv (its query heads, and the key/value heads they
read) and of w13 (its share of the gate and of the up projection), and the matching
row-parallel share of wo and w2, whose partial outputs one all-reduce each adds up. A
mixture-of-experts layer splits every expert (and the shared expert) the same way: each rank
routes every token as the others do (the router is replicated) and runs its share of each
chosen expert, and the layer's one all-reduce adds the experts' partial outputs up. Its model
is then an ordinary Transformer of a narrower config (n_heads / N, n_kv_heads / N, the FFN
widths / N) and the rank's share (RankShare), so the forward pass runs unchanged. The
embedding and the LM head are vocabulary-parallel: each rank holds 1/N of the vocabulary's
rows, embeds its own tokens (the ranks' sum is every token's row) and computes its own columns
of the logits, which rank 0 gathers. Norms are replicated, but for OLMo 2's q and k norms
across all heads, which add each rank's sum of squares up before they scale (ShardedRMSNorm).
Every layer that makes partial sums is built with the function that adds them up across the
ranks (the group's all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import Tensor

from astrai.config import ConfigError, ModelConfig
from astrai.model.transformer import RankShare, Transformer


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ConfigError unless config's layers split evenly into size ranks."""
    problems = []
    if config.n_heads % size:
        problems.append(f"n_heads={config.n_heads} is not a multiple of it")
    if config.dim_ffn % size:
        problems.append(f"dim_ffn={config.dim_ffn} is not a multiple of it")
    if config.n_kv_heads >= size and config.n_kv_heads % size:
        problems.append(f"n_kv_heads={config.n_kv_heads} is not a multiple of it")
    if config.n_kv_heads < size and size % config.n_kv_heads:
        problems.append(
            f"n_kv_heads={config.n_kv_heads} does not divide it (fewer KV heads than ranks are "
            "replicated, each to the same number of ranks)"
        )
    if config.vocab_size % size:
        problems.append(f"vocab_size={config.vocab_size} is not a multiple of it")
    moe = config.moe
    if moe is not None and moe.dim_expert % size:
        problems.append(f"moe.dim_expert={moe.dim_expert} is not a multiple of it")
    if moe is not None and moe.dim_shared_expert is not None and moe.dim_shared_expert % size:
        problems.append(f"moe.dim_shared_expert={moe.dim_shared_expert} is not a multiple of it")
    if problems:
        raise ConfigError(
            f"tensor_parallel_size={size} cannot split this model: "
            + "; ".join(problems)
            + ". Pick a tensor_parallel_size that divides the model's heads and FFN width, or 1."
        )


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size`'s share of every weight (the WeightShard that AutoModel loads).

    sum_partials adds a tensor up across the ranks in place (the group's all-reduce); the layers
    that make partial sums are built with it. Without it the model loads but cannot run.
    """

    rank: int
    size: int
    sum_partials: Callable[[Tensor], object] | None = field(default=None, compare=False)

    def model(self, config: ModelConfig) -> Transformer:
        """The rank's narrower model: its query heads, KV heads, FFN columns and vocabulary
        rows; its config keeps the whole vocabulary's size, which the engine checks ids by.
        Built where the caller says (the loaders: on the meta device), to be filled."""
        check_shardable(config, self.size)
        moe = config.moe
        if moe is not None:
            shared = moe.dim_shared_expert
            moe = replace(
                moe,
                dim_expert=moe.dim_expert // self.size,
                dim_shared_expert=None if shared is None else shared // self.size,
            )
        qk_norm_widths = None
        if config.qk_norm_across_heads:  # OLMo 2: each norm spans every rank's heads
            q_size, kv_size = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
            kv_replicas = max(1, self.size // config.n_kv_heads)
            qk_norm_widths = (q_size, kv_size * kv_replicas)
        share = RankShare(self.sum_partials, self._share(0, config.vocab_size), qk_norm_widths)
        narrower = replace(
            config,
            n_heads=config.n_heads // self.size,
            n_kv_heads=max(1, config.n_kv_heads // self.size),
            dim_ffn=config.dim_ffn // self.size,
            moe=moe,
        )
        return Transformer(narrower, share)

    def spans(self, name: str, config: ModelConfig) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, ranges) of native tensor `name` this rank holds; None where it holds it whole."""
        q_size = config.n_heads * config.head_dim
        kv_size = config.n_kv_heads * config.head_dim
        if name.endswith(("attention.wqkv.weight", "attention.wqkv.bias")):
            q, k = self._share(0, q_size), self._kv_share(q_size, config)
            return 0, [q, k, (k[0] + kv_size, k[1] + kv_size)]
        if config.qk_norm_across_heads and name.endswith("attention.q_norm.weight"):
            return 0, [self._share(0, q_size)]
        if config.qk_norm_across_heads and name.endswith("attention.k_norm.weight"):
            return 0, [self._kv_share(0, config)]
        if name.endswith("attention.wo.weight"):
            return 1, [self._share(0, q_size)]
        if name.endswith(".w13.weight"):  # a dense MLP's, an expert's or the shared expert's
            width = ffn_width(name, config)
            return 0, [self._share(0, width), self._share(width, width)]
        if name.endswith(".w2.weight"):
            return 1, [self._share(0, ffn_width(name, config))]
        if name in ("tok_embeddings.weight", "output.weight"):
            return 0, [self._share(0, config.vocab_size)]
        return None

    def _kv_share(self, offset: int, config: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads in [offset, offset + n_kv_heads * head_dim): its equal part, or
        the one KV head its query heads read, where there are fewer KV heads than ranks."""
        if config.n_kv_heads >= self.size:
            return self._share(offset, config.n_kv_heads * config.head_dim)
        start = offset + self.rank * config.n_kv_heads // self.size * config.head_dim
        return start, start + config.head_dim

    def _share(self, offset: int, length: int) -> tuple[int, int]:
        """This rank's equal part of [offset, offset + length)."""
        part = length // self.size
        return offset + self.rank * part, offset + (self.rank + 1) * part


def ffn_width(name: str, config: ModelConfig) -> int:
    """The hidden width of the MLP whose w13 or w2 is native tensor `name`."""
    if ".experts." in name:
        return config.moe.dim_expert
    if ".shared_expert." in name:
        return config.moe.dim_shared_expert
    return config.dim_ffn
