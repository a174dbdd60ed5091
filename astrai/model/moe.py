"""The mixture-of-experts feed-forward of Mixtral, Qwen2-MoE and Qwen3-MoE.

A router scores every expert for each token and keeps the top k; each expert is an MLP of the
model's own kind, run once over all the rows routed to it (one grouped product per expert,
never a loop over tokens), and a token's output is its experts' outputs weighted by the
router. Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from astrai.config import ModelConfig
from astrai.kernels import linear


class GateProjection(nn.Module):
    """x W^T for the projections that gate experts (the router, the shared expert's gate).

    Not a Linear, so quantization on load passes it by: a token's experts are a discrete
    choice that a rounded W would change, and llama.cpp keeps these dense too.
    """

    def __init__(self, dim: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, dim))

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight)


class MoEFeedForward(nn.Module):
    """Top-k routed experts (plus a gated shared expert where config.moe has one).

    mlp builds one MLP from a config (the model's FeedForward); the experts are built from
    config with dim_ffn set to their own size.
    """

    def __init__(self, config: ModelConfig, mlp: Callable[[ModelConfig], nn.Module]):
        super().__init__()
        moe = config.moe
        self.top_k = moe.n_experts_per_token
        self.norm_topk_prob = moe.norm_topk_prob
        self.router = GateProjection(config.dim, moe.n_experts)
        expert_config = replace(config, dim_ffn=moe.dim_expert)
        self.experts = nn.ModuleList(mlp(expert_config) for _ in range(moe.n_experts))
        shared = moe.dim_shared_expert
        self.shared_expert = None if shared is None else mlp(replace(config, dim_ffn=shared))
        self.shared_expert_gate = None if shared is None else GateProjection(config.dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(x)
        out = self.run_experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights in x's dtype, expert ids), both [num_tokens, top_k]: softmax over every
        expert in fp32, then the top k, renormalised to sum to 1 if norm_topk_prob."""
        probs = self.router(x).float().softmax(dim=-1)  # [num_tokens, n_experts]
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def run_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Sum over each token's experts of weight * expert(x): the (token, expert) pairs are
        sorted by expert, so each expert multiplies one slice of gathered rows."""
        flat_experts = experts.flatten()  # [num_tokens * top_k], token-major
        order = flat_experts.argsort(stable=True)
        tokens = order // self.top_k  # the token of each sorted pair
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        weighted = x.new_empty(len(order), x.shape[1])  # [num_tokens * top_k, dim]
        groups = zip(
            self.experts,
            x[tokens].split(counts),  # expert e's rows: [counts[e], dim]
            weights.flatten()[order, None].split(counts),
            weighted.split(counts),
            strict=True,
        )
        for expert, rows, row_weights, out in groups:
            if len(rows):
                torch.mul(expert(rows), row_weights, out=out)
        # Pairs are added in expert order, as transformers adds them.
        return torch.zeros_like(x).index_add_(0, tokens, weighted)
