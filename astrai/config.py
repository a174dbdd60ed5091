"""Configuration: the model's shape (ModelConfig) and the engine's limits (EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or out of range."""


@dataclass(frozen=True)
class EngineConfig:
    """Limits and switches of one InferenceEngine.

    kv_cache_memory is a byte count (> 1) or a fraction of the device's free memory
    (0 < x <= 1); the KV page pool is sized from it, not from batch size times length.
    """

    max_batch_size: int = 32
    kv_cache_memory: float = 0.25
    page_size: int = 16
    max_num_batched_tokens: int = 2048
    max_seq_len: int | None = None
    enable_prefix_cache: bool = True
    max_waiting: int = 1024
    check_invariants: bool = False

    def __post_init__(self) -> None:
        positive = {
            "max_batch_size": self.max_batch_size,
            "page_size": self.page_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_waiting": self.max_waiting,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0
        ):
            raise ConfigError(f"max_seq_len must be a positive integer, got {self.max_seq_len!r}")
        if not (self.kv_cache_memory > 0):
            raise ConfigError(
                "kv_cache_memory must be a byte count (> 1) or a fraction of free memory "
                f"in (0, 1], got {self.kv_cache_memory!r}"
            )
