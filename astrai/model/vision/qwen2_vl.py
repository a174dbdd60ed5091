"""Qwen2-VL's and Qwen2.5-VL's vision side as explicit tensor code: each image's patches
(astrai.model.vision.qwen2_vl_processor) embedded by a Conv3d over the repeated frame, a ViT
with 2-D rotary positions, and a merger that turns each 2x2 block of patches into one
embedding of the language model, one per `<|image_pad|>` token.

Qwen2-VL's blocks are LayerNorm + GELU MLP with full attention over each image; Qwen2.5-VL's
are RMSNorm + SwiGLU MLP, and all but its fullatt_block_indexes attend within windows of
window_size pixels. Parameters are named as transformers names them, so a checkpoint's tower
loads by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from astrai.config import ConfigError
from astrai.model.transformer import RMSNorm
from astrai.model.vision.encoder import ACTIVATIONS
from astrai.model.vision.qwen2_vl_processor import Qwen2VLImageProcessor
from astrai.model.vision.tiled_image import TiledImage

VISION_ACTIVATIONS = {**ACTIVATIONS, "silu": F.silu}
# config.json's image token, then the three a chat's image part renders as.
TOKEN_KEYS = ("image_token_id", "vision_start_token_id", "image_token_id", "vision_end_token_id")
NORM_EPS = 1e-6  # transformers' fixed epsilon for the tower's norms
# transformers' Qwen2VLVisionConfig and Qwen2_5_VLVisionConfig defaults, which published
# configs rely on; Qwen2-VL names the tower's width embed_dim and the language model's
# hidden_size, Qwen2.5-VL hidden_size and out_hidden_size.
QWEN2_VL_DEFAULTS = {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_size": 3584,
    "hidden_act": "quick_gelu",
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
QWEN2_5_VL_DEFAULTS = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": [7, 15, 23, 31],
}


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """The settings of a Qwen2-VL or Qwen2.5-VL vision tower (config.json's vision_config).

    window_size is None for Qwen2-VL (every block attends over the whole image); Qwen2.5-VL's
    blocks attend within windows of window_size pixels but those in full_attention_blocks.
    """

    width: int
    intermediate_size: int
    depth: int
    num_heads: int
    text_dim: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    hidden_act: str
    rope_theta: float
    window_size: int | None
    full_attention_blocks: tuple[int, ...]

    @classmethod
    def from_hf(cls, model_type: str, hf: Mapping[str, Any]) -> Qwen2VisionConfig:
        """The tower of a qwen2_vl or qwen2_5_vl config.json's vision_config hf."""
        qwen2_5 = model_type == "qwen2_5_vl"
        hf = {**(QWEN2_5_VL_DEFAULTS if qwen2_5 else QWEN2_VL_DEFAULTS), **hf}
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        if qwen2_5:
            width, text_dim = hf["hidden_size"], hf["out_hidden_size"]
            intermediate = hf["intermediate_size"]
        else:
            width, text_dim = hf["embed_dim"], hf["hidden_size"]
            intermediate = int(width * hf["mlp_ratio"])
        config = cls(
            width=width,
            intermediate_size=intermediate,
            depth=hf["depth"],
            num_heads=hf["num_heads"],
            text_dim=text_dim,
            in_channels=hf["in_channels"],
            patch_size=hf["patch_size"],
            temporal_patch_size=hf["temporal_patch_size"],
            merge_size=hf["spatial_merge_size"],
            hidden_act=hf["hidden_act"],
            rope_theta=float(theta),
            window_size=hf["window_size"] if qwen2_5 else None,
            full_attention_blocks=tuple(hf["fullatt_block_indexes"]) if qwen2_5 else (),
        )
        if config.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_act {config.hidden_act!r} is not supported; astrai's "
                f"Qwen2-VL tower runs {sorted(VISION_ACTIVATIONS)}"
            )
        if config.width % config.num_heads or (config.width // config.num_heads) % 4:
            raise ConfigError(
                f"vision_config's width {config.width} over {config.num_heads} heads must give "
                "a head size divisible by 4 (its 2-D rotary turns a quarter per axis)"
            )
        return config

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def window_blocks(self) -> int | None:
        """The side of a window, in merged blocks (None without windows)."""
        if self.window_size is None:
            return None
        return self.window_size // self.merge_size // self.patch_size


class PatchEmbed(nn.Module):
    """Patches [n, C * T * P * P] -> [n, width]: a Conv3d whose kernel is one patch."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, *(config.patch_size,) * 2)
        self.proj = nn.Conv3d(
            config.in_channels, config.width, kernel_size=self.shape[1:], stride=self.shape[1:],
            bias=False,
        )  # fmt: skip

    def forward(self, patches: Tensor) -> Tensor:
        weight = self.proj.weight
        return self.proj(patches.view(-1, *self.shape).to(weight.dtype)).view(len(patches), -1)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of the rows (an image or a window), q and
    k turned by the rows' 2-D rotary angles in fp32, as transformers turns them."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.n_heads = config.num_heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[int]) -> Tensor:
        n = len(x)
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).unbind(1)  # [n, heads, hd] each
        q, k = (rotated(t, cos, sin) for t in (q, k))
        # One SDPA call per segment, as transformers runs its tower off flash attention.
        out = torch.cat(
            [
                F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in qkv))[0]
                for qkv in zip(*(t.split(segments) for t in (q, k, v)), strict=True)
            ],
            dim=1,
        )  # [heads, n, hd]
        return self.proj(out.transpose(0, 1).reshape(n, -1))


def rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [n, heads, hd] turned by angles cos, sin [n, hd] (rotate-half layout), in fp32."""
    half = x.shape[-1] // 2
    x32 = x.float()
    turned = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionMlp(nn.Module):
    """Qwen2-VL's MLP: fc1, the activation, fc2."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.width, config.intermediate_size)
        self.act = VISION_ACTIVATIONS[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL's MLP: down(act(gate(x)) * up(x)), each projection with a bias."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.width, config.intermediate_size)
        self.up_proj = nn.Linear(config.width, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.width)
        self.act = VISION_ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: Qwen2VisionConfig, dim: int) -> nn.Module:
    """Qwen2.5-VL's RMSNorm, Qwen2-VL's LayerNorm."""
    return RMSNorm(dim, NORM_EPS) if config.window_size is not None else nn.LayerNorm(dim, NORM_EPS)


class VisionBlock(nn.Module):
    """Pre-norm block: x + attention(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.norm1 = _norm(config, config.width)
        self.attn = VisionAttention(config)
        self.norm2 = _norm(config, config.width)
        gated = config.window_size is not None
        self.mlp = VisionGatedMlp(config) if gated else VisionMlp(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, segments: list[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each block of merge_size^2 patches [.., width] -> one embedding [text_dim]: normed,
    concatenated, then a GELU MLP (its linears at mlp.0 and mlp.2, transformers' names)."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        merged = config.width * config.merge_size**2
        self.ln_q = _norm(config, config.width)
        self.mlp = nn.Sequential(
            nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.text_dim)
        )
        self.merged = merged

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2VisionTower(nn.Module):
    """Images' patch blocks -> one embedding per block (per image token)."""

    def __init__(self, config: Qwen2VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, images: list[Tensor]) -> Tensor:
        """images, each [rows, cols, merge^2, patch_dim] -> [sum of rows * cols, text_dim],
        image after image, each block's embedding in row-major order."""
        config = self.config
        unit = config.merge_size**2
        x = self.patch_embed(torch.cat([image.reshape(-1, image.shape[-1]) for image in images]))
        angles = self._angles([image.shape[:2] for image in images]).to(x.device)
        per_image = [image.shape[0] * image.shape[1] * unit for image in images]
        order, windows = self._windows([image.shape[:2] for image in images])
        if order is not None:  # Qwen2.5-VL: the blocks of each window side by side
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
            angles = angles.view(-1, unit, angles.shape[-1])[order].flatten(0, 1)
        cos, sin = angles.cos(), angles.sin()
        for i, block in enumerate(self.blocks):
            full = order is None or i in config.full_attention_blocks
            x = block(x, cos, sin, per_image if full else windows)
        merged = self.merger(x)  # [n_blocks, text_dim]
        return merged if order is None else merged[torch.argsort(order.to(merged.device))]

    def _angles(self, grids: list[tuple[int, int]]) -> Tensor:
        """[n_patches, head_dim] fp32 each patch's rotary angles: its row's frequencies beside
        its column's (a quarter of the head each), twice (rotate-half layout)."""
        config = self.config
        per_axis = config.head_dim // 2  # the dims each of row and column turns
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, per_axis, 2, dtype=torch.float) / per_axis)
        )
        m = config.merge_size
        positions = []
        for rows, cols in grids:
            # [rows, cols, m, m] each patch's row and column in the image
            row = torch.arange(rows)[:, None, None, None] * m + torch.arange(m)[:, None]
            col = torch.arange(cols)[None, :, None, None] * m + torch.arange(m)
            row, col = torch.broadcast_tensors(row, col)
            positions.append(torch.stack((row.flatten(), col.flatten()), dim=-1))
        freqs = torch.cat(positions)[..., None].float() * inv_freq  # [n, 2, per_axis // 2]
        freqs = freqs.flatten(1)
        return torch.cat((freqs, freqs), dim=-1)

    def _windows(self, grids: list[tuple[int, int]]) -> tuple[Tensor | None, list[int]]:
        """Qwen2.5-VL's windows: (the blocks in window order, each window's patches), windows
        of window_blocks x window_blocks blocks row by row in each image, the blocks of a
        window row by row; (None, []) for a tower without windows."""
        side = self.config.window_blocks
        if side is None:
            return None, []
        order, windows, first = [], [], 0
        for rows, cols in grids:
            index = torch.arange(rows * cols).view(rows, cols) + first
            for top in range(0, rows, side):
                for left in range(0, cols, side):
                    window = index[top : top + side, left : left + side].flatten()
                    order.append(window)
                    windows.append(len(window) * self.config.merge_size**2)
            first += rows * cols
        return torch.cat(order), windows


class Qwen2VLVision(nn.Module):
    """Images -> the embeddings that replace their `<|image_pad|>` tokens.

    Each image is one tile standing for as many `<|image_pad|>` tokens as it has merged patch
    blocks, which varies with its size; a chat's image part renders as
    `<|vision_start|><|image_pad|><|vision_end|>` (placeholder_ids), as Qwen2-VL's template
    writes it (no newline after it), and the language model places the tokens by M-RoPE
    (TiledImage.grid). The tower sees a whole image at once (its patches attend to each
    other), so it runs once per image and chunked prefill may split the image's tokens
    anywhere: each chunk takes the embeddings and M-RoPE positions of the rows it holds.
    """

    def __init__(self, hf: dict[str, Any], processor: Qwen2VLImageProcessor):
        super().__init__()
        config = Qwen2VisionConfig.from_hf(hf["model_type"], hf.get("vision_config") or {})
        geometry = (processor.patch_size, processor.temporal_patch_size, processor.merge_size)
        expected = (config.patch_size, config.temporal_patch_size, config.merge_size)
        if geometry != expected:
            raise ConfigError(
                f"preprocessor_config.json cuts patches of (patch_size, temporal_patch_size, "
                f"merge_size) {geometry}, but the vision tower takes {expected}"
            )
        missing = [key for key in TOKEN_KEYS if not isinstance(hf.get(key), int)]
        if missing:
            raise ConfigError(f"config.json names no {missing}; Qwen2-VL's prompt needs them")
        self.image_token_id = hf["image_token_id"]
        self.placeholder_ids = tuple(hf[key] for key in TOKEN_KEYS[1:])
        self.image_part_ends_line = False  # Qwen2-VL's template runs on into the next part
        self.processor = processor
        self.visual = Qwen2VisionTower(config)

    def tile(self, image: Image.Image) -> TiledImage:
        """The image's patches as one tile, and the grid of its tokens."""
        return self.processor(image)

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[Tensor]) -> list[Tensor]:
        """Each image's patch blocks [rows, cols, merge^2, patch_dim] -> its embeddings
        [rows * cols, text_dim] in the merger's dtype, all in one pass of the tower."""
        embeddings = self.visual(pixel_values)
        return list(embeddings.split([p.shape[0] * p.shape[1] for p in pixel_values]))
