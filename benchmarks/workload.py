"""The shared benchmark set-up: a SmolLM2-135M-shaped random model and a seeded workload."""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)

# Llama 3.2 1B's shape, for a random model whose decode reads its weights from memory rather
# than the cache (gpu_bench.py; vs_llamacpp.py --shape 1b with SmolLM2's vocabulary).
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_tokens: int


def offline_workload(
    num_requests: int = 64,
    prompt_range: tuple[int, int] = (32, 512),
    output_range: tuple[int, int] = (32, 256),
    seed: int = 0,
    vocab_size: int = SMOLLM2_135M["vocab_size"],
) -> list[Request]:
    """Uniformly random prompt and output lengths, random token ids; the same for every run."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*output_range),
        )
        for _ in range(num_requests)
    ]


def write_random_model(directory: Path | None = None, seed: int = 0, **overrides) -> Path:
    """Write a random-weight HF llama checkpoint shaped like SmolLM2-135M; return its dir."""
    import transformers

    directory = Path(directory or tempfile.mkdtemp(prefix="astrai-bench-"))
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SMOLLM2_135M, **overrides})
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None  # the workload ignores EOS
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def left_padded(batch: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) [len(batch), longest prompt] of a static batch, left padded
    with 0s, as transformers' generate takes it."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, request in enumerate(batch):
        ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
        mask[row, width - len(request.prompt_ids) :] = 1
    return ids, mask
