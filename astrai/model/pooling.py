"""How a checkpoint says its embeddings are pooled: a sentence-transformers model directory's
modules.json and the config of its Pooling module (1_Pooling/config.json), or a GGUF file's
pooling_type, as llama.cpp writes it for an embedding model."""

from __future__ import annotations

import json
from pathlib import Path

from astrai.model.checkpoint import CheckpointError
from astrai.model.families.gguf_metadata import metadata_value
from astrai.model.weights.gguf import open_gguf

# sentence-transformers' pooling modes -> astrai's pooling (astrai.config.POOLINGS)
POOLING_MODES = {"lasttoken": "last", "mean": "mean"}
# Its older configs: one boolean key per mode.
LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# llama.cpp's pooling types (a GGUF file's {arch}.pooling_type), by their modes' names
GGUF_POOLING_TYPES = {0: None, 1: "mean", 2: "cls", 3: "lasttoken", 4: "rank"}


def checkpoint_pooling(model_path: Path) -> str | None:
    """The pooling ("last" or "mean") a sentence-transformers directory's Pooling module or a
    GGUF file's pooling_type names; None for a checkpoint that names none. A mode astrai does
    not compute is a CheckpointError that says how to choose one."""
    if model_path.is_file():
        return _gguf_pooling(model_path)
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        pooling = [m for m in modules if str(m.get("type", "")).endswith("Pooling")]
        if not pooling:
            return None
        config_file = model_path / pooling[0]["path"] / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise CheckpointError(f"cannot read the pooling config of {model_path}: {exc}") from None
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in LEGACY_MODE_KEYS.items() if config.get(key)]
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise CheckpointError(
            f"{config_file} pools by {modes}, which astrai does not compute (it pools the last "
            "token or the mean); choose one with --pooling last or --pooling mean"
        )
    if config.get("include_prompt", True) is False:
        raise CheckpointError(
            f"{config_file} leaves the prompt's instruction out of the pool (include_prompt "
            "false), which astrai does not; choose a pooling with --pooling last or mean"
        )
    return POOLING_MODES[modes[0]]


def _gguf_pooling(path: Path) -> str | None:
    """A GGUF file's pooling_type as astrai's pooling; none (0) or absent is None."""
    reader = open_gguf(path)
    architecture = metadata_value(reader, "general.architecture")
    pooling_type = metadata_value(reader, f"{architecture}.pooling_type", 0)
    mode = GGUF_POOLING_TYPES.get(pooling_type, f"type {pooling_type}")
    if mode is None:
        return None
    if mode not in POOLING_MODES:
        raise CheckpointError(
            f"{path} pools by {mode} ({architecture}.pooling_type {pooling_type}), which astrai "
            "does not compute (it pools the last token or the mean); choose one with --pooling "
            "last or --pooling mean"
        )
    return POOLING_MODES[mode]
