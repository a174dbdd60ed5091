"""Rotary position embedding: each scaling type's frequencies, computed as transformers does.

Every function uses the same float ops in the same order as transformers' rope init functions,
so the angles (and hence the logits) match bit for bit rather than to a tolerance.

The dynamic and longrope types choose their frequencies from a sequence length: transformers
takes the longest position of each forward call, which in its generate is the whole prompt
for the prompt's tokens (one call) and the token's own position for each new token. A served
engine caches each token's K once, rotated, so here the length is fixed per token by the same
rule: a token at position p of a sequence whose prompt has S tokens rotates for a sequence of
max(p + 1, S) tokens, in whatever chunks its prompt is computed. A prompt longer than the
original context so takes the long-context frequencies throughout, as in transformers; one
that fits keeps the original ones, and each token past the original context its own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from astrai.config import ModelConfig
from astrai.kernels.fused_ops import gather_rows


def rotary_dim(config: ModelConfig) -> int:
    """How many of each head's leading dims rope rotates (fewer than head_dim on Phi-3)."""
    return config.rotary_dim or config.head_dim


def _exponents(dim: int, device: torch.device | str = "cpu") -> Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def rope_inv_freq(config: ModelConfig, long_context: bool = False) -> Tensor:
    """Rotary inverse frequencies [rotary_dim // 2] in fp32 for positions within the original
    context, or past it if long_context (they differ for longrope only; dynamic's depend on the
    position past it, dynamic_ntk_inv_freq)."""
    dim = rotary_dim(config)
    exponents = _exponents(dim)
    scaling = config.rope_scaling
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "longrope":
        factors = scaling["long_factor" if long_context else "short_factor"]
        factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * config.rope_theta**exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, scaling)
    if rope_type == "dynamic":
        # transformers' base at the original context length, in Python floats
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        base = config.rope_theta * ((factor * original / original) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**exponents)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if rope_type is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "frequency_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(base: float, dim: int, scaling: dict) -> Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by factor, those that turn more than beta_fast times are kept, a ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def dynamic_ntk_inv_freq(config: ModelConfig, lengths: Tensor) -> Tensor:
    """[num_tokens, rotary_dim // 2] fp32: dynamic NTK's frequencies for tokens rotated for
    sequences of these lengths past the original context, the base grown to each (in fp32
    tensors, as transformers computes it during generation)."""
    scaling = config.rope_scaling
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    dim = rotary_dim(config)
    seq_len = lengths.clamp(min=original)
    base = config.rope_theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim, lengths.device))


def rope_inv_freqs(config: ModelConfig) -> Tensor:
    """[n_ropes, rotary_dim // 2] fp32: rope_inv_freq's, then the sliding layers' own where the
    model gives them another base (Gemma 3's rope_local_theta, unscaled)."""
    if config.rope_local_theta is None:
        return rope_inv_freq(config)[None]
    local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
    return torch.stack((rope_inv_freq(config), rope_inv_freq(local)))


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's rotary angles, one set per rope of the model (rope_inv_freqs),
    times the scaling's attention factor (yarn, longrope); the frequencies stay fp32 whatever
    the dtype."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        scaling = config.rope_scaling or {}
        self.rope_type = scaling.get("rope_type")
        self.original_context = scaling.get("original_max_position_embeddings")
        self.attention_factor = scaling.get("attention_factor", 1.0)
        # Explicit CPU: real tensors even when the model is built under torch.device("meta").
        for name, freqs in self._frequencies().items():
            self.register_buffer(name, freqs, persistent=False)
        # rotation's tables: cos and signed sin of positions 0 .. len - 1, in one dtype
        self.tables: tuple[Tensor, Tensor] | None = None

    def _frequencies(self) -> dict[str, Tensor]:
        frequencies = {"inv_freq": rope_inv_freqs(self.config)}
        if self.rope_type == "longrope":
            frequencies["long_inv_freq"] = rope_inv_freq(self.config, long_context=True)
        return frequencies

    def _apply(self, fn, recurse=True):
        # .to(bfloat16) / .half() would round the frequencies and shift every angle; the buffers
        # are a pure function of the config, so recompute them in fp32 on the new device instead.
        super()._apply(fn, recurse)
        for name, freqs in self._frequencies().items():
            setattr(self, name, freqs.to(self.inv_freq.device))
        self.tables = None
        return self

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its sequence's length, not only its position."""
        return self.rope_type in ("longrope", "dynamic")

    def length_key(self, prompt_tokens: int) -> bytes | None:
        """What a prompt of this many tokens rotates its tokens by beyond their positions, for
        the prefix cache's keys: None where that is nothing (the prompt fits the original
        context, or the type does not look at lengths)."""
        if not self.length_dependent or prompt_tokens <= self.original_context:
            return None
        # longrope: the long factors, whatever the length; dynamic: a base for each length
        return b"longrope" if self.rope_type == "longrope" else b"dynamic:%d" % prompt_tokens

    def token_inv_freq(self, lengths: Tensor) -> Tensor:
        """[n_ropes or 1, num_tokens or 1, rotary_dim // 2] fp32: the frequencies of tokens
        rotated for sequences of these lengths."""
        if not self.length_dependent:
            return self.inv_freq[:, None, :]
        # One rope (ModelConfig refuses a local one beside these types); [num_tokens, 1]
        past_original = lengths[:, None] > self.original_context
        if self.rope_type == "longrope":
            return torch.where(past_original, self.long_inv_freq, self.inv_freq)[None]
        dynamic = dynamic_ntk_inv_freq(self.config, lengths)
        return torch.where(past_original, dynamic, self.inv_freq)[None]

    def forward(self, positions: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin [n_ropes, num_tokens, rotary_dim // 2] of tokens at positions, each
        rotated for a sequence of lengths tokens (default: position + 1, see the module).

        positions are [num_tokens], or [3, num_tokens] for M-RoPE (config.mrope_section): each
        frequency turns by the temporal, height or width position its run of the section names.
        """
        if positions.dim() == 2:
            # [num_tokens, rotary_dim // 2]: each frequency's own axis of the three
            positions = positions[self.mrope_axes.to(positions.device)].T
            freqs = positions[None].float() * self.inv_freq[:, None, :]
            return freqs.cos(), freqs.sin()
        if lengths is None:
            lengths = positions + 1
        freqs = positions[None, :, None].float() * self.token_inv_freq(lengths)
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def rotation(
        self, positions: Tensor, lengths: Tensor | None, dtype: torch.dtype, top: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """(cos, signed_sin) [n_ropes, num_tokens, 1, rotary_dim] in dtype, what apply_rope
        reads: forward's cos and sin, each half of the rotary dims turned by its frequency,
        signed_sin's first half negated.

        On the CPU, where a token's rotation depends on its position alone, they are rows of
        tables of every position so far (grown by doubling), so a decode step looks its token
        up instead of computing it: a position's row is the same whichever step and batch
        its token is in. A traced forward (torch.compile) computes them: a table's size
        depends on the positions' values. top, the highest of the positions where the caller
        knows it, spares reading it from them (a recorded step reads nothing back).
        """
        computed = positions.dim() == 2 or self.length_dependent or torch.compiler.is_compiling()
        if computed or positions.device.type != "cpu":
            cos, sin = (t.to(dtype)[:, :, None, :] for t in self(positions, lengths))
            return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        if top is None:
            top = int(positions.max()) if len(positions) else -1
        tables = self.covering(top + 1, dtype)
        if len(self.inv_freq) == 1:  # one rope: rows a recorded step can look up
            return tuple(gather_rows(table[0], positions)[None] for table in tables)
        return tables[0].index_select(1, positions), tables[1].index_select(1, positions)

    def covering(self, positions: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """rotation's tables in dtype, [n_ropes, at least positions, 1, rotary_dim] each: the
        ones it has if they are long enough, else new ones."""
        tables = self.tables
        if tables is None or tables[0].dtype != dtype or tables[0].shape[1] < positions:
            size = max(1024, 1 << (positions - 1).bit_length())
            cos, sin = (t.to(dtype)[:, :, None, :] for t in self(torch.arange(size)))
            tables = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
            self.tables = tables
        return tables

    @property
    def mrope_axes(self) -> Tensor:
        """[rotary_dim // 2] which of M-RoPE's three positions each frequency turns by."""
        section = self.config.mrope_section
        assert section is not None, "3-D positions need a model with M-RoPE (mrope_section)"
        return torch.arange(3).repeat_interleave(torch.tensor(section))
